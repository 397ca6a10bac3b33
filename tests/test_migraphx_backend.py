"""`v4build --backend migraphx`, checked as far as a machine without ROCm allows.

1. The MIGraphX variant (functions inlined, sequences split, routed experts as their stored bytes, other quantized
   weights dequantized, opset 19) runs on ONNX Runtime's CPU provider and computes what the portable engine
   computes, within 1e-4, for target and draft.
2. The allowlist check (ops, types and opset of MIGraphX's parser, read from its sources) passes on the variant
   and names each planted offender: a standard Attention node, RMSNormalization, a FLOAT8E4M3FN initializer,
   an opset beyond 19.
3. Without MIGraphX the engine folder carries compile_migraphx.sh, and opening it fails with one clear line.
4. With MIGraphX's module stood in for (tests/migraphx_standin.py: its documented semantics run by ONNX Runtime),
   the build compiles one program per bucket of static shapes, and the session, padding each call up to a
   bucket, passing weights, pools and outputs by address, gives the portable engine's tokens and acceptance;
   a program compiled for another shape, or outside the engine folder, is refused in one line.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from v4engine.builder.backends.migraphx import MIGraphXCheckError, allowlist, check, compile_programs, offenders
from v4engine.builder.build import BuildOptions, build
from v4engine.contract.backends import Program
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFormatError
from v4engine.contract.errors import V4EngineError
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.sessions import open_session
from v4engine.testkit.compare import compare_with_onnxruntime

pytestmark = pytest.mark.xdist_group("migraphx_backend")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """(MIGraphX engine, portable ONNX Runtime engine) of one MXFP4 tiny checkpoint, its other weights in bf16 (as
    the releases store them: kept in place + cast, and MIGraphX's programs take them as float32)."""
    checkpoint = tiny_checkpoint("flash_like", quantize="mxfp4", dtype="bfloat16")
    work = tmp_path_factory.mktemp("migraphx")
    common = dict(checkpoint=checkpoint, mtp=3, max_batch=4, max_seq_len=256, max_prefill_chunk=16, dtype="fp32",
                  progress=False)
    build(BuildOptions(output=work / "migraphx", backend="migraphx", **common))
    build(BuildOptions(output=work / "onnxruntime", **common))
    return work / "migraphx", work / "onnxruntime"


def graph(engine: Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(engine / f"{name}.onnx"), load_external_data=False)


def test_variant_runs_on_onnxruntime_and_equals_the_portable_engine(engines):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    migraphx, portable = engines
    same, verdict = compare_with_onnxruntime(
        EngineManifest.read(migraphx), portable,
        lambda name: OnnxrtRunner(SessionFromOnnx(str(migraphx / f"{name}.onnx"))), atol=1e-4)
    assert same, verdict
    assert verdict.startswith("target matches, draft matches")


def test_variant_is_what_migraphx_parses(engines):
    migraphx, _ = engines
    manifest = EngineManifest.read(migraphx)
    for name in ("target", "draft"):
        model = graph(migraphx, name)
        assert offenders(model) == []
        assert not model.functions and [(o.domain, o.version) for o in model.opset_import] == [("", 19)]
        assert {n.op_type for n in model.graph.node} <= set(allowlist()["ops"])
        assert not {"SplitToSequence", "SequenceAt", "DequantizeLinear"} & {n.op_type for n in model.graph.node}
    assert manifest.build["weights"]["fp8 in place + dequantize"] == 0 and manifest.build["weights"]["converted"] > 0
    assert manifest.build["weights"]["fp4 in place, bytes for the kernel"] > 0
    for groups in manifest.build["weight_groups"].values():
        assert list(groups["routed experts"]["resident"]) == ["as stored"], "no expert converted or widened"
    assert manifest.compiled.allowlist["migraphx"] == allowlist()["migraphx_version"]
    assert [p.name for p in manifest.compiled.profiles["draft"]] == ["extend", "cycle"]
    assert manifest.compiled.variant["draft"].opset == 19


def test_allowlist_names_the_migraphx_sources_it_was_read_from():
    allowed = allowlist()
    assert re.fullmatch(r"[0-9a-f]{40}", allowed["source"]["commit"]) and allowed["max_opset"] == 19
    assert "RMSNormalization" not in allowed["ops"] and "FLOAT8E4M3FN" in allowed["types_rejected"]
    assert "FLOAT8E4M3FNUZ" in allowed["types_accepted"]


def test_allowlist_check_names_every_planted_offender(engines):
    migraphx, _ = engines
    model = graph(migraphx, "draft")
    x = model.graph.input[0].name
    model.graph.node.extend([
        helper.make_node("Attention", [x, x, x], ["planted.attention"], name="planted_attention"),
        helper.make_node("RMSNormalization", [x, "planted.scale"], ["planted.norm"], name="planted_norm")])
    model.graph.initializer.append(helper.make_tensor("planted.fp8", TensorProto.FLOAT8E4M3FN, [2], [1.0, 2.0]))
    model.opset_import[0].version = 23
    found = offenders(model)
    assert "opset 23 (MIGraphX documents up to 19)" in found
    assert any(f.startswith("op Attention (node 'planted_attention'): MIGraphX reads it as the contrib op")
               for f in found)
    assert "op RMSNormalization (node 'planted_norm')" in found
    assert "type FLOAT8E4M3FN (initializer 'planted.fp8')" in found
    assert len(found) == 4
    with pytest.raises(MIGraphXCheckError) as failure:
        check(model, migraphx / "draft.onnx")
    message = str(failure.value)
    assert "\n" not in message and message.startswith(f"{migraphx / 'draft.onnx'}: MIGraphX 2.15.0")


def test_without_migraphx_the_engine_carries_its_compile_script_and_does_not_open(engines):
    migraphx, _ = engines
    manifest = EngineManifest.read(migraphx)
    script = migraphx / "compile_migraphx.sh"
    assert script.stat().st_mode & 0o111 and "v4engine.builder.backends.migraphx" in script.read_text()
    assert manifest.compiled.programs is None
    with pytest.raises(Exception, match="MIGraphX") as failure:
        Generator.from_engine_dir(migraphx)
    assert "\n" not in str(failure.value)


@pytest.fixture(scope="module")
def compiled(engines, tmp_path_factory):
    """The MIGraphX engine with its programs compiled by the stand-in (tests/migraphx_standin.py): one per bucket."""
    import migraphx_standin

    engine = Path(shutil.copytree(engines[0], tmp_path_factory.mktemp("compiled") / "engine", symlinks=True))
    manifest = EngineManifest.read(engine)
    programs = compile_programs(engine, manifest, migraphx_standin, manifest.compiled.profiles, progress=False)
    manifest.compiled = dataclasses.replace(manifest.compiled, migraphx="stand-in", programs=programs)
    manifest.write(engine)
    return engine


@pytest.fixture
def standin(monkeypatch):
    """MIGraphX's module and a ROCm GPU stood in for: the stand-in's programs, torch CPU tensors as device memory."""
    import migraphx_standin
    from v4engine.runtime.sessions import migraphx as session_module

    monkeypatch.setattr(session_module, "_migraphx", lambda: migraphx_standin)
    monkeypatch.setattr(session_module, "_gpu", lambda device: (torch, torch.device("cpu")))
    migraphx_standin.runs.clear()
    return migraphx_standin


def test_one_program_per_bucket_of_static_shapes(compiled):
    manifest = EngineManifest.read(compiled)
    draft = [p.bucket for p in manifest.compiled.programs["draft"]]
    assert draft == ["extend.b1", "extend.b2", "extend.b4", "cycle.b1", "cycle.b2", "cycle.b4"]
    target = [p.bucket for p in manifest.compiled.programs["target"]]
    blocks = manifest.caches["target"].table_blocks(manifest.build["max_seq_len"])
    widths = [w for w in (1, 2, 4, 8) if w < blocks] + [blocks]
    assert target == [f"{kind}.b{b}.t{t}" for kind in ("prefill", "verify") for b in (1, 2, 4) for t in widths]
    assert all((compiled / p.file).is_file() for ps in manifest.compiled.programs.values() for p in ps)


def test_programs_run_the_tokens_and_acceptance_of_onnx_runtime(engines, compiled, standin):
    """Padded up to their buckets (a batch of 3 to 4 rows, verify rows riding along a prefill chunk, block tables
    widened), with weights, pools and outputs passed by address, the programs give the portable engine's tokens
    and per-step acceptance; the pools are the session's, at the buckets' exact sizes, and never copied."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    batch = [[(7 * i + 3 * j) % 90 + 2 for j in range(length)] for i, length in enumerate((5, 41, 23))]
    want = Generator.from_engine_dir(engines[1], mtp=2, prefix_cache=False).generate(batch, params)
    generator = Generator.from_engine_dir(compiled, mtp=2, prefix_cache=False)
    got = generator.generate(batch, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.metrics["accepted_per_step"] == w.metrics["accepted_per_step"]
    session, manifest = generator.scheduler.target_session, EngineManifest.read(compiled)
    blocks = manifest.build["max_batch"] * manifest.caches["target"].table_blocks(manifest.build["max_seq_len"])
    assert session.pool_shape == {"pool_slots": manifest.build["max_batch"], "pool_blocks": blocks}
    pools = generator.scheduler.pools["target"].arrays
    assert all(isinstance(a, torch.Tensor) for a in pools.values())
    assert {a.shape[0] for name, a in pools.items()} == {manifest.build["max_batch"], blocks}
    weights = set(session._weights)
    target = onnx.load(str(compiled / "target.onnx"), load_external_data=False).graph.initializer
    assert any(t.data_type == TensorProto.BFLOAT16 for t in target if t.name in weights)     # passed as float32
    target_runs = [set(run.split(",")) for run in standin.runs if "lengths" not in run]       # (the draft's take it)
    assert weights and target_runs and all(weights <= run for run in target_runs)
    assert any("main:#output_:00010" in run for run in standin.runs)


def test_a_program_of_another_shape_or_outside_the_engine_is_refused(compiled, standin, tmp_path):
    engine = Path(shutil.copytree(compiled, tmp_path / "engine", symlinks=True))
    manifest = EngineManifest.read(engine)
    programs = manifest.compiled.programs["draft"]
    swapped = (programs[1], Program(programs[1].bucket, programs[0].file)) + programs[2:]     # b2's bucket, b1's file
    manifest.compiled = dataclasses.replace(manifest.compiled, programs={**manifest.compiled.programs,
                                                                         "draft": (programs[0],) + swapped[1:]})
    manifest.write(engine)
    generator = Generator.from_engine_dir(engine, mtp=2, prefix_cache=False)     # programs load on first use
    with pytest.raises(EngineFormatError, match="bucket extend.b2") as failure:   # two prompts of > k + 1
        generator.generate([[5, 6, 7, 1, 2, 3], [8, 9, 4, 1, 2]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert "\n" not in str(failure.value)
    shutil.copy(engine / programs[0].file, tmp_path / "outside.mxr")         # a program outside the folder
    outside = (Program(programs[0].bucket, "../outside.mxr"),) + programs[1:]
    manifest.compiled = dataclasses.replace(manifest.compiled, programs={**manifest.compiled.programs,
                                                                         "draft": outside})
    manifest.write(engine)
    with pytest.raises(EngineFormatError, match=r"build\.compile\.programs\.draft\[0\]\.file") as failure:
        open_session(engine, EngineManifest.read(engine), "draft")
    assert "\n" not in str(failure.value)


def test_compiling_replaces_a_planted_link_and_never_writes_through_it(engines, tmp_path):
    """compile_migraphx.sh runs on an engine folder from elsewhere: a link planted where a program goes is replaced
    by the program, and the file it pointed to is left as it was."""
    import migraphx_standin

    engine = Path(shutil.copytree(engines[0], tmp_path / "engine", symlinks=True))
    victim = tmp_path / "victim"
    victim.write_text("not a program")
    (engine / "draft.extend.b1.mxr").symlink_to(victim)
    manifest = EngineManifest.read(engine)
    compile_programs(engine, manifest, migraphx_standin, manifest.compiled.profiles, progress=False)
    assert victim.read_text() == "not a program"
    program = engine / "draft.extend.b1.mxr"
    assert not program.is_symlink() and program.is_file()
    assert not [p for p in engine.iterdir() if p.name.startswith(".")]        # no temporary left behind


def test_pools_the_programs_take_must_fit_the_cache_budget(compiled, standin):
    """The programs take pools of max_batch x max_seq_len as built, allocated whole: a smaller budget is refused in
    one line at load, not met by the first call."""
    with pytest.raises(V4EngineError, match="rebuild it with a smaller --max-batch or --max-seq-len") as failure:
        Generator.from_engine_dir(compiled, mtp=2, limits=Limits(max_cache_bytes=1 << 16))
    assert "\n" not in str(failure.value)


def test_without_torch_on_a_gpu_the_programs_do_not_open(compiled, monkeypatch):
    import migraphx_standin
    from v4engine.runtime.sessions import migraphx as session_module

    monkeypatch.setattr(session_module, "_migraphx", lambda: migraphx_standin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(session_module.MIGraphXUnavailable, match="AMD GPU") as failure:
        open_session(compiled, EngineManifest.read(compiled), "draft")
    assert "\n" not in str(failure.value)
