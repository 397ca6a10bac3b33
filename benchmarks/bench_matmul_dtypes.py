"""What ONNX Runtime's CPU MatMul computes when a weight is stored in 16 bits (issue 33).

FP8 E4M3 weights with E8M0 block scales are exactly representable in fp16 and bf16, so an engine could keep them
resident in 2 bytes instead of float32's 4, if ONNX Runtime's CPU kernels read 16-bit weights. One projection of the
slice, y = x @ W with x [1, K] and W [K, N], timed for: a float32 W; an fp16 W with fp16 activations; an fp16 or bf16
W cast to float32 inside the graph. Each at full and at basic graph optimization. The GB/s column counts the weight's
bytes as stored: a 16-bit weight read at float32's speed shows half float32's GB/s.

    .venv/bin/python -m benchmarks.bench_matmul_dtypes [--k 1024] [--n 4096] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

KINDS = ("float32", "fp16", "fp16 cast to float32", "bf16 cast to float32")


def model(kind: str, w: np.ndarray) -> bytes:
    """A one-MatMul graph whose weight is stored as `kind` says."""
    x_type = TensorProto.FLOAT16 if kind == "fp16" else TensorProto.FLOAT
    if kind == "float32":
        stored, nodes = numpy_helper.from_array(w, "W"), []
    elif kind == "fp16":
        stored, nodes = numpy_helper.from_array(w.astype(np.float16), "W"), []
    else:
        if kind.startswith("fp16"):
            stored = numpy_helper.from_array(w.astype(np.float16), "W16")
        else:                                                 # bf16: float32's top 16 bits (w is exact in them)
            top = (w.view(np.uint32) >> 16).astype(np.uint16)
            stored = helper.make_tensor("W16", TensorProto.BFLOAT16, w.shape, top.tobytes(), raw=True)
        nodes = [helper.make_node("Cast", ["W16"], ["W"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes + [helper.make_node("MatMul", ["x", "W"], ["y"])], "projection",
                              [helper.make_tensor_value_info("x", x_type, [1, w.shape[0]])],
                              [helper.make_tensor_value_info("y", x_type, [1, w.shape[1]])], [stored])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=1024, help="input width (the slice's hidden size)")
    p.add_argument("--n", type=int, default=4096, help="output width")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--runs", type=int, default=300, help="timed runs per row, after 20 warm-up runs")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((args.k, args.n)) * 0.02).astype(np.float32)
    w = ((w.view(np.uint32) >> 16) << 16).view(np.float32)          # exact in bf16 and (at this scale) close in fp16
    print("| weight | optimization | us per call | GB/s of weights as stored |\n|---|---|---|---|")
    for kind in KINDS:
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC):
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.graph_optimization_level = args.threads, level
            session = ort.InferenceSession(model(kind, w), options, providers=["CPUExecutionProvider"])
            x = rng.standard_normal((1, args.k)).astype(np.float16 if kind == "fp16" else np.float32)
            for _ in range(20):
                session.run(None, {"x": x})
            started = time.perf_counter()
            for _ in range(args.runs):
                session.run(None, {"x": x})
            seconds = (time.perf_counter() - started) / args.runs
            stored = w.size * (4 if kind == "float32" else 2)
            print(f"| {kind} | {'all' if level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL else 'basic'} | "
                  f"{seconds * 1e6:.1f} | {stored / seconds / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
