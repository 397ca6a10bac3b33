"""Our Triton kernels against their PyTorch references, on inputs shaped like the model's caches.

The GPU check judges every op with these inputs and this verdict: its tests (tests/test_gpu_kernels.py) through the
torch launchers, its driver (scripts/gpu_check.py) through the AOT PTX launched as TensorRT launches it; both at
catalog.SIZES. The inputs follow the model's caches: the window's W-1 cached positions then the S new ones (-1 for
slots before position 0), compressed rows in window order with two empty (-1) slots, CSA picks among the rows
already closed with some -1, indexer key ids shuffled with every 5th slot empty; one query early in the sequence (a
half-empty window, no closed row) and one at the end of the context. The reference runs in fp32 on the same values.

The routed experts (routed_experts_float, _fp8, _mxfp4): each of B x S tokens picks k distinct experts (the first
token all of its picks masked, -1), weights as the format stores them: the activation dtype, FP8 e4m3 bytes (no NaN
code) or packed MXFP4 codes, with power-of-two scales (fp32 for FP8, E8M0 bytes for MXFP4, as the kernels take
them); the reference gets them dequantized.

Verdict, by the activation dtype: max |kernel - reference| <= 1e-4 for fp32, max |kernel - reference| / max
|reference| <= 1e-2 for bf16; row ids exactly. The indexer: integer-valued fp32 inputs (exact sums) must give exactly the
reference's indices; otherwise summation order may swap near-ties, so the same picks must be -1, picks distinct,
and the reference score of the i-th pick equal to the i-th best reference score.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import torch

from v4engine.contract.config import CSA, HCA
from v4engine.contract.layout import open_window_tokens

from v4engine.plugins import attention as attention_ref
from v4engine.plugins import compressor as compressor_ref
from v4engine.plugins import indexer as indexer_ref
from v4engine.plugins import moe as moe_ref
from v4engine.plugins.kernels import attention as attention_kernels
from v4engine.plugins.kernels import compressor as compressor_kernels
from v4engine.plugins.kernels import indexer as indexer_kernels
from v4engine.plugins.kernels import moe as moe_kernels
from v4engine.plugins.kernels.catalog import page_rows
from v4engine.plugins.kernels.paging import split_paged
from v4engine.plugins.paging import PagedRows

# paged op -> the dense op it computes, its rows or keys in a block pool read through a block table
PAGED = {"hca_attention_paged": "hca_attention", "csa_attention_paged": "csa_attention",
         "indexer_topk_paged": "indexer_topk"}
ATTENTION = ("sliding_attention", "hca_attention", "csa_attention", "hca_attention_paged", "csa_attention_paged")
INDEXER = ("indexer_topk", "indexer_topk_paged")
COMPRESS = ("hca_compress", "csa_compress")
MOE = {f"routed_experts_{fmt}": fmt for fmt in moe_kernels.FORMATS}      # op -> the experts' weight format
OPS = ATTENTION + INDEXER + COMPRESS + tuple(MOE)
_MODULES = {op: (attention_kernels, attention_ref) for op in ATTENTION} | {
    op: (indexer_kernels, indexer_ref) for op in INDEXER} | {op: (compressor_kernels, compressor_ref) for op in COMPRESS}

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}   # fp32: absolute; bf16: relative to max |reference|
EXACT_INDEXER_SCALE = 0.5       # with integers=True inputs every indexer score is then exact in fp32


def kernel(op: str) -> Callable:
    """The op's torch launcher (plugins/kernels), taking make_inputs' tensors in order."""
    if op in MOE:
        return partial(_moe_kernel, MOE[op])
    return getattr(_MODULES[op][0], op)


def reference(op: str) -> Callable:
    """The op's PyTorch reference (plugins/), the oracle, taking make_inputs' tensors in order; a paged op's is
    its dense op's on the rows gathered back through the block table."""
    if op in MOE:
        return partial(_moe_reference, MOE[op])
    if op in PAGED:
        return lambda *values, **attrs: reference(PAGED[op])(*dense_inputs(op, values).values(), **attrs)
    return getattr(_MODULES[op][1], op)


def plan_function(op: str) -> Callable:
    """The op's plan_* function: its launch plans for given dims, dtype and attributes (catalog.py's, TensorRT's)."""
    if op in MOE:
        return partial(moe_kernels.plan_routed_experts, weight_format=MOE[op])
    return getattr(_MODULES[op][0], f"plan_{op}" if op != "indexer_topk_paged" else "plan_indexer_topk")


def _moe_kernel(weight_format: str, x, indices, weights, w1, w2, w3, w1_scale, w2_scale, w3_scale, **attrs):
    return moe_kernels.routed_experts(x, indices, weights, w1, w2, w3, scales=(w1_scale, w2_scale, w3_scale),
                                      weight_format=weight_format, **attrs)


def _moe_reference(weight_format: str, x, indices, weights, w1, w2, w3, w1_scale, w2_scale, w3_scale, **attrs):
    """plugins/moe.py on the dequantized weights in x's dtype (as its quantized ops decode them); a masked pick
    (expert out of range) counts nothing."""
    experts = w1.shape[0]
    counted = (indices >= 0) & (indices < experts)
    w1, w2, w3 = (dequantized(w, scale, weight_format).to(x.dtype)
                  for w, scale in ((w1, w1_scale), (w2, w2_scale), (w3, w3_scale)))
    return moe_ref.routed_experts(x, indices.clamp(0, experts - 1), torch.where(counted, weights, 0.0), w1, w2, w3,
                                  **attrs)


def dequantized(stored: torch.Tensor, scale: torch.Tensor, weight_format: str) -> torch.Tensor:
    """Expert weights [E, N, K] as fp32 from the kernels' stored form: float as is; FP8 e4m3 bytes times a scale
    per 128 inputs; MXFP4 codes (low nibble first) times a scale per 32 inputs."""
    if weight_format == "float":
        return stored.float()
    if weight_format == "fp8":
        values = stored.view(torch.float8_e4m3fn).float()
        return values * scale.repeat_interleave(128, dim=-1)[..., : values.shape[-1]]
    codes = torch.stack([stored & 15, stored >> 4], dim=-1).flatten(-2).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=stored.device)
    values = table[codes & 7] * (1 - 2 * (codes >> 3)).float()
    factors = torch.exp2(scale.view(torch.uint8).float() - 127)                 # E8M0 bytes
    return values * factors.repeat_interleave(32, dim=-1)[..., : values.shape[-1]]


# --------------------------------------------------------------------------- inputs shaped like the model's
class Draw:
    """Random tensors on one device from one seeded generator (drawn on the device: V4-Flash sizes are GiBs)."""

    def __init__(self, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def normal(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype)

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)

    def ints(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen, device=self.device)


def context(z: SimpleNamespace) -> int:
    """Positions a size's caches cover: 64K at V4-Flash (512 HCA rows of 128, 16384 CSA rows of 4)."""
    return min(z.hca_rows * z.hca_ratio, z.csa_rows * z.csa_ratio)


def query_positions(z: SimpleNamespace, B: int, S: int, draw: Draw, *, at_end: bool = False) -> torch.Tensor:
    """[B,S] positions. Decode: random, the last query at the end of the context and (B >= 3) the first at 2,
    early enough to see a half-empty window and no closed row; at_end: all at the end. Prefill: chunks of S
    consecutive positions, the first from 0, the last ending at the end of the context."""
    end = context(z) - S
    if at_end:
        starts = torch.full((B,), end, device=draw.device)
    else:
        starts = draw.ints(0, end + 1, B)
        starts[-1] = end
        if S > 1:
            starts[0] = 0
        elif B >= 3:
            starts[0] = 2
    return starts.unsqueeze(1) + torch.arange(S, device=draw.device)


def _csa_picks(q_pos: torch.Tensor, z: SimpleNamespace, draw: Draw, holes: bool) -> torch.Tensor:
    """[B,S,k] distinct CSA rows among those closed for each query, -1 past them (and for 1 in 8 with holes)."""
    closed = (q_pos + 1).div(z.csa_ratio, rounding_mode="floor").unsqueeze(-1)
    slots = torch.arange(z.csa_rows, device=draw.device)
    preference = draw.uniform(*q_pos.shape, z.csa_rows).masked_fill(slots >= closed, -1.0)
    picks = preference.topk(min(z.topk, z.csa_rows), dim=-1).indices
    empty = picks >= closed
    if holes:
        empty |= draw.uniform(*picks.shape) < 1 / 8
    return picks.masked_fill(empty, -1)


# a paged op's dense input -> the name of its new rows
_PAGED_NAMES = {"hca_attention_paged": ("rows", "new_rows"), "csa_attention_paged": ("rows", "new_rows"),
                "indexer_topk_paged": ("keys", "new_keys")}


def dense_inputs(op: str, values: Any) -> dict[str, torch.Tensor]:
    """A paged op's inputs (make_inputs' order, as a dict or positionally) as its dense op's: the rows or keys its
    block table addresses, then its new ones."""
    names = list(inspect.signature(kernel(op)).parameters)[: len(values)]
    paged = dict(zip(names, values.values() if isinstance(values, dict) else values))
    dense_name, new_name = _PAGED_NAMES[op]
    dense = {}
    for name, value in paged.items():
        if name == "pool":
            dense[dense_name] = PagedRows(value, paged["block_table"], paged[new_name]).dense()
        elif name not in ("block_table", new_name):
            dense[name] = value
    return dense


def make_inputs(op: str, z: SimpleNamespace, q_pos: torch.Tensor, draw: Draw, *, holes: bool = True,
                integers: bool = False) -> dict[str, torch.Tensor]:
    """The op's inputs at size z, named and ordered as its reference's parameters. holes: empty (-1) slots as in a
    cache being filled; integers: the indexer's exact-sum inputs (small integers, weights multiples of 1/2).
    A paged op: its dense op's inputs with the rows (keys) in a pool of shuffled blocks, a table and new rows."""
    B, S = q_pos.shape
    if op in PAGED:
        dense, inputs = make_inputs(PAGED[op], z, q_pos, draw, holes=holes, integers=integers), {}
        dense_name, new_name = _PAGED_NAMES[op]
        for name, value in dense.items():
            if name == dense_name:
                inputs["pool"], inputs["block_table"], inputs[new_name] = split_paged(
                    value, page_rows(z, op), torch.Generator().manual_seed(5))
            else:
                inputs[name] = value
        return inputs
    if op in MOE:
        return _moe_inputs(MOE[op], z, B * S, draw)
    if op == "indexer_topk":
        key_ids = draw.uniform(B, z.csa_rows).argsort(dim=1)        # slot order is not window order
        if holes:
            key_ids[:, ::5] = -1
        if integers:
            q, keys = draw.ints(-2, 3, B, S, z.h, z.dI).to(z.dtype), draw.ints(-2, 3, B, z.csa_rows, z.dI).to(z.dtype)
            weights = draw.ints(-2, 3, B, S, z.h) / 2
        else:
            q, keys = draw.normal(B, S, z.h, z.dI, dtype=z.dtype), draw.normal(B, z.csa_rows, z.dI, dtype=z.dtype)
            weights = draw.normal(B, S, z.h)
        return dict(q=q, weights=weights, keys=keys, key_ids=key_ids, q_pos=q_pos)
    if op in COMPRESS:
        state = op_attrs(op, z)["state_tokens"]
        channels = z.hca_C if op == "hca_compress" else z.csa_C
        return dict(kv=draw.normal(B, state + S, channels, dtype=z.dtype),
                    gate=(3 * draw.normal(B, state + S, channels)).to(z.dtype), first_pos=q_pos[:, 0] - state)
    T = z.window - 1 + S
    kv_pos = (q_pos[:, :1] - (z.window - 1) + torch.arange(T, device=draw.device)).clamp(min=-1)
    inputs = dict(q=draw.normal(B, S, z.H, z.d, dtype=z.dtype), q_pos=q_pos, kv=draw.normal(B, T, z.d, dtype=z.dtype),
                  kv_pos=kv_pos)
    if op == "hca_attention":
        row_ids = torch.arange(z.hca_rows, device=draw.device).repeat(B, 1)
        if holes:
            row_ids[:, -2:] = -1
        inputs |= dict(rows=draw.normal(B, z.hca_rows, z.d, dtype=z.dtype), row_ids=row_ids)
    elif op == "csa_attention":
        inputs |= dict(rows=draw.normal(B, z.csa_rows, z.d, dtype=z.dtype), topk_idx=_csa_picks(q_pos, z, draw, holes))
    return inputs | dict(sink=draw.normal(z.H))


def _moe_inputs(weight_format: str, z: SimpleNamespace, T: int, draw: Draw) -> dict[str, torch.Tensor]:
    """x [T, D], each token's k distinct experts (the first token's all masked) and weights, and the experts' w1, w2,
    w3 as stored, with their scales (one-element stand-ins for float weights)."""
    indices = draw.uniform(T, z.E).argsort(dim=1)[:, : z.k].contiguous()   # dense, as TensorRT passes it
    indices[0] = -1
    inputs = dict(x=draw.normal(T, z.D, dtype=z.dtype), indices=indices, weights=draw.uniform(T, z.k) + 0.1)
    shapes = dict(w1=(z.E, z.inter, z.D), w2=(z.E, z.D, z.inter), w3=(z.E, z.inter, z.D))
    for name, (E, N, K) in shapes.items():
        if weight_format == "float":
            inputs[name] = (draw.normal(E, N, K) / K ** 0.5).to(z.dtype)
            continue
        if weight_format == "fp8":
            stored = draw.ints(0, 256, E, N, K).to(torch.uint8)
            stored[(stored & 0x7F) == 0x7F] = 0x38           # no NaN code (0x38 is 1.0)
        else:
            stored = draw.ints(0, 256, E, N, K // 2).to(torch.uint8)
        inputs[name] = stored
    for name, (E, N, K) in shapes.items():     # powers of two that keep gate and up near the clamp
        if weight_format == "float":
            inputs[f"{name}_scale"] = torch.ones(1, device=draw.device)
        else:
            block, low = (128, -12) if weight_format == "fp8" else (32, -7)
            exponents = draw.ints(low, low + 4, E, N, -(-K // block))
            inputs[f"{name}_scale"] = torch.exp2(exponents.float()) if weight_format == "fp8" else \
                (exponents + 127).to(torch.uint8)                       # MXFP4: E8M0 bytes, as stored
    return inputs


def op_attrs(op: str, z: SimpleNamespace) -> dict[str, Any]:
    """The op's attributes at a catalog size, as catalog.plans gives them to the plan functions."""
    if op in MOE:
        return dict(limit=10.0)
    if op in PAGED:
        return op_attrs(PAGED[op], z)
    if op in ATTENTION:
        return dict(window=z.window, scale=z.d ** -0.5) | (dict(ratio=z.hca_ratio) if op == "hca_attention" else {})
    if op == "indexer_topk":
        return dict(topk=z.topk, ratio=z.csa_ratio, scale=z.dI ** -0.5)
    kind, ratio = (HCA, z.hca_ratio) if op == "hca_compress" else (CSA, z.csa_ratio)
    return dict(ratio=ratio, state_tokens=open_window_tokens(kind, ratio))


def as_fp32(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values upcast: the reference then computes in fp32 what the kernel saw."""
    return {name: t.float() if t.is_floating_point() else t for name, t in inputs.items()}


# --------------------------------------------------------------------------- the verdict
@dataclass
class Verdict:
    """error: max |got - ref| (fp32), that / max |ref| (bf16), or the indexer's score gap or count of wrong picks."""
    error: float
    limit: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.error <= self.limit

    def __str__(self) -> str:
        return "; ".join([f"error {self.error:.2e} (limit {self.limit:.0e})", *self.problems])


def tensors(result: Any) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple (the compressors return two tensors, the other ops one)."""
    return result if isinstance(result, tuple) else (result,)


def judge(op: str, got: Any, want: Any, inputs: dict[str, torch.Tensor], attrs: dict[str, Any],
          exact: bool = False) -> Verdict:
    """The kernel's result `got` against the fp32 reference's `want` on `inputs` (exact: integers=True inputs)."""
    if op in PAGED:
        op, inputs = PAGED[op], dense_inputs(op, inputs)
    if op == "indexer_topk":
        return _judge_indexer(got, want, inputs, attrs, exact)
    problems = []
    if op in COMPRESS:
        (got, got_ids), (want, want_ids) = got, want
        if not torch.equal(got_ids, want_ids):
            problems.append("row_ids differ from the reference")
    diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    activations = next(t.dtype for t in inputs.values() if t.is_floating_point())
    if activations == torch.float32:
        return Verdict(diff, TOLERANCE[torch.float32], problems)
    return Verdict(diff / max(want.abs().max().item(), 1e-30), TOLERANCE[torch.bfloat16], problems)


def _judge_indexer(got: torch.Tensor, want: torch.Tensor, inputs: dict[str, torch.Tensor], attrs: dict[str, Any],
                   exact: bool) -> Verdict:
    """Exact: indices equal (error = count of differing picks). Otherwise the order-independent check of
    tests/test_kernels_indexer_compressor.py: error = max |score of i-th pick - i-th best score| / max |score|."""
    if exact:
        return Verdict(float((got != want).sum().item()), 0.0)
    scores = indexer_ref.visible_scores(*as_fp32(inputs).values(), attrs["ratio"], attrs["scale"])
    picked = got >= 0
    ordered = got.sort(dim=-1).values
    repeats = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any().item()
    got_scores = torch.gather(scores, -1, got.clamp(min=0))[picked]
    best_scores = torch.gather(scores, -1, want.clamp(min=0))[picked]
    finite = scores[torch.isfinite(scores)]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    error = (got_scores - best_scores).abs().max().item() / scale if got_scores.numel() else 0.0
    problems = [text for text, bad in (("-1 picks differ from the reference's", not torch.equal(~picked, want == -1)),
                                       ("a row picked twice", repeats),
                                       ("an invisible row picked", not torch.isfinite(got_scores).all().item()))
                if bad]
    return Verdict(error, TOLERANCE[inputs["q"].dtype], problems)
