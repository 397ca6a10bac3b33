"""Engines for ONNX Runtime's CUDA provider (v4build --device cuda), checked without a GPU.

1. Every node of tiny-v4's CUDA engines (MTP 3, and DSpark 5 in V4-Flash-0731's layout; bf16) has a kernel of the
   CUDA provider of onnxruntime-gpu 1.31.1 for its types (the provider's registrations, vendored in
   builder/backends/ort_cuda_kernels.json) and runs where ONNX Runtime would put it without a copy between host and
   device: what stays on the host is shape arithmetic only, on int64 values.
2. A node the provider has no kernel for fails the check, and the build, naming it.
3. The variant computes what the CPU engine computes: its graphs run by onnx's reference evaluator, with the
   com.microsoft kernels written from their documented semantics (testkit/cuda_reference.py), against the fp32
   CPU engine on ONNX Runtime: logits within 2% of their largest magnitude (bf16 against fp32; 0.6% measured) and
   the same argmax at every position; a greedy row's drafts equal, the first draft's distribution within 0.02 in
   total variation (0.006 measured). Routed experts in FP8 (tiny-v4) and MXFP4 (QMoE fp4, a random tiny checkpoint
   against our PyTorch model run in bf16) both.
4. Weights reach the device as stored: the engine holds within 5% of the checkpoint's bytes once loaded.
5. A CUDA engine refuses the CPU provider in one line.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from conftest import TRAINED, TRAINED_DSPARK
from v4engine.builder.backends.onnxruntime_cuda import CudaVariantError, placement, prepare, value_types
from v4engine.builder.load import load_model, open_checkpoint
from v4engine.builder.model import ModelState
from v4engine.builder.weights import _fp4_transposed
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFormatError
from v4engine.runtime.generator import Generator
from v4engine.testkit.compare import first_call_feeds
from v4engine.testkit.cuda_reference import ReferenceGraph

ENGINES = {"tiny-v4 MTP 3": (TRAINED, 3), "tiny-v4-dspark DSpark 5": (TRAINED_DSPARK, 5)}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, cuda_engine):
    checkpoint, mtp = ENGINES[request.param]
    return cuda_engine(checkpoint, mtp)


def test_every_node_of_tiny_v4s_cuda_engines_runs_on_the_cuda_provider(engine):
    manifest = EngineManifest.read(engine)
    assert (manifest.dtype, manifest.compiled.device) == ("bf16", "cuda")
    assert manifest.compiled.cuda_graphs == ("verify", "cycle"), "verify and draft cycles recorded"
    for graph, entry in manifest.graphs.items():
        model = onnx.load(engine / entry.file, load_external_data=False)
        found = placement(model)
        assert found.offenders == [], f"{graph}: {found.offenders[:3]}"
        types = value_types(model)
        host = set(found.host_shape_nodes)
        on_host = [n for n in model.graph.node if (n.name or n.output[0]) in host]
        assert {types[o] for n in on_host for o in n.output} <= {onnx.TensorProto.INT64, onnx.TensorProto.BOOL}, \
            f"{graph}: only shape arithmetic stays on the host"
        assert all(n.domain in ("", "com.microsoft") for n in model.graph.node), "the v4 ops inlined"


def test_a_node_the_cuda_provider_has_no_kernel_for_fails_naming_it(engine):
    model = onnx.load(engine / "target.onnx", load_external_data=False)
    model.graph.node.append(helper.make_node("Unique", ["logits"], ["planted"], name="planted_unique"))
    model.graph.output.append(helper.make_tensor_value_info("planted", onnx.TensorProto.FLOAT, None))
    found = placement(onnx.shape_inference.infer_shapes(model))
    assert len(found.offenders) == 1 and found.offenders[0].startswith("Unique 'planted_unique' (float)") \
        and "no CUDA kernel" in found.offenders[0]
    with pytest.raises(CudaVariantError, match=r"^graph 'target': 1 node\(s\) would not run on ONNX Runtime 1\.31\.1's "
                                               r"CUDA provider: Unique 'planted_unique'"):
        prepare(model, "target")


def _compare(cuda_engine_dir, cpu_engine_dir, graph):
    """(CPU engine's outputs on ONNX Runtime, the CUDA variant's in the reference evaluator) on one first call."""
    cpu = EngineManifest.read(cpu_engine_dir)
    feeds = first_call_feeds(cpu, graph, 2, 9)
    session = ort.InferenceSession(str(cpu_engine_dir / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = ReferenceGraph(cuda_engine_dir, graph).run(feeds)
    return want, {name: value if value.dtype == np.int64 else value.astype(np.float32) for name, value in got.items()}


def _same_computation(cuda_dir, cpu_dir):
    want, got = _compare(cuda_dir, cpu_dir, "target")
    logits, variant = want["logits"], got["logits"]
    assert np.abs(logits - variant).max() <= 0.02 * np.abs(logits).max()
    assert (logits.argmax(-1) == variant.argmax(-1)).all()
    want, got = _compare(cuda_dir, cpu_dir, "draft")
    assert (want["drafts"][0] == got["drafts"][0]).all(), "row 0 drafts greedily"
    distance = 0.5 * np.abs(want["draft_probs"][:, 0] - got["draft_probs"][:, 0]).sum(-1)     # total variation
    assert (distance <= 0.02).all()


def test_the_cuda_variant_computes_what_the_cpu_engine_computes_fp8_experts(cuda_engine, trained_engine,
                                                                            trained_dspark_engine):
    _same_computation(cuda_engine(TRAINED, 3), trained_engine)
    _same_computation(cuda_engine(TRAINED_DSPARK, 5), trained_dspark_engine[1])


def test_the_cuda_variant_computes_what_bf16_eager_computes_mxfp4_experts_in_qmoe(cuda_engine, tiny_engine):
    """A random tiny MXFP4 checkpoint is ill-conditioned at bf16 (its indexer's picks flip: fp32 against bf16 eager
    differ by 13% of the largest logit), so its oracle is our PyTorch model run in bf16 (builder/model/v4.py, the
    same weights decoded): within 3% (1.7% measured)."""
    checkpoint, cpu = tiny_engine("flash_like", quantize="mxfp4", dtype="bfloat16")
    engine = cuda_engine(checkpoint, 0)                                   # the target is what holds QMoE
    assert "QMoE" in {n.op_type for n in onnx.load(engine / "target.onnx", load_external_data=False).graph.node}
    feeds = first_call_feeds(EngineManifest.read(cpu), "target", 2, 9)
    model = load_model(checkpoint, mtp=False, dtype=torch.bfloat16)
    state = ModelState(model.cfg, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(torch.tensor(feeds["input_ids"]), state.positions(9), state.views()).logits.float().numpy()
    variant = ReferenceGraph(engine, "target").run(feeds)["logits"].astype(np.float32)
    assert np.abs(eager - variant).max() <= 0.03 * np.abs(eager).max()


def _codes(packed: np.ndarray) -> np.ndarray:
    """e2m1 codes [rows, 2 * cols] of bytes [rows, cols], low nibble first."""
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def test_mxfp4_experts_are_prepacked_as_qmoes_codes_without_decoding(tiny_checkpoint):
    """QMoE's fp4 layout is [in, out / 2], packed along out: the checkpoint's e2m1 codes ([out, in / 2]) moved,
    never decoded, gate and up rows interleaved for fc1."""
    _, ckpt = open_checkpoint(tiny_checkpoint("flash_like", quantize="mxfp4"), mtp=True)
    gate, up = (ckpt.info(f"layers.0.ffn.experts.0.{w}.weight") for w in ("w1", "w3"))
    stored = [_codes(np.asarray(ckpt.raw(info.name)).view(np.uint8)) for info in (gate, up)]      # [out, in] each
    interleaved = np.stack(stored, axis=1).reshape(-1, stored[0].shape[1])                      # [2 out, in]
    np.testing.assert_array_equal(_codes(_fp4_transposed(ckpt, [gate, up])), interleaved.T)


def test_weights_reach_the_device_as_stored(engine):
    manifest = EngineManifest.read(engine)
    for graph, groups in manifest.build["weight_groups"].items():
        stored = sum(n for g in groups.values() for n in g["stored"].values())
        resident = sum(n for g in groups.values() for n in g["resident"].values())
        assert resident <= 1.05 * stored, f"{graph}: {resident} bytes resident for {stored} stored"


def test_a_cuda_engine_refuses_the_cpu_provider_in_one_line(engine):
    for options in (None, {"providers": ["CPUExecutionProvider"]}):
        with pytest.raises(EngineFormatError, match=r"built for ONNX Runtime's CUDA provider \(v4build --device "
                                                    r"cuda\) and runs nowhere else, but .*; rebuild without --device "
                                                    r"cuda to run on the CPU$") as e:
            Generator.from_engine_dir(engine, backend_options=options)
        assert "\n" not in str(e.value)
