"""Every kernel launch plan of ours at named sizes, so that all who compile or launch the whole set (aot.py and
its test, the TensorRT plugin build, scripts/gpu_check.py) cover the same kernels with the same constexprs.

"tiny": fp32 with small dims that are not powers of two (padding and masks), like the numeric tests;
"v4-flash": bf16 at DeepSeek-V4-Flash's sizes, where registers and shared memory are those of production.
Only the constexprs (dtype, head sizes, window, ratios, top-k, splits) change a compiled kernel; B, S and the
row counts are runtime scalars that only shape the grids.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from v4engine.contract.config import CSA, HCA
from v4engine.contract.layout import open_window_tokens, tokens_per_block

from .attention import (plan_csa_attention, plan_csa_attention_paged, plan_hca_attention, plan_hca_attention_paged,
                        plan_sliding_attention)
from .compressor import plan_csa_compress, plan_hca_compress
from .indexer import plan_indexer_topk
from .launch import LaunchPlan
from .moe import plan_routed_experts

# H, d: attention heads and head size; h, dI: indexer heads and key size; *_C: compressor input channels;
# E, D, inter, k: routed experts, model width, expert width, picks per token
SIZES = {
    "tiny": SimpleNamespace(dtype=torch.float32, B=2, S=3, H=5, d=24, window=8, splits=3, hca_ratio=3,
                            hca_rows=12, csa_ratio=3, csa_rows=40, topk=5, h=3, dI=10, hca_C=24, csa_C=40,
                            E=6, D=48, inter=40, k=2),
    "v4-flash": SimpleNamespace(dtype=torch.bfloat16, B=64, S=1, H=64, d=512, window=128, splits=8, hca_ratio=128,
                                hca_rows=512, csa_ratio=4, csa_rows=16384, topk=512, h=64, dI=128, hca_C=512,
                                csa_C=1024, E=256, D=4096, inter=2048, k=6),
}


def page_rows(z: SimpleNamespace, op: str) -> int:
    """Rows per block of a paged op's pool, as the runtime's layout makes them (runtime/layout.block_tokens):
    the block covers the smallest multiple of both ratios of at least MIN_BLOCK_TOKENS positions. V4-Flash: 128
    positions, 1 HCA row, 32 CSA rows or index keys."""
    return tokens_per_block((z.hca_ratio, z.csa_ratio)) // (z.hca_ratio if op == "hca_attention_paged" else z.csa_ratio)


def plans(size: str) -> dict[str, list[LaunchPlan]]:
    """Op call -> its launch plans (an attention call with key splits has two: attention, then combine)."""
    z = SIZES[size]
    attention = dict(B=z.B, S=z.S, H=z.H, d=z.d, T=z.window - 1 + z.S)    # keys: the window's W-1 cached, S new
    attrs = dict(window=z.window, scale=z.d ** -0.5)
    hca_state, csa_state = open_window_tokens(HCA, z.hca_ratio), open_window_tokens(CSA, z.csa_ratio)
    # paged: rows per block as the runtime's layout makes them; whole blocks of past rows, then the new ones
    hca_page, csa_page = page_rows(z, "hca_attention_paged"), page_rows(z, "csa_attention_paged")
    hca_table, csa_table = (z.hca_rows - 1) // hca_page, (z.csa_rows - 1) // csa_page
    hca_new, csa_new = z.hca_rows - hca_table * hca_page, z.csa_rows - csa_table * csa_page
    calls = {}
    for n, suffix in ((1, ""), (z.splits, f"_split{z.splits}")):
        calls |= {
            f"sliding_attention{suffix}": plan_sliding_attention(attention, z.dtype, splits=n, **attrs),
            f"hca_attention{suffix}": plan_hca_attention(attention | dict(R=z.hca_rows), z.dtype, ratio=z.hca_ratio,
                                                         splits=n, **attrs),
            f"csa_attention{suffix}": plan_csa_attention(attention | dict(R=z.csa_rows, k=z.topk), z.dtype, splits=n,
                                                         **attrs),
            f"hca_attention_paged{suffix}": plan_hca_attention_paged(
                attention | dict(R=z.hca_rows, W=hca_table, N=hca_new), z.dtype, ratio=z.hca_ratio, page_rows=hca_page,
                splits=n, **attrs),
            f"csa_attention_paged{suffix}": plan_csa_attention_paged(
                attention | dict(W=csa_table, N=csa_new, k=z.topk), z.dtype, page_rows=csa_page, splits=n, **attrs)}
    experts = dict(experts=z.E, dim=z.D, inter=z.inter, k=z.k, limit=10.0)
    for weight_format in ("float", "fp8", "mxfp4"):       # V4-Flash's experts are MXFP4; Flash-Base's FP8
        calls[f"routed_experts_{weight_format}"] = plan_routed_experts({"T": z.B * z.S}, z.dtype,
                                                                       weight_format=weight_format, **experts)
    return calls | {   # compressors see the state_tokens kept (CSA's windows overlap), then the S new tokens
        "indexer_topk": [plan_indexer_topk(dict(B=z.B, S=z.S, h=z.h, dI=z.dI, R=z.csa_rows), z.dtype, topk=z.topk,
                                           ratio=z.csa_ratio, scale=z.dI ** -0.5, weights_dtype=torch.float32)],
        "indexer_topk_paged": [plan_indexer_topk(dict(B=z.B, S=z.S, h=z.h, dI=z.dI, R=z.csa_rows, W=csa_table,
                                                      N=csa_new),
                                                 z.dtype, topk=z.topk, ratio=z.csa_ratio, scale=z.dI ** -0.5,
                                                 weights_dtype=torch.float32, page_rows=csa_page)],
        "hca_compress": [plan_hca_compress(dict(B=z.B, L=hca_state + z.S, C=z.hca_C), z.dtype, ratio=z.hca_ratio,
                                           state_tokens=hca_state)],
        "csa_compress": [plan_csa_compress(dict(B=z.B, L=csa_state + z.S, C=z.csa_C), z.dtype, ratio=z.csa_ratio,
                                           state_tokens=csa_state)]}
