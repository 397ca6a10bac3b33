"""`v4build --backend tensorrt`, checked as far as a machine without TensorRT allows.

1. `--onnx-only` prepares graphs TensorRT's parser maps onto our plugins: attention, indexer and compressor nodes
   ask for their AOT kernel, routed-experts nodes are JIT plugin nodes over the experts' stored bytes (in place,
   as int8), FP8 weights stay quantized in place behind blocked DequantizeLinear nodes, and engine.json lists the
   optimization profiles.
2. The preparation changes no value: the prepared graph run by ONNX Runtime equals the ONNX Runtime engine, and the
   stored experts decode to exactly the checkpoint's values.
3. The profiles cover every call the scheduler makes, and the tightest one is chosen.
4. The builder glue drives TensorRT's API as documented (a recording stand-in for the tensorrt module): plans are
   built without their weights (STRIP_PLAN, REFIT_IDENTICAL; one profile covering every call), and a session
   refits a stripped plan from the checkpoint's own files, in place, through the engine folder's checked maps.
5. Without TensorRT: a full build, or opening a prepared engine, fails with one clear line.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator

from v4engine.builder.backends.profiles import profiles
from v4engine.builder.backends.tensorrt import build_plan, plan_profiles, prepare_graph
from v4engine.builder.build import BuildOptions, build
from v4engine.builder.checkpoint import Checkpoint
from v4engine.builder.weights import _Attacher
from v4engine.contract.backends import BACKENDS
from v4engine.contract.backends import BuiltPlan
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFormatError
from v4engine.contract.profiles import Profile, ProfileError, choose_profile
from v4engine.plugins import AOT_OPS, DOMAIN, PLUGIN_OPS
from v4engine.plugins.moe import decode_fp8, decode_mxfp4, e8m0_scales
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import RequestError
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.sessions import open_session
from v4engine.testkit.compare import compare_with_onnxruntime

pytestmark = pytest.mark.xdist_group("tensorrt_backend")


@pytest.fixture(scope="module")
def prepared(tiny_checkpoint, tmp_path_factory):
    """quantize -> (checkpoint, TensorRT engine folder prepared with --onnx-only), built once each."""
    made = {}

    def make(quantize: str) -> tuple[Path, Path]:
        if quantize not in made:
            checkpoint = tiny_checkpoint("flash_like", quantize=quantize)
            out = tmp_path_factory.mktemp("trt") / quantize
            build(BuildOptions(checkpoint=checkpoint, output=out, mtp=3, backend="tensorrt", dtype="fp32",
                               backend_options={"onnx_only": True}, max_batch=4, max_seq_len=256,
                               max_prefill_chunk=16, progress=False))
            made[quantize] = (checkpoint, out)
        return made[quantize]

    return make


def nodes_and_initializers(path: Path) -> tuple[list[onnx.NodeProto], dict[str, onnx.TensorProto], onnx.ModelProto]:
    model = onnx.load(str(path), load_external_data=False)
    return list(model.graph.node), {t.name: t for t in model.graph.initializer}, model


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_every_plugin_node_names_its_plugin_and_kernel(prepared):
    """Attention, indexer and compressor nodes ask for their AOT kernel; routed-experts nodes are plugin nodes run
    just in time (no `aot`), over the experts as stored when the checkpoint's are quantized."""
    _, engine = prepared("fp8")
    manifest = EngineManifest.read(engine)
    for graph in ("target", "draft"):
        nodes, _, model = nodes_and_initializers(engine / f"{graph}.onnx")
        plugin = [n for n in nodes if n.domain == DOMAIN and n.op_type in PLUGIN_OPS]
        aot, jit = [n for n in plugin if n.op_type in AOT_OPS], [n for n in plugin if n.op_type not in AOT_OPS]
        assert aot and jit, f"{graph} has both kinds of v4 op nodes"
        for node in plugin:
            a = attrs(node)
            assert (a["plugin_namespace"], a["plugin_version"]) == (b"v4", b"1"), node.name
            assert a.get("aot") == (1 if node in aot else None), node.name
        assert {n.op_type for n in jit} == {"Fp8RoutedExperts"}, "FP8 experts reach the plugin as stored"
        declared = {f.name: list(f.attribute) for f in model.functions if f.domain == DOMAIN}
        assert all("aot" in declared[op] for op in {n.op_type for n in aot})
        assert all("plugin_namespace" in declared[op] for op in {n.op_type for n in plugin})
        assert manifest.compiled.plugin_nodes[graph] == len(plugin)
    assert not list(engine.glob("*.plan")) and manifest.compiled.plans is None


def in_place(tensor: onnx.TensorProto) -> tuple[int, int]:
    ref = {e.key: e.value for e in tensor.external_data}
    return int(ref["offset"]), int(ref["length"])


def test_fp8_weights_stay_fp8_in_place(prepared):
    """Attention: FP8 in place behind a blocked DequantizeLinear. Experts: each expert's bytes in place as int8,
    one Concat per layer into the plugin node, with fp32 scale rows."""
    checkpoint, engine = prepared("fp8")
    ckpt = Checkpoint.open(checkpoint)
    nodes, inits, _ = nodes_and_initializers(engine / "target.onnx")
    q = inits["model.layers.2.attn.wq_b.weight.fp8"]
    assert q.data_type == onnx.TensorProto.FLOAT8E4M3FN
    ref = {e.key: e.value for e in q.external_data}
    info = ckpt.info("layers.2.attn.wq_b.weight")
    assert (ref["location"], int(ref["offset"]), int(ref["length"])) == (f"weights/{info.file.name}", info.offset,
                                                                         info.nbytes)
    dq = next(n for n in nodes if n.input[:1] == [q.name])
    assert dq.op_type == "DequantizeLinear" and attrs(dq) == {"axis": 1, "block_size": 128}
    stacked = "model.layers.3.ffn.routed.w1.fp8"
    joined = next(n for n in nodes if n.output[0] == stacked)
    assert joined.op_type == "Concat" and len(joined.input) == 8, "the 8 experts' own tensors, joined"
    expert = inits[joined.input[5]]
    info = ckpt.info("layers.3.ffn.experts.5.w1.weight")
    assert expert.data_type == onnx.TensorProto.INT8 and in_place(expert) == (info.offset, info.nbytes)
    moe = next(n for n in nodes if n.op_type == "Fp8RoutedExperts" and stacked in n.input)
    assert list(moe.input[3:5]) == [stacked, f"{stacked}_scale"]
    assert not any(n.op_type == "DequantizeLinear" and "routed" in n.input[0] for n in nodes), "no expert dequantized"


def test_mxfp4_experts_stay_mxfp4_in_place(prepared):
    checkpoint, engine = prepared("mxfp4")
    ckpt = Checkpoint.open(checkpoint)
    manifest = EngineManifest.read(engine)
    nodes, inits, _ = nodes_and_initializers(engine / "target.onnx")
    packed = inits["model.layers.3.ffn.routed.w2.5.mxfp4"]
    info = ckpt.info("layers.3.ffn.experts.5.w2.weight")
    out, width = ckpt.logical_shape(info.name)
    assert packed.data_type == onnx.TensorProto.INT8 and list(packed.dims) == [1, out, width // 2]
    assert in_place(packed) == (info.offset, info.nbytes), "the packed bytes, in place"
    assert in_place(inits["model.layers.3.ffn.routed.w2.5.mxfp4.e8m0"])[0] == info.scale.offset, "E8M0 too"
    joined = next(n for n in nodes if n.output[0] == "model.layers.3.ffn.routed.w2.mxfp4_scale")
    assert joined.op_type == "Concat" and "model.layers.3.ffn.routed.w2.5.mxfp4.e8m0" in joined.input, \
        "the kernel reads the E8M0 bytes as stored (no float scales)"
    moe = next(n for n in nodes if n.op_type == "Mxfp4RoutedExperts" and "layers.3." in n.input[3])
    assert list(moe.input[3:]) == [f"model.layers.3.ffn.routed.{w}.mxfp4{part}" for w in ("w1", "w2", "w3")
                                   for part in ("", "_scale")]
    weights = manifest.build["weights"]
    layers = len({n.input[3] for graph in ("target", "draft") for n in nodes_and_initializers(engine / f"{graph}.onnx")[0]
                  if n.op_type == "Mxfp4RoutedExperts"})           # the draft's k steps share one layer's experts
    assert weights["converted"] == 0 and weights["fp4 in place, bytes for the kernel"] == layers * 3 * 8
    assert "kept in place as their bytes" in manifest.experts


def with_data(tensor: onnx.TensorProto, engine: Path) -> onnx.TensorProto:
    """The initializer with its external bytes read in (onnx.load refuses our hard-linked weight files)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return tensor
    ref = {e.key: e.value for e in tensor.external_data}
    with open(engine / ref["location"], "rb") as f:
        f.seek(int(ref["offset"]))
        data = f.read(int(ref["length"]))
    loaded = onnx.TensorProto()
    loaded.CopyFrom(tensor)
    del loaded.external_data[:]
    loaded.data_location, loaded.raw_data = onnx.TensorProto.DEFAULT, data
    return loaded


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_stored_experts_decode_to_the_checkpoint_values(prepared, quantize):
    """ONNX's reference evaluator runs the graph's own weight nodes for one layer's stacked w1 (bytes and scales);
    the plugin's decoding of them (plugins/moe.py, what its kernels do) is the checkpoint's dequantized experts."""
    checkpoint, engine = prepared(quantize)
    ckpt = Checkpoint.open(checkpoint)
    model = onnx.load(str(engine / "target.onnx"), load_external_data=False)
    suffix = "mxfp4" if quantize == "mxfp4" else "fp8"
    wanted = [f"model.layers.3.ffn.routed.w1.{suffix}", f"model.layers.3.ffn.routed.w1.{suffix}_scale"]
    producers = {o: n for n in model.graph.node for o in n.output}
    needed, frontier = [], list(wanted)
    while frontier:
        node = producers.get(frontier.pop())
        if node is not None and node not in needed:
            needed.append(node)
            frontier += list(node.input)
    names = {i for n in needed for i in n.input}
    weights = [with_data(t, engine) for t in model.graph.initializer if t.name in names]
    outputs = [onnx.helper.make_tensor_value_info(w, onnx.TensorProto.UNDEFINED, None) for w in wanted]
    in_order = [n for n in model.graph.node if n in needed]                 # the graph's own (topological) order
    graph = onnx.helper.make_graph(in_order, "weights", [], outputs, weights)
    sub = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
    stored, scales = ReferenceEvaluator(sub).run(None, {})
    scales = torch.from_numpy(scales)
    got = decode_mxfp4(torch.from_numpy(stored), e8m0_scales(scales)) if quantize == "mxfp4" else \
        decode_fp8(torch.from_numpy(stored), scales)
    expected = torch.stack([ckpt.load(f"layers.3.ffn.experts.{e}.w1.weight") for e in range(8)])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_every_e8m0_byte_held_as_int8_scales_by_its_power_of_two():
    """TensorRT takes uint8 tensors only as network inputs and outputs, so E8M0 bytes are int8 in its graphs:
    -128..-1 stand for the exponents 128..255 (255, E8M0's NaN, gives inf)."""
    attach = _Attacher(None, None, BACKENDS["tensorrt"])
    attach._powers_of_two("e8m0", "scale", bias=127.0)
    graph = onnx.helper.make_graph(attach.nodes, "scales", [onnx.helper.make_tensor_value_info(
        "e8m0", onnx.TensorProto.INT8, [256])], [onnx.helper.make_tensor_value_info(
            "scale", onnx.TensorProto.FLOAT, [256])], attach.initializers)
    every = np.arange(256, dtype=np.uint8)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
    (scales,) = ReferenceEvaluator(model).run(None, {"e8m0": every.view(np.int8)})
    with np.errstate(over="ignore"):                                        # 2^128 is inf in float32
        expected = np.exp2(every.astype(np.float64) - 127).astype(np.float32)
    np.testing.assert_array_equal(scales, expected)


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_prepared_graphs_compute_what_the_onnxruntime_engine_computes(prepared, quantize, tmp_path):
    """The comparison the GPU check makes for TensorRT engines (test_gpu_tensorrt.py), with ONNX Runtime running the
    prepared graphs (their routed experts: the stored-bytes ops' functions; the engine's: QMoE or a dequantized
    MoE)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    checkpoint, engine = prepared(quantize)
    reference = tmp_path / "ort"
    build(BuildOptions(checkpoint=checkpoint, output=reference, mtp=3, max_batch=4, max_seq_len=256, progress=False))
    same, verdict = compare_with_onnxruntime(
        EngineManifest.read(engine), reference,
        lambda graph: OnnxrtRunner(SessionFromOnnx(str(engine / f"{graph}.onnx"))), atol=1e-5)
    assert same, verdict
    assert verdict.startswith("target matches, draft matches")


class RecordingSession:
    """An engine session that records the input shapes of every call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.inputs, self.outputs = inner.inputs, inner.outputs

    def run(self, feeds):
        self.calls.append({n: tuple(a.shape) for n, a in feeds.items()})
        return self.inner.run(feeds)


def test_profiles_cover_every_call_the_scheduler_makes(tiny_engine):
    _, engine = tiny_engine("flash_like", mtp=3)
    generator = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_batch=3, max_prefill_chunk=5))
    manifest = generator.manifest
    manifest.build.update(max_batch=3, max_prefill_chunk=5)       # as the engine would have been built
    scheduler = generator.scheduler
    scheduler.target_session = target = RecordingSession(scheduler.target_session)
    scheduler.drafter.session = draft = RecordingSession(scheduler.drafter.session)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6], [7, 8, 9, 10, 11, 12, 13]]
    generator.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for graph, session, kinds in (("target", target, {"prefill", "verify"}), ("draft", draft, {"extend", "cycle"})):
        graph_profiles = profiles(manifest, graph)
        assert {p.name for p in graph_profiles} == kinds
        used = set()
        for call in session.calls:
            used.add(graph_profiles[choose_profile(graph_profiles, call)].name)
        assert used == kinds, f"{graph}: every profile is the tightest for some call"


def test_no_profile_covers_a_call_beyond_the_build_limits():
    profile = Profile("verify", {"input_ids": ((1, 1), (1, 4), (8, 4))})
    assert choose_profile([profile], {"input_ids": (2, 3)}) == 0
    with pytest.raises(ProfileError, match=r"input_ids \(2, 5\)"):
        choose_profile([profile], {"input_ids": (2, 5)})


class FakeTensorRT:
    """Records what the builder asks of TensorRT's Python API (the names of tensorrt 10.x/11.x)."""

    def __init__(self):
        self.calls: list[tuple] = []
        fake = self

        class Config:
            builder_optimization_level = None

            def clear_flag(self, flag):
                fake.calls.append(("clear_flag", flag))

            def set_flag(self, flag):
                fake.calls.append(("set_flag", flag))

            def create_timing_cache(self, data):
                fake.calls.append(("create_timing_cache", bytes(data)))
                return SimpleNamespace(serialize=lambda: b"cache:" + bytes(data))

            def set_timing_cache(self, cache, ignore_mismatch):
                self.cache = cache

            def get_timing_cache(self):
                return self.cache

            def add_optimization_profile(self, profile):
                fake.calls.append(("profile", dict(profile.shapes)))

        class OptimizationProfile:
            def __init__(self):
                self.shapes = {}

            def set_shape(self, name, lo, opt, hi):
                self.shapes[name] = (lo, opt, hi)

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls.append(("network", flags))
                return "network"

            def create_builder_config(self):
                fake.config = Config()
                return fake.config

            def create_optimization_profile(self):
                return OptimizationProfile()

            def build_serialized_network(self, network, config):
                fake.calls.append(("build", config.builder_optimization_level))
                return b"plan-bytes"

        class Parser:
            def __init__(self, network, logger):
                self.num_errors = 0

            def set_flag(self, flag):
                fake.calls.append(("parser_flag", flag))

            def parse_from_file(self, path):
                fake.calls.append(("parse", Path(path).name))
                return True

        self.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
        self.Builder, self.OnnxParser = Builder, Parser
        self.NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=2)
        self.OnnxParserFlag = SimpleNamespace(ENABLE_PLUGIN_OVERRIDE="ENABLE_PLUGIN_OVERRIDE")
        self.BuilderFlag = SimpleNamespace(TF32="TF32", STRIP_PLAN="STRIP_PLAN", REFIT_IDENTICAL="REFIT_IDENTICAL")


def test_engine_build_sets_every_profile_flag_and_the_timing_cache(prepared, tmp_path):
    """A stripped plan (no weights in it) holds one profile covering every call, opt at the per-token call's (a
    refittable engine takes one). Also: preparing a graph twice changes nothing (a rebuild of a prepared
    folder)."""
    _, engine = prepared("fp8")
    manifest = EngineManifest.read(engine)
    draft = onnx.load(str(engine / "draft.onnx"), load_external_data=False)
    before = draft.SerializeToString()
    assert prepare_graph(draft, "draft")[1] == manifest.compiled.plugin_nodes["draft"]
    assert draft.SerializeToString() == before
    trt = FakeTensorRT()
    replaced = tmp_path / "timing.replaced"
    replaced.write_bytes(b"old")
    cache = tmp_path / "timing.cache"
    graph_profiles = profiles(manifest, "draft")
    (in_plan,) = plan_profiles({"draft": tuple(graph_profiles)})["draft"]
    assert in_plan == manifest.compiled.plan_profiles["draft"][0], "engine.json records the plan's profile"
    cycle = next(p for p in graph_profiles if p.name == "cycle")
    for name, (lo, opt, hi) in in_plan.shapes.items():
        assert opt == cycle.shapes[name][1], "tuned for the per-token call"
        assert lo == tuple(map(min, zip(*(p.shapes[name][0] for p in graph_profiles))))
        assert hi == tuple(map(max, zip(*(p.shapes[name][2] for p in graph_profiles))))
    result = build_plan(trt, engine / "draft.onnx", tmp_path / "draft.plan", [in_plan], 2, cache,
                        seed_cache=replaced, fp32=True)
    assert ("set_flag", "STRIP_PLAN") in trt.calls and ("set_flag", "REFIT_IDENTICAL") in trt.calls, \
        "the plan holds no weights; refitted with the same ones it keeps its speed"
    assert ("network", 1 << 2) in trt.calls, "a strongly typed network"
    assert ("parser_flag", "ENABLE_PLUGIN_OVERRIDE") in trt.calls and ("parse", "draft.onnx") in trt.calls
    assert ("create_timing_cache", b"old") in trt.calls and cache.read_bytes() == b"cache:old", "seeded, written"
    assert ("clear_flag", "TF32") in trt.calls, "fp32 engines stay fp32"
    set_profiles = [c[1] for c in trt.calls if c[0] == "profile"]
    assert set_profiles == [in_plan.shapes]
    dynamic = {s.name for s in manifest.graphs["draft"].inputs if not all(isinstance(d, int) for d in s.shape)}
    assert all(set(p) == dynamic for p in set_profiles), "every dynamic input, in every profile"
    assert ("build", 2) in trt.calls and (tmp_path / "draft.plan").read_bytes() == b"plan-bytes"
    assert result.plan == "draft.plan" and result.bytes == len(b"plan-bytes") and result.stripped


def test_without_tensorrt_a_full_build_fails_at_once(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("mixed")
    result = subprocess.run([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint),
                             "--backend", "tensorrt", "--output", str(tmp_path / "e")], capture_output=True, text=True)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "TensorRT is not installed" in lines[0] and "--onnx-only" in lines[0], result.stderr
    assert not (tmp_path / "e").exists() and not list(tmp_path.iterdir())


def test_the_runtime_refuses_batches_lengths_and_chunks_beyond_the_profiles(prepared):
    _, engine = prepared("fp8")
    for option, value in (("max_batch", 5), ("max_seq_len", 257), ("max_prefill_chunk", 17)):
        with pytest.raises(RequestError, match=f"{option} {value} exceeds the {value - 1} this tensorrt engine"):
            Generator.from_engine_dir(engine, limits=Limits(**{option: value}))


def test_a_prepared_engine_does_not_open_without_tensorrt(prepared):
    _, engine = prepared("fp8")
    with pytest.raises(Exception, match="TensorRT") as failure:
        Generator.from_engine_dir(engine)
    assert "\n" not in str(failure.value)
    assert json.loads((engine / "engine.json").read_text())["backend"] == "tensorrt"


def test_an_engine_whose_plugins_cannot_register_does_not_open(monkeypatch):
    """TensorRT and CUDA present, but not the plugins' kernels (Triton): the routed experts run just in time, so
    the session refuses in one line instead of a traceback."""
    from v4engine.plugins import tensorrt as trt_plugins
    from v4engine.runtime.sessions import tensorrt as session_module

    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="11.1.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_triton() -> None:
        raise ModuleNotFoundError("No module named 'triton'")

    monkeypatch.setattr(trt_plugins, "register_plugins", no_triton)
    with pytest.raises(session_module.TensorRTUnavailable) as failure:
        session_module._import_tensorrt()
    assert "No module named 'triton'" in str(failure.value) and "\n" not in str(failure.value)


def test_the_session_loads_the_plan_its_compile_record_names(prepared, tmp_path, monkeypatch):
    """TensorRT and a CUDA build of torch stood in for: a graph's session deserializes the plan engine.json's compile
    record names for it, read through the engine folder; a plan outside the folder is refused in one line."""
    from v4engine.runtime.sessions import tensorrt as session_module

    engine = Path(shutil.copytree(prepared("fp8")[1], tmp_path / "engine", symlinks=True))
    manifest = EngineManifest.read(engine)
    for graph in manifest.graphs:
        (engine / f"{graph}.plan").write_bytes(f"plan of {graph}".encode())
    manifest.compiled = dataclasses.replace(manifest.compiled, tensorrt="stand-in", plans={
        graph: BuiltPlan(f"{graph}.plan", 12, 0.0) for graph in manifest.graphs})
    manifest.write(engine)
    loaded = []

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            loaded.append(data)
            return SimpleNamespace(create_execution_context=lambda: None)

    trt = SimpleNamespace(Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
                          Runtime=Runtime)
    current = []                # the devices made current around deserialization (a plan belongs to the current one)
    cuda = SimpleNamespace(Stream=lambda d: None, current_device=lambda: 0,
                           device=lambda d: current.append(d) or contextlib.nullcontext())
    cuda_torch = SimpleNamespace(device=lambda kind, index: (kind, index), cuda=cuda)
    monkeypatch.setattr(session_module, "_import_tensorrt", lambda: (trt, cuda_torch))
    open_session(engine, EngineManifest.read(engine), "draft")
    open_session(engine, EngineManifest.read(engine), "draft", device=1)      # a pipeline's last stage's GPU
    assert loaded == [b"plan of draft"] * 2 and current == [("cuda", 0), ("cuda", 1)]
    (tmp_path / "outside.plan").write_bytes(b"not ours")
    manifest.compiled.plans["draft"] = BuiltPlan("../outside.plan", 8, 0.0)
    manifest.write(engine)
    with pytest.raises(EngineFormatError, match=r"build\.compile\.plans\.draft\.plan") as failure:
        open_session(engine, EngineManifest.read(engine), "draft")
    assert "\n" not in str(failure.value) and loaded == [b"plan of draft"] * 2


def test_a_stripped_plan_is_refitted_from_the_checkpoints_own_files(prepared, tmp_path, monkeypatch):
    """TensorRT stood in for: a session deserializes the stripped plan, hands TensorRT's ONNX refitter the graph's
    checked bytes and, for every initializer of the weight files, a pointer to its bytes in the checkpoint's own
    files (the engine folder's memory maps: the very bytes, nothing copied), then refits; a weight TensorRT still
    misses afterwards is refused in one line naming it."""
    from v4engine.runtime.sessions import tensorrt as session_module

    engine = Path(shutil.copytree(prepared("mxfp4")[1], tmp_path / "engine", symlinks=True))
    manifest = EngineManifest.read(engine)
    (engine / "draft.plan").write_bytes(b"stripped plan of draft")
    manifest.compiled = dataclasses.replace(manifest.compiled, tensorrt="stand-in", plans={
        graph: BuiltPlan(f"{graph}.plan", 22, 0.0, stripped=True) for graph in manifest.graphs})
    manifest.write(engine)
    calls, missing = [], []

    class Refitter:
        def __init__(self, engine_, logger):
            calls.append(("refitter", engine_))

        def get_missing_weights(self):
            return list(missing)

        def refit_cuda_engine(self):
            calls.append(("refit_cuda_engine",))
            return True

    class OnnxParserRefitter:
        num_errors = 0

        def __init__(self, refitter, logger):
            pass

        def load_model_proto(self, model, path):
            calls.append(("model", bytes(model)))
            return True

        def load_initializer(self, name, pointer, size):
            calls.append(("initializer", name, ctypes.string_at(pointer, size)))
            return True

        def refit_model_proto(self):
            calls.append(("refit_model_proto",))
            return True

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            return SimpleNamespace(create_execution_context=lambda: None, plan=bytes(data))

    trt = SimpleNamespace(Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
                          Runtime=Runtime, Refitter=Refitter, OnnxParserRefitter=OnnxParserRefitter)
    cuda = SimpleNamespace(Stream=lambda d: None, current_device=lambda: 0, device=lambda d: contextlib.nullcontext())
    monkeypatch.setattr(session_module, "_import_tensorrt", lambda: (trt, SimpleNamespace(
        device=lambda kind, index: (kind, index), cuda=cuda)))
    open_session(engine, EngineManifest.read(engine), "draft")
    model = onnx.load(str(engine / "draft.onnx"), load_external_data=False)
    assert calls[0][0] == "refitter" and calls[0][1].plan == b"stripped plan of draft"
    assert calls[1] == ("model", (engine / "draft.onnx").read_bytes())
    fed = {name: data for kind, name, data in (c for c in calls if c[0] == "initializer")}
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert sorted(fed) == sorted(t.name for t in external) and len(fed) > 50
    for tensor in external:                                   # the checkpoint's bytes, read through the links
        info = onnx.external_data_helper.ExternalDataInfo(tensor)
        with open(engine / info.location, "rb") as f:
            f.seek(info.offset or 0)
            assert fed[tensor.name] == f.read(info.length)
    assert [c[0] for c in calls[-2:]] == ["refit_model_proto", "refit_cuda_engine"]
    missing.append("model.layers.0.attn.wq_a.weight.fp8")
    with pytest.raises(EngineFormatError, match=r"draft\.onnx: the stripped plan still lacks 1 weight\(s\) after "
                                                r"the refit, 'model\.layers\.0\.attn\.wq_a\.weight\.fp8' first; "
                                                r"refused$"):
        open_session(engine, EngineManifest.read(engine), "draft")
