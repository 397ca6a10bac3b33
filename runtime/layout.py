"""The cache layout: every cache a sequence keeps, how the graphs name it, how many rows it holds and reads, and
how many rows a forward emits; and, following from it, the graphs' inputs and outputs (the engine contract).

One object derived from V4Config, `CacheLayout(cfg, draft, mtp, value_bytes)`, answers all of it. The exporter
names the graphs' tensors with it, engine.json lists its groups, the runtime's cache manager sizes and reads its
buffers with it, the eager model's state keeps its histories with it, and the compressor ops (reference, Triton
kernel, TensorRT shape) emit `emitted_rows` rows.

The groups of one layer (docs/model.md §3):
- window_kv, every layer: the sliding window, a ring of W - 1 + k + 1 rows. A forward reads the last W - 1
  committed rows; a verify writes k + 1 more before the commit keeps the accepted ones.
- compressor_kv and compressor_gate, CSA and HCA layers: per-token values and gates of the windows still open.
  A forward reads `state_tokens` rows (CSA's windows overlap: 2m - 1; HCA's: m - 1); the ring holds k + 1 more.
- compressed_kv, CSA and HCA layers: one row per closed window of `ratio` tokens, growing with the sequence.
- indexer_kv, indexer_gate and index_keys, CSA layers: the same three for the indexer's own compressor.
The MTP layer keeps only its window. Rollback is committing fewer positions; nothing is ever copied back.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .config import CSA, HCA, SLIDING, V4Config

WINDOW, COMPRESSOR, COMPRESSED = "window_kv", ("compressor_kv", "compressor_gate"), "compressed_kv"
INDEXER, INDEX_KEYS = ("indexer_kv", "indexer_gate"), "index_keys"
ROW_GROUPS = (COMPRESSED, INDEX_KEYS)           # one row per closed window; the others one row per position
MTP_KIND = "mtp"                                # the draft layer's kind in engine.json (its attention is sliding)


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, element type and shape (ints, or names of dynamic dimensions)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class CacheGroup:
    """One cache of one layer, per sequence: `width` values of `value_bytes` each per row.

    `rows_fixed` rows are allocated up front (windows, compressor partial windows), of which a forward reads the
    last `view_rows`; a group with a `ratio` instead grows one row per `ratio` tokens and is read whole."""

    layer: int
    name: str
    kind: str                   # the layer's kind (SLIDING, CSA, HCA), or MTP_KIND
    width: int
    value_bytes: int
    rows_fixed: int = 0
    ratio: int = 0
    view_rows: int = 0

    @property
    def past(self) -> str:
        """The graph input holding the rows committed so far (a view of the runtime's cache)."""
        return f"past.{self.layer}.{self.name}"

    @property
    def new(self) -> str:
        """The graph output holding the rows this call adds, committed by length after acceptance."""
        return f"new.{self.layer}.{self.name}"

    @property
    def fixed_bytes(self) -> int:
        return self.rows_fixed * self.width * self.value_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.width * self.value_bytes / self.ratio if self.ratio else 0.0

    def rows_for(self, seq_len: int) -> int:
        """Rows this group holds for a sequence of `seq_len` committed tokens."""
        return self.rows_fixed + (seq_len // self.ratio if self.ratio else 0)

    def bytes_for(self, seq_len: int) -> int:
        return self.rows_for(seq_len) * self.width * self.value_bytes

    def to_json(self) -> dict[str, Any]:
        """As engine.json lists it: the fields, and the bytes they come to."""
        return {**asdict(self), "fixed_bytes": self.fixed_bytes, "bytes_per_token": self.bytes_per_token}


def state_tokens(cfg: V4Config, kind: str) -> int:
    """Past tokens whose compressor inputs an open window still needs (CSA's windows overlap two)."""
    return 0 if kind in (SLIDING, MTP_KIND) else open_window_tokens(kind, cfg.compress_rates[kind])


def open_window_tokens(kind: str, ratio: int) -> int:
    """state_tokens of a CSA or HCA compressor of this ratio: 2m - 1 (two overlapping windows), or m - 1."""
    return 2 * ratio - 1 if kind == CSA else ratio - 1


def emitted_rows(tokens: Any, ratio: int, state_tokens: int) -> Any:
    """Row slots a compressor emits for `tokens` inputs (state_tokens kept ones, then the new): ceil(new / ratio).
    Written with + and // only, so the same formula serves ints, torch's symbolic sizes and TensorRT's shape
    expressions."""
    return (tokens + (ratio - 1 - state_tokens)) // ratio


def closed_windows(start: int, n: int, ratio: int) -> int:
    """Rows of the windows that close when n positions are committed after `start` (what a commit keeps)."""
    return (start + n) // ratio - start // ratio


class CacheLayout:
    """Every cache group of the target (draft=False) or of the MTP layer, for k = mtp draft tokens per step."""

    def __init__(self, cfg: V4Config, draft: bool, mtp: int = 0, value_bytes: int = 4):
        self.cfg, self.draft = cfg, draft
        spare = mtp + 1
        layers = [(cfg.num_hidden_layers, MTP_KIND)] if draft else list(enumerate(cfg.layer_types))
        self.groups: list[CacheGroup] = []
        for layer, kind in layers:
            def group(name: str, width: int, **rows: int) -> CacheGroup:
                return CacheGroup(layer, name, kind, width, value_bytes, **rows)

            window = cfg.sliding_window - 1
            self.groups.append(group(WINDOW, cfg.head_dim, rows_fixed=window + spare, view_rows=window))
            if kind not in (CSA, HCA):
                continue
            m, partial = cfg.compress_rates[kind], state_tokens(cfg, kind)
            width = 2 * cfg.head_dim if kind == CSA else cfg.head_dim
            self.groups += [group(name, width, rows_fixed=partial + spare, view_rows=partial) for name in COMPRESSOR]
            self.groups.append(group(COMPRESSED, cfg.head_dim, ratio=m))
            if kind == CSA:
                self.groups += [group(name, 2 * cfg.index_head_dim, rows_fixed=partial + spare, view_rows=partial)
                                for name in INDEXER]
                self.groups.append(group(INDEX_KEYS, cfg.index_head_dim, ratio=m))

    def of_layer(self, layer: int) -> list[CacheGroup]:
        return [g for g in self.groups if g.layer == layer]

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.groups]

    def bytes_for(self, seq_len: int) -> int:
        """Bytes of every group for one sequence of `seq_len` tokens."""
        return sum(g.bytes_for(seq_len) for g in self.groups)

    def inputs(self, dtype: str) -> list[TensorSpec]:
        """`past.*`: windows and partial windows of fixed length, compressed rows of dynamic length."""
        return [TensorSpec(g.past, dtype, ("batch", _dynamic_rows(g, "rows") if g.ratio else g.view_rows, g.width))
                for g in self.groups]

    def outputs(self, dtype: str) -> list[TensorSpec]:
        """`new.*`: per-position deltas, or the rows of the windows a forward closed."""
        return [TensorSpec(g.new, dtype, ("batch", _dynamic_rows(g, "emitted") if g.ratio else "seq", g.width))
                for g in self.groups]


def _dynamic_rows(group: CacheGroup, what: str) -> str:
    return f"{what}_csa" if group.kind == CSA else f"{what}_hca"


def graph_specs(cfg: V4Config, draft: bool, dtype: str = "float32", mtp: int = 0
                ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the target or draft graph: the engine contract.

    The draft graph is a whole draft cycle of k = mtp drafts (builder/model/drafting.py): the target's streams
    `hidden` and the next tokens over the newly committed positions, each row's valid `lengths`, its sampling
    settings and one uniform number per draft in; `drafts`, the distributions they were drawn from
    (`draft_probs`) and the extend's cache rows out."""
    tokens = [TensorSpec("input_ids", "int64", ("batch", "seq")), TensorSpec("positions", "int64", ("batch", "seq"))]
    layout = CacheLayout(cfg, draft)
    if not draft:
        outputs = [TensorSpec("logits", "float32", ("batch", "seq", cfg.vocab_size)),
                   TensorSpec("hidden", dtype, ("batch", "seq", cfg.hc_mult, cfg.hidden_size))]
        return tokens + layout.inputs(dtype), outputs + layout.outputs(dtype)
    if mtp < 1:
        raise ValueError(f"the draft graph drafts k >= 1 tokens (got mtp {mtp})")
    inputs = [TensorSpec("hidden", dtype, ("batch", "seq", cfg.hc_mult, cfg.hidden_size)), *tokens,
              TensorSpec("lengths", "int64", ("batch",)), TensorSpec("temperature", "float32", ("batch",)),
              TensorSpec("top_k", "int64", ("batch",)), TensorSpec("top_p", "float32", ("batch",)),
              TensorSpec("uniforms", "float32", ("batch", mtp))]
    outputs = [TensorSpec("drafts", "int64", ("batch", mtp)),
               TensorSpec("draft_probs", "float32", ("batch", mtp, cfg.vocab_size))]
    return inputs + layout.inputs(dtype), outputs + layout.outputs(dtype)
