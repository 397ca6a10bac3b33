"""Our DeepSeek-V4 + MTP in PyTorch, written for export and for reading top to bottom.

Engines are pure (docs/architecture.md §2): every forward takes token ids, absolute positions and read-only cache
views, and returns logits, the pre-head hidden streams and per-position state deltas. Prefill of N
tokens, a verify of k+1 tokens on existing caches and an MTP step are all the same function; the
caller (runtime or `state.ModelState`) appends the deltas and commits by length.

Parameter names are the official checkpoint names (`layers.3.attn.wq_a.weight`, `mtp.0.e_proj.weight`),
so a checkpoint loads with `load_state_dict` after dequantization. The custom ops (attention with sink,
compressor emission, indexer top-k) are the PyTorch references in `v4engine.plugins`.
Rows of one batch may hold different numbers of valid tokens: padding goes at the end of a row with
positions continuing, so no valid token ever sees it (everything is causal).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from v4engine.contract.config import CSA, HASH_MOE, HCA, SLIDING, V4Config
from v4engine.contract.layout import state_tokens
from v4engine.plugins.attention import csa_attention, hca_attention, sliding_attention
from v4engine.plugins.compressor import csa_compress, hca_compress
from v4engine.plugins.indexer import indexer_topk
from v4engine.plugins.moe import routed_experts, swiglu
from v4engine.plugins.paging import PagedRows, append_rows, row_count
from v4engine.plugins.sinkhorn import hc_sinkhorn

from .rope import apply_rope, cos_sin, inv_freq


# Parameters the checkpoint stores (and the model uses) in fp32 whatever the activation dtype.
FP32_PARAMETERS = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias)$")


# --------------------------------------------------------------------------- cache views and deltas
@dataclass
class LayerTensors:
    """One layer's tensors by cache group (names as in contract/layout.py); None for groups it lacks."""

    window_kv: torch.Tensor
    compressor_kv: torch.Tensor | None = None
    compressor_gate: torch.Tensor | None = None
    compressed_kv: torch.Tensor | PagedRows | None = None
    indexer_kv: torch.Tensor | None = None
    indexer_gate: torch.Tensor | None = None
    index_keys: torch.Tensor | PagedRows | None = None


class LayerCache(LayerTensors):
    """Read-only cache views of one layer for a batch.

    window_kv [B, W-1, d]: rows of positions start-W+1 .. start-1 (zeros where the position is < 0).
    compressor_kv/gate [B, P, C]: per-token compressor values/gates of positions start-P .. start-1.
    compressed_kv [B, R, d]: compressed rows 0..R-1 (rows >= start // m of a shorter row are padding); in the
    exported graphs PagedRows (plugins/paging.py): the runtime's block pool through the block table.
    indexer_kv/gate, index_keys: the same for the CSA indexer's own compressor.
    """


class LayerDelta(LayerTensors):
    """What one forward adds to a layer's caches, per new position (rows: per window closed, see plugins/compressor.py)."""


@dataclass
class ForwardOutput:
    logits: torch.Tensor            # [B, S, V]
    hidden: torch.Tensor            # [B, S, hc_mult, D] pre-hc_head streams (the MTP layer's input)
    deltas: list[LayerDelta] = field(default_factory=list)
    captured: list[torch.Tensor] = field(default_factory=list)   # [B, S, hc_mult, D] per layer asked to capture


# --------------------------------------------------------------------------- small pieces
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class Rotary(nn.Module):
    """Holds one rope's inverse frequencies; `at(positions)` gives the cos/sin for those positions."""

    def __init__(self, cfg: V4Config, kind: str):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(cfg.rope(kind)), persistent=False)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(self.inv_freq, positions)


def hyper_connection(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: V4Config
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC (docs/model.md §2.2): from streams x [B,S,N,D] return (post [B,S,N], comb [B,S,N,N], collapsed [B,S,D])."""
    n = cfg.hc_mult
    flat = unweighted_rms_norm(x.flatten(2).float(), cfg.rms_norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    comb = hc_sinkhorn(comb, rounds=cfg.hc_sinkhorn_iters - 1, eps=cfg.hc_eps)     # then rows, columns, ...
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
    return post, comb, collapsed


def hyper_expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j comb[j,k] * X_j, mixed in fp32 as the official code does."""
    mixed = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x.float())
    return mixed.to(x.dtype)


def hyper_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: V4Config
               ) -> torch.Tensor:
    """Final collapse of the streams: sigmoid-weighted sum, no Sinkhorn (docs/model.md §2.10)."""
    flat = unweighted_rms_norm(x.flatten(2).float(), cfg.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


# --------------------------------------------------------------------------- compressor and indexer
class Compressor(nn.Module):
    """Per-token values and gates, pooled into one row per closed window, normed and rotated at w*m."""

    def __init__(self, cfg: V4Config, kind: str, head_dim: int):
        super().__init__()
        self.ratio = cfg.compress_rates[kind]
        self.overlap = kind == CSA
        self.state_tokens = state_tokens(cfg, kind)
        width = 2 * head_dim if self.overlap else head_dim
        self.wkv = linear(cfg.hidden_size, width)
        self.wgate = linear(cfg.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(self.ratio, width))
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state_kv: torch.Tensor, state_gate: torch.Tensor,
                rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (rows [B,E,d], row_ids [B,E], new per-token values [B,S,C], new per-token gates [B,S,C])."""
        kv = self.wkv(x)
        gate = (self.wgate(x).float() + self.ape[torch.remainder(positions, self.ratio)].float()).to(x.dtype)
        first_pos = positions[:, 0] - self.state_tokens
        compress = csa_compress if self.overlap else hca_compress
        pooled, row_ids = compress(torch.cat([state_kv, kv], 1), torch.cat([state_gate, gate], 1), first_pos,
                                   ratio=self.ratio, state_tokens=self.state_tokens)
        rows = self.norm(pooled)
        cos, sin = rotary.at(row_ids.clamp(min=0) * self.ratio)
        return apply_rope(rows, cos, sin), row_ids, kv, gate


def past_row_ids(rows: torch.Tensor | PagedRows, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Window index of each cached row, or -1 for padding (a row holds start // ratio real rows)."""
    r = torch.arange(row_count(rows), device=positions.device).unsqueeze(0)
    real = r < torch.div(positions[:, :1], ratio, rounding_mode="floor")
    return torch.where(real, r, torch.full_like(r, -1))


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor (index keys) and per-query top-k over them."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        self.cfg = cfg
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg, CSA, cfg.index_head_dim)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cache: LayerCache,
                rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, LayerDelta]:
        cfg = self.cfg
        B, S, _ = x.shape
        rows, row_ids, kv, gate = self.compressor(x, positions, cache.indexer_kv, cache.indexer_gate, rotary)
        keys = append_rows(cache.index_keys, rows)
        key_ids = torch.cat([past_row_ids(cache.index_keys, positions, self.compressor.ratio), row_ids], dim=1)
        q = apply_rope(self.wq_b(qr).view(B, S, cfg.index_n_heads, cfg.index_head_dim), cos, sin)
        weights = self.weights_proj(x).float() * cfg.index_n_heads ** -0.5
        topk = indexer_topk(q, weights, keys, key_ids, positions, topk=cfg.index_topk, ratio=self.compressor.ratio,
                            scale=cfg.index_head_dim ** -0.5)
        return topk, LayerDelta(window_kv=None, indexer_kv=kv, indexer_gate=gate, index_keys=rows)


# --------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Q low-rank + per-head norm, one K=V head, partial interleaved rope, sink, grouped output projection."""

    def __init__(self, cfg: V4Config, kind: str):
        super().__init__()
        self.cfg, self.kind = cfg, kind
        H, d = cfg.num_attention_heads, cfg.head_dim
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, H * d)
        self.wkv = linear(cfg.hidden_size, d)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = linear(H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.rotary = Rotary(cfg, kind)
        if kind != SLIDING:
            self.compressor = Compressor(cfg, kind, d)
        if kind == CSA:
            self.indexer = Indexer(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache) -> tuple[torch.Tensor, LayerDelta]:
        cfg = self.cfg
        W = cfg.sliding_window
        cos, sin = self.rotary.at(positions)
        q, qr = self.queries(x, cos, sin)
        kv = self.keys(x, cos, sin)

        keys = torch.cat([cache.window_kv, kv], dim=1)
        key_pos = positions[:, :1] - (W - 1) + torch.arange(keys.shape[1], device=x.device).unsqueeze(0)
        scale = cfg.head_dim ** -0.5
        delta = LayerDelta(window_kv=kv)
        if self.kind == SLIDING:
            o = sliding_attention(q, positions, keys, key_pos, self.attn_sink, window=W, scale=scale)
        else:
            m = self.compressor.ratio
            rows, row_ids, c_kv, c_gate = self.compressor(x, positions, cache.compressor_kv, cache.compressor_gate,
                                                          self.rotary)
            delta.compressor_kv, delta.compressor_gate, delta.compressed_kv = c_kv, c_gate, rows
            all_rows = append_rows(cache.compressed_kv, rows)
            all_ids = torch.cat([past_row_ids(cache.compressed_kv, positions, m), row_ids], dim=1)
            if self.kind == HCA:
                o = hca_attention(q, positions, keys, key_pos, all_rows, all_ids, self.attn_sink, window=W, ratio=m,
                                  scale=scale)
            else:
                topk, index_delta = self.indexer(x, qr, positions, cache, self.rotary, cos, sin)
                delta.indexer_kv, delta.indexer_gate = index_delta.indexer_kv, index_delta.indexer_gate
                delta.index_keys = index_delta.index_keys
                o = csa_attention(q, positions, keys, key_pos, all_rows, topk, self.attn_sink, window=W, scale=scale)
        return self.output(o, cos, sin), delta

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [B,S,H,d]: low-rank, per-head RMS-normed, rotated; the normed low-rank qr [B,S,q_lora_rank])."""
        B, S, _ = x.shape
        qr = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(qr).view(B, S, self.cfg.num_attention_heads, self.cfg.head_dim),
                                self.cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), qr

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The one K=V head of each position [B,S,d], normed and rotated: what the window keeps."""
        return apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output [B,S,H,d] -> [B,S,D]: de-rotated (V = K carries rope on its trailing dims) at the query
        position, then the grouped low-rank projection wo_a and wo_b."""
        cfg = self.cfg
        B, S, H, d = o.shape
        o = apply_rope(o, cos, sin, inverse=True)
        groups = o.reshape(B * S, cfg.o_groups, H * d // cfg.o_groups).transpose(0, 1)     # [G, tokens, in]
        wo_a = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)                  # one [rank, in] per group
        o = torch.matmul(groups, wo_a.transpose(-1, -2)).transpose(0, 1).reshape(B, S, -1)
        return self.wo_b(o)


# --------------------------------------------------------------------------- mixture of experts
class Expert(nn.Module):
    """SwiGLU with V4's clamp: gate <= limit, up in [-limit, limit]."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = linear(dim, inter), linear(inter, dim), linear(dim, inter)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU in fp32; the official code scales by the routing weight before w2."""
        h = swiglu(self.w1(x), self.w3(x), self.limit)
        if weight is not None:
            h = h * weight.unsqueeze(-1)
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    """Router: sqrt(softplus) affinities; top-k on affinity + bias, or the token's row of tid2eid (hash layers)."""

    def __init__(self, cfg: V4Config, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] (int64) and their routing weights [T, k] (fp32); in a hash layer an expert
        may come twice, and then both picks count."""
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.weight.float())))
        if self.hashed:
            indices = self.tid2eid[input_ids.reshape(-1)]
        else:
            indices = torch.topk(scores + self.bias.float(), self.cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, indices)
        return indices, weights / weights.sum(dim=-1, keepdim=True) * self.cfg.routed_scaling_factor


class StackedExperts(nn.Module):
    """The routed experts as three stacked weights [E, out, in], run as one v4::RoutedExperts op (plugins/moe.py):
    only the chosen experts compute, tokens grouped by expert. The export of a 256-expert layer is then a handful
    of nodes, not 256 expert bodies. The builder gives each stacked weight its bytes as the experts' own
    checkpoint tensors (builder/weights.py)."""

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            setattr(self, name, nn.Parameter(torch.stack([getattr(e, name).weight for e in experts])))
        self.limit = experts[0].limit

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], each token's experts and weights [T, k] -> the fp32 sum over its picks [T, D]."""
        return routed_experts(x, indices, weights, self.w1, self.w2, self.w3, limit=self.limit)


class MoE(nn.Module):
    """Routed experts + one shared expert. Built with one module per expert (the checkpoint's layout, and what
    training updates); stack_experts() turns them into StackedExperts for export."""

    def __init__(self, cfg: V4Config, hashed: bool):
        super().__init__()
        self.gate = Gate(cfg, hashed)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                     cfg.swiglu_limit)
        self.routed: StackedExperts | None = None

    def stack_experts(self) -> None:
        """Replace the per-expert modules by StackedExperts (for export; the weights are stacked, not shared)."""
        self.routed = StackedExperts(self.experts)
        del self.experts

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        indices, weights = self.gate(flat, input_ids)
        out = self.shared_experts(flat).float()                 # accumulated in fp32, as the official code does
        if self.routed is not None:
            return (out + self.routed(flat, indices, weights)).to(x.dtype).view(shape)
        picks = indices.reshape(-1)
        for e in picks.unique().tolist():                       # each chosen expert on its tokens
            rows = (picks == e).nonzero().squeeze(-1)
            tokens = torch.div(rows, indices.shape[1], rounding_mode="floor")
            out = out.index_add(0, tokens, self.experts[e](flat[tokens], weights.reshape(-1)[rows]).float())
        return out.to(x.dtype).view(shape)


# --------------------------------------------------------------------------- blocks and models
class Block(nn.Module):
    """mHC(attention) then mHC(MoE) on the hc_mult residual streams (`attention`: V4's, or a drafter's own)."""

    def __init__(self, cfg: V4Config, kind: str, hashed: bool, attention: type[Attention] = Attention):
        super().__init__()
        self.cfg = cfg
        n, D = cfg.hc_mult, cfg.hidden_size
        mix = (2 + n) * n
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = attention(cfg, kind)
        self.ffn = MoE(cfg, hashed)
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, n * D))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, n * D))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any
                ) -> tuple[torch.Tensor, Any]:
        """Streams x [B,S,N,D] -> (streams, what the attention returns beside its output: a LayerDelta for V4's).
        `cache`: what the attention reads (a LayerCache for V4's)."""
        post, comb, u = hyper_connection(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        y, delta = self.attn(self.attn_norm(u), positions, cache)
        x = hyper_expand(x, y, post, comb)
        post, comb, u = hyper_connection(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        x = hyper_expand(x, self.ffn(self.ffn_norm(u), input_ids), post, comb)
        return x, delta


class MTPLayer(Block):
    """The MTP draft layer `mtp.0`: combines target streams h_i with emb(t_{i+1}) and predicts t_{i+2}.

    A full sliding-attention block (main rope, score-routed MoE) with its own e/h projections, hc head and
    norm; embedding and LM head are shared with the target (docs/model.md §4).
    """

    def __init__(self, cfg: V4Config):
        super().__init__(cfg, SLIDING, hashed=False)
        n, D = cfg.hc_mult, cfg.hidden_size
        self.e_proj, self.h_proj = linear(D, D), linear(D, D)
        self.enorm, self.hnorm, self.norm = (RMSNorm(D, cfg.rms_norm_eps) for _ in range(3))
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def step(self, hidden: torch.Tensor, embedded: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
             cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, LayerDelta]:
        """hidden [B,S,N,D] streams at positions; embedded = embed(next tokens). Returns (pre-head, streams, delta)."""
        x, delta = self.streams(hidden, embedded, input_ids, positions, cache)
        return self.collapse(x), x, delta

    def streams(self, hidden: torch.Tensor, embedded: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: LayerCache) -> tuple[torch.Tensor, LayerDelta]:
        """The layer's output streams [B,S,N,D] and its cache delta."""
        x = self.h_proj(self.hnorm(hidden)) + self.e_proj(self.enorm(embedded)).unsqueeze(2)
        return self.forward(x, input_ids, positions, cache)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """Streams -> the shared LM head's input: the layer's own hc head, then its norm."""
        return self.norm(hyper_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg))


class ExportedModel(nn.Module):
    """What a graph is exported from (the target, a drafter): the two forms it takes for export."""

    def stack_experts(self) -> Self:
        """Every MoE's routed experts as StackedExperts (MoE.stack_experts): the form the graphs are exported in."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.stack_experts()
        return self

    def to_dtype(self, dtype: torch.dtype) -> Self:
        """Activations and most weights in `dtype`; the hc mixes, sinks, ape and router bias stay fp32 (as stored)."""
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if FP32_PARAMETERS.search(name) else dtype)
        return self


class Transformer(ExportedModel):
    """The V4 target model (and, with mtp=True, its MTP layer under `mtp.0`). `layers`: build only these target
    layers (a pipeline stage's; none for the draft graph), the others empty modules that keep every layer's name:
    an export of one stage of V4-Flash then does not build 43 layers of 256 experts first."""

    def __init__(self, cfg: V4Config, mtp: bool = True, layers: range | None = None):
        super().__init__()
        self.cfg = cfg
        n, D = cfg.hc_mult, cfg.hidden_size
        built = range(cfg.num_hidden_layers) if layers is None else layers
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, kind, cfg.mlp_layer_types[i] == HASH_MOE) if i in built else nn.Module()
                                    for i, kind in enumerate(cfg.layer_types))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = linear(D, cfg.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.mtp = nn.ModuleList([MTPLayer(cfg)] if mtp else [])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                capture: Sequence[int] = ()) -> ForwardOutput:
        """Target over new tokens: input_ids/positions [B,S] (positions consecutive per row), one cache per layer;
        `capture`: layers whose output streams come back too (`captured`, in that order: what DSpark reads)."""
        x = self.embedded_streams(input_ids)
        x, deltas, streams = self.run_layers(x, input_ids, positions, caches, range(len(self.layers)), capture)
        return ForwardOutput(logits=self.logits(x), hidden=x, deltas=deltas, captured=[streams[i] for i in capture])

    def embedded_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: each token's embedding on all hc_mult streams [B,S,N,D]."""
        return self.embed(input_ids).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)

    def run_layers(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                   layers: range, capture: Sequence[int] = ()
                   ) -> tuple[torch.Tensor, list[LayerDelta], dict[int, torch.Tensor]]:
        """Streams x through `layers` (a pipeline stage's, or all), one cache each: (their output streams, deltas,
        the output streams of the layers in `capture` that are among them, by layer)."""
        deltas, captured = [], {}
        for i, cache in zip(layers, caches):
            x, delta = self.layers[i](x, input_ids, positions, cache)
            deltas.append(delta)
            if i in capture:
                captured[i] = x
        return x, deltas, captured

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's streams -> logits [B,S,V] (float32): hc head, norm, LM head."""
        y = self.norm(hyper_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg))
        return self.head(y).float()

    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, cache: LayerCache
              ) -> ForwardOutput:
        """One MTP pass: row i pairs target (or previous MTP) streams at position p_i with token t_{i+1}."""
        y, x, delta = self.mtp[0].step(hidden, self.embed(next_ids), next_ids, positions, cache)
        return ForwardOutput(logits=self.head(y).float(), hidden=x, deltas=[delta])
