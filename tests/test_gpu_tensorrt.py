"""(d) of the GPU check: `v4build --backend tensorrt` engines of tiny FP8 and MXFP4 checkpoints (our plugins and
their AOT kernels, FP8 and FP4 weights in place) compute what the ONNX Runtime engine computes on a first call.

fp32 engines, built without TF32, within 1e-3: TensorRT's GEMM tactics reorder sums. Needs a CUDA GPU, TensorRT and
polygraphy, and is skipped, with the reason, where one is missing (TensorRT installs neither on the machine that
runs the tests nor on the lent GPU machine). tests/test_tensorrt_backend.py checks the same graphs on ONNX Runtime.
"""
from __future__ import annotations

import pytest
import torch

from v4engine.builder.build import BuildOptions, build
from v4engine.testkit.compare import compare_with_onnxruntime

TENSORRT_ATOL = 1e-3

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: TensorRT needs one")]


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_tensorrt_engines_compute_what_onnxruntime_computes(quantize, tiny_checkpoint, tmp_path, record_property):
    tensorrt = pytest.importorskip("tensorrt")
    trt = pytest.importorskip("polygraphy.backend.trt")
    common = dict(checkpoint=tiny_checkpoint("flash_like", quantize=quantize), mtp=2, max_batch=4, max_seq_len=256,
                  max_prefill_chunk=16, dtype="fp32", progress=False)
    engine = tmp_path / "tensorrt"
    manifest = build(BuildOptions(output=engine, backend="tensorrt", **common))
    build(BuildOptions(output=tmp_path / "onnxruntime", **common))
    same, verdict = compare_with_onnxruntime(
        manifest, tmp_path / "onnxruntime",
        lambda graph: trt.TrtRunner(trt.EngineFromBytes((engine / f"{graph}.plan").read_bytes()),
                                    optimization_profile=0), TENSORRT_ATOL)
    record_property("verdict", f"TensorRT {tensorrt.__version__}: {verdict}")
    assert same, verdict
