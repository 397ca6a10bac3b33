"""Output shapes and I/O types of the v4 ops as their TensorRT plugins declare them; imports no tensorrt.

This is the one place the plugins (plugins.py: `@trtp.register` and `@trtp.autotune`) take shapes and types from,
so it must hold without TensorRT; tests/test_tensorrt_plugins.py checks it against ONNX shape inference on
exported graphs. A shape is a sequence of dims; a dim is an int or a symbolic expression: TensorRT's `ShapeExpr`
while an engine is built, a stand-in in tests. The formulas therefore use only what a `ShapeExpr` supports with
an expression on the left: `+`, `*` and `//` (the discipline of `kernels/launch.cdiv`), and `minimum`, which
takes the symbolic min as a parameter (`trtp.min` on TensorRT) because min() cannot see into an expression.

Types use the names of TensorRT's autotune grammar. The activations of one call (q, kv, rows, a compressor's
values and gates, and the outputs derived from them) share one type, FP32, FP16 or BF16, as the kernels assume;
positions, row ids and top-k picks are INT64; the attention sink and the indexer's head weights are FP32, as the
model keeps them whatever the activation type (FP32_PARAMETERS and `weights_proj(x).float()` in builder/model);
so are the routing weights, FP8 experts' scales and the experts' sum; the experts' stored bytes are INT8, and so
are MXFP4 experts' E8M0 scale bytes (2^(e-127), decoded in the kernels: held as stored).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from v4engine.contract.layout import emitted_rows

Dim = Any                                  # int or symbolic expression
Shape = Sequence[Dim]
MinFn = Callable[[Dim, Dim], Dim]

ACT = "ACT"                                # placeholder: the call's activation type
ACTIVATION_TYPES = ("FP32", "FP16", "BF16")
F32, I64, I8 = "FP32", "INT64", "INT8"


def minimum(a: Dim, b: Dim, symbolic_min: MinFn) -> Dim:
    """min(a, b): Python's for two ints (trtp.min refuses those), symbolic_min otherwise."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return symbolic_min(a, b)


OutputsFn = Callable[[Sequence[Shape], Mapping[str, Any], MinFn], list[Shape]]
DimsFn = Callable[[Sequence[Shape]], dict[str, Dim]]


@dataclass(frozen=True)
class OpShapes:
    """One op's I/O as a plugin declares it; inputs in the order of the op's PyTorch function."""
    input_types: tuple[str, ...]           # per input: ACT or a fixed type
    output_types: tuple[str, ...]
    outputs: OutputsFn                     # (input shapes, attributes, symbolic min) -> output shapes
    dims: DimsFn                           # input shapes -> the named dims of the op's launch plan (kernels/)
    static: tuple[str, ...]                # dims the kernel bakes in as constexprs: fixed when an engine is built

    @property
    def activation_input(self) -> int:
        """An input that carries the activation type (every op has one: the type outputs follow)."""
        return self.input_types.index(ACT)

    def combinations(self) -> list[tuple[str, ...]]:
        """Every supported type combination, inputs then outputs: one per activation type."""
        io = self.input_types + self.output_types
        return [tuple(act if t == ACT else t for t in io) for act in ACTIVATION_TYPES]


# --------------------------------------------------------------------------- attention
def _like_q(shapes: Sequence[Shape], attrs: Mapping[str, Any], symbolic_min: MinFn) -> list[Shape]:
    return [tuple(shapes[0])]


def _sliding_dims(shapes: Sequence[Shape]) -> dict[str, Dim]:
    """q [B,S,H,d], q_pos, kv [B,T,d], kv_pos, sink."""
    (B, S, H, d), _, kv = shapes[:3]
    return dict(B=B, S=S, H=H, d=d, T=kv[1])


def _paged_dims(shapes: Sequence[Shape], first: int) -> dict[str, Dim]:
    """pool [blocks, page_rows, C], block_table [B, W], new rows [B, N, C] from input `first` on."""
    pool, table, new = shapes[first:first + 3]
    return dict(page_rows=pool[1], W=table[1], N=new[1])


def _hca_paged_dims(shapes: Sequence[Shape]) -> dict[str, Dim]:
    """... pool, block_table, new_rows, row_ids [B,R], sink."""
    return _sliding_dims(shapes) | _paged_dims(shapes, 4) | dict(R=shapes[7][1])


def _csa_paged_dims(shapes: Sequence[Shape]) -> dict[str, Dim]:
    """... pool, block_table, new_rows, topk_idx [B,S,k], sink."""
    return _sliding_dims(shapes) | _paged_dims(shapes, 4) | dict(k=shapes[7][2])


_WINDOW = (ACT, I64, ACT, I64)             # q, q_pos, kv, kv_pos
_PAGED = (ACT, I64, ACT)                   # pool, block_table, new rows
SLIDING_ATTENTION = OpShapes(_WINDOW + (F32,), (ACT,), _like_q, _sliding_dims, static=("d",))
HCA_ATTENTION_PAGED = OpShapes(_WINDOW + _PAGED + (I64, F32), (ACT,), _like_q, _hca_paged_dims,
                               static=("d", "page_rows"))
CSA_ATTENTION_PAGED = OpShapes(_WINDOW + _PAGED + (I64, F32), (ACT,), _like_q, _csa_paged_dims,
                               static=("d", "page_rows"))


# --------------------------------------------------------------------------- indexer
def _indexer_paged_topk(shapes: Sequence[Shape], attrs: Mapping[str, Any], symbolic_min: MinFn) -> list[Shape]:
    """q [B,S,h,dI], weights, pool, block_table, new_keys, key_ids [B,R], q_pos -> picks [B,S,min(topk,R)]."""
    q, key_ids = shapes[0], shapes[5]
    return [(q[0], q[1], minimum(attrs["topk"], key_ids[1], symbolic_min))]


def _indexer_paged_dims(shapes: Sequence[Shape]) -> dict[str, Dim]:
    B, S, h, dI = shapes[0]
    return dict(B=B, S=S, h=h, dI=dI, R=shapes[5][1]) | _paged_dims(shapes, 2)


INDEXER_TOPK_PAGED = OpShapes((ACT, F32) + _PAGED + (I64, I64), (I64,), _indexer_paged_topk, _indexer_paged_dims,
                              static=("h", "dI", "page_rows"))


# --------------------------------------------------------------------------- compressors
def _hca_compress(shapes: Sequence[Shape], attrs: Mapping[str, Any], symbolic_min: MinFn) -> list[Shape]:
    """kv, gate [B,L,C], first_pos [B] -> rows [B,E,C], row_ids [B,E]."""
    B, L, C = shapes[0]
    E = emitted_rows(L, attrs["ratio"], attrs["state_tokens"])
    return [(B, E, C), (B, E)]


def _csa_compress(shapes: Sequence[Shape], attrs: Mapping[str, Any], symbolic_min: MinFn) -> list[Shape]:
    """As HCA, but a row pools the halves Ca | Cb of the channels: rows [B,E,C/2]."""
    (B, E, C), row_ids = _hca_compress(shapes, attrs, symbolic_min)
    return [(B, E, C // 2), row_ids]


def _compress_dims(shapes: Sequence[Shape]) -> dict[str, Dim]:
    B, L, C = shapes[0]
    return dict(B=B, L=L, C=C)


HCA_COMPRESS = OpShapes((ACT, ACT, I64), (ACT, I64), _hca_compress, _compress_dims, static=("C",))
CSA_COMPRESS = OpShapes((ACT, ACT, I64), (ACT, I64), _csa_compress, _compress_dims, static=("C",))


# --------------------------------------------------------------------------- routed experts
def _like_x_fp32(shapes: Sequence[Shape], attrs: Mapping[str, Any], symbolic_min: MinFn) -> list[Shape]:
    """x [T, D], indices [T, k], weights, then the experts -> the fp32 sum [T, D]."""
    return [tuple(shapes[0])]


def _experts_dims(shapes: Sequence[Shape]) -> dict[str, Dim]:
    (T, D), (_, k) = shapes[:2]
    return dict(T=T, D=D, k=k)


_ROUTING = (ACT, I64, F32)                 # x, indices, weights
ROUTED_EXPERTS = OpShapes(_ROUTING + (ACT,) * 3, (F32,), _like_x_fp32, _experts_dims, static=())
FP8_ROUTED_EXPERTS = OpShapes(_ROUTING + (I8, F32) * 3, (F32,), _like_x_fp32, _experts_dims, static=())
MXFP4_ROUTED_EXPERTS = OpShapes(_ROUTING + (I8, I8) * 3, (F32,), _like_x_fp32, _experts_dims, static=())
