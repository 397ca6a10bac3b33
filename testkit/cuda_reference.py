"""The CUDA variant of an engine (builder/backends/onnxruntime_cuda.py) run on the CPU, for its tests: onnx's
reference evaluator runs the standard ops, and the com.microsoft kernels it uses that no CPU provider has
(QMoE's fp4 path, the float MoE at bf16, MatMulBlockQuantizedFp8Weight) are written here from their schemas'
documented semantics (ONNX Runtime 1.31's contrib op documentation), in float32:
- MatMulBlockQuantizedFp8Weight(A [..., K], B e4m3 [N, K], b_scale float32 [N, ceil(K / block_size)]) =
  A (B * b_scale repeated over each block)^T, in A's type;
- MoE / QMoE: softmax of router_probs over the experts, the k largest (ties to the lower index), not renormalized;
  fc1 [E, 2I, D] gives gate and up rows interleaved (swiglu_fusion 1); SwiGLU min(g, limit) sigmoid(alpha g)
  (clamp(u, +-limit) + beta); fc2 [E, D, I]. QMoE fp4 decodes fc [E, K, N / 2] (e2m1 codes packed along N, low
  nibble first) times 2^(e - 127) of its E8M0 scales [E, N, K / 32] times the expert's global scale.
This is an independent formulation of what the variant asks of ONNX Runtime, not ONNX Runtime's kernels: on a GPU
the GPU check runs the real ones (scripts/gpu_first_tokens.py).
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx.external_data_helper import ExternalDataInfo
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFolder

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def _experts(x: np.ndarray, probs: np.ndarray, weights, k: int, limit: float, alpha: float, beta: float,
             normalize: int) -> np.ndarray:
    """The MoE's output [T, D] in x's type; weights(e) -> (fc1 [2I, D], fc2 [D, I]) float32."""
    p = _f32(probs)
    p = np.exp(p - p.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = []
    for t in range(x.shape[0]):
        chosen = np.lexsort((np.arange(p.shape[1]), -p[t]))[:k]
        shares = p[t, chosen] / (p[t, chosen].sum() if normalize else 1.0)
        total = np.zeros(x.shape[1], np.float32)
        for e, share in zip(chosen, shares):
            if share == 0:
                continue
            fc1, fc2 = weights(e)
            h = _f32(x[t]) @ fc1.T
            gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
            total += share * ((gate / (1 + np.exp(-alpha * gate)) * (up + beta)) @ fc2.T)
        out.append(total)
    return np.stack(out).astype(x.dtype)


class MatMulBlockQuantizedFp8Weight(OpRun):
    op_domain = "com.microsoft"

    def _run(self, A, B, b_scale, a_scale=None, bias=None, block_size=128):  # noqa: N803 - the schema's names
        scale = np.repeat(_f32(b_scale), block_size, axis=1)[:, :B.shape[1]]
        return ((_f32(A) @ (_f32(B) * scale).T).astype(A.dtype),)


class MoE(OpRun):
    op_domain = "com.microsoft"

    def _run(self, x, probs, fc1, fc1_bias=None, fc2=None, fc2_bias=None, fc3=None, fc3_bias=None, k=1,
             swiglu_limit=float("inf"), activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0,
             **_):
        return (_experts(x, probs, lambda e: (_f32(fc1[e]), _f32(fc2[e])), k, swiglu_limit, activation_alpha,
                         activation_beta, normalize_routing_weights),)


class QMoE(OpRun):
    op_domain = "com.microsoft"

    def _run(self, x, probs, fc1, fc1_scales, fc1_bias=None, fc2=None, fc2_scales=None, *rest, k=1,
             swiglu_limit=float("inf"), activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0,
             quant_type="int", **_):
        if quant_type != "fp4":
            raise NotImplementedError(f"QMoE quant_type {quant_type!r}: only fp4 is written here")
        fc1_global, fc2_global = rest[-2], rest[-1]

        def decoded(packed: np.ndarray, scales: np.ndarray, global_scale: np.ndarray, e: int) -> np.ndarray:
            codes = np.stack([packed[e] & 15, packed[e] >> 4], -1).reshape(packed.shape[1], -1)      # [K, N]
            exponents = scales[e].view(np.uint8).astype(np.float32) - 127                            # [N, K / 32]
            return E2M1[codes].T * np.repeat(np.exp2(exponents), 32, axis=1) * global_scale[e]      # [N, K]

        return (_experts(x, probs, lambda e: (decoded(fc1, fc1_scales, fc1_global, e),
                                              decoded(fc2, fc2_scales, fc2_global, e)),
                         k, swiglu_limit, activation_alpha, activation_beta, normalize_routing_weights),)


class GatherElements(OpRun):
    """onnx's own takes at most 64 positions along the axis (np.choose): the same op through take_along_axis."""

    def _run(self, data, indices, axis=0):
        return (np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis),)


class ReferenceGraph:
    """One graph of a CUDA-variant engine folder in onnx's reference evaluator, its weights read through the
    engine folder's checks."""

    def __init__(self, engine_dir: str | Path, graph: str):
        manifest = EngineManifest.read(engine_dir)
        folder = EngineFolder(engine_dir)
        model = onnx.load(folder.directory / manifest.graphs[graph].file, load_external_data=False)
        maps = folder.map_weights(manifest.weights).maps
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                info = ExternalDataInfo(tensor)
                start = info.offset or 0
                tensor.raw_data = bytes(maps[info.location][start:start + info.length])
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
        self.inputs = {spec.name: spec for spec in manifest.graphs[graph].inputs}
        self._evaluator = ReferenceEvaluator(model, new_ops=[MatMulBlockQuantizedFp8Weight, MoE, QMoE,
                                                             GatherElements])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name; float32 feeds of bf16 inputs are rounded to bf16 first."""
        typed = {name: value.astype(ml_dtypes.bfloat16) if self.inputs[name].dtype == "bfloat16" else value
                 for name, value in feeds.items()}
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):      # log(0) = -inf: unchosen experts
            return dict(zip(self._evaluator.output_names, self._evaluator.run(None, typed)))
