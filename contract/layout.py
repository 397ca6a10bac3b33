"""The cache layout: every cache a sequence keeps, how the graphs name it, how many rows it holds and reads, and
how many rows a forward emits; and, following from it, the graphs' inputs and outputs (the engine contract).

One object derived from V4Config, `CacheLayout.target(cfg, value_bytes)` (or a drafter's, contract/drafting.py),
answers all of it. The exporter
names the graphs' tensors with it, engine.json lists its groups, the runtime's cache manager sizes and reads its
buffers with it, the eager model's state keeps its histories with it, and the compressor ops (reference, Triton
kernel, TensorRT shape) emit `emitted_rows` rows.

The groups of one layer (docs/model.md §3):
- window_kv, every layer: the sliding window, a ring of the W - 1 committed rows a forward reads. A verify's
  k + 1 new rows come out as deltas; the commit writes only the accepted ones, so the ring needs no spare rows.
- compressor_kv and compressor_gate, CSA and HCA layers: per-token values and gates of the windows still open,
  a ring of the `state_tokens` rows a forward reads (CSA's windows overlap: 2m - 1; HCA's: m - 1).
- compressed_kv, CSA and HCA layers: one row per closed window of `ratio` tokens, growing with the sequence.
- indexer_kv, indexer_gate and index_keys, CSA layers: the same three for the indexer's own compressor.
A drafter's layers keep what its DraftSpec says (MTP's layer: only its window). Rollback is committing fewer
positions; nothing is ever copied back.

Where the rows live (the engine contract): the runtime keeps one preallocated pool per group and the
graphs read the pools themselves. A group of fixed rows is a pool of per-sequence slots, [slots, rows_fixed,
width], addressed by the call's `slots` [batch]; a growing group is a pool of blocks, [blocks, block_rows, width],
addressed by the call's `block_table` [batch, blocks per row]. One block covers `block_tokens` positions of every
growing group at once (block_tokens is a multiple of every ratio: block_rows = block_tokens / ratio), so one table
serves all of them, and a block of a shared prompt prefix is shared whole.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from collections.abc import Iterable, Sequence
from typing import Any

from .config import CSA, HCA, SLIDING, V4Config
from .stages import Stage, single_stage

WINDOW, COMPRESSOR, COMPRESSED = "window_kv", ("compressor_kv", "compressor_gate"), "compressed_kv"
INDEXER, INDEX_KEYS = ("indexer_kv", "indexer_gate"), "index_keys"
MTP_KIND = "mtp"                                # the draft layer's kind in engine.json (its attention is sliding)
DSPARK_KIND = "dspark"                          # a DSpark stage's: a ring of its context keys, W rows
CAPTURED = "captured"                           # the target's rows DSpark reads (its last stage's extra output)
CAPTURED_IN = "captured_in"                     # a pipeline stage's input: the previous stage's `captured`
MIN_BLOCK_TOKENS = 16                           # a block's positions when the compression ratios allow fewer
SLOTS, BLOCK_TABLE = "slots", "block_table"     # the graph inputs that address the pools
NEW_PREFIX = "new."                             # the outputs that carry new cache rows (`new.{layer}.{group}`)
STREAMS = "hidden"                              # the target's (every stage's) output streams; MTP's input
STAGE_INPUT = "hidden_in"                       # a pipeline stage's input: the previous stage's output `hidden`


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, element type and shape (ints, or names of dynamic dimensions)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class CacheGroup:
    """One cache of one layer, per sequence: `width` values of `value_bytes` each per row.

    A group of `rows_fixed` rows (windows, compressor partial windows) is a ring per sequence slot holding the
    rows of the last rows_fixed positions, all of which a forward reads; a group with a `ratio` instead grows one
    row per `ratio` tokens, `block_rows` rows per block of the pool, and is read whole."""

    layer: int
    name: str
    kind: str                   # the layer's kind (SLIDING, CSA, HCA), or MTP_KIND, DSPARK_KIND
    width: int
    value_bytes: int
    rows_fixed: int = 0
    ratio: int = 0
    block_rows: int = 0

    @property
    def pool(self) -> str:
        """The graph input holding this group's pool (every sequence's rows committed so far)."""
        return f"pool.{self.layer}.{self.name}"

    @property
    def new(self) -> str:
        """The graph output holding the rows this call adds, committed by length after acceptance."""
        return f"{NEW_PREFIX}{self.layer}.{self.name}"

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
    return 0 if kind in (SLIDING, MTP_KIND, DSPARK_KIND) else open_window_tokens(kind, cfg.compress_rates[kind])


def window_rows(cfg: V4Config, kind: str) -> int:
    """Rows of a layer's window ring: the W - 1 positions before a query's own (V4's window of W includes the
    query), or a DSpark stage's W context positions (its block's own keys are never kept)."""
    return cfg.sliding_window if kind == DSPARK_KIND else cfg.sliding_window - 1


def open_window_tokens(kind: str, ratio: int) -> int:
    """state_tokens of a CSA or HCA compressor of this ratio: 2m - 1 (two overlapping windows), or m - 1."""
    return 2 * ratio - 1 if kind == CSA else ratio - 1


def emitted_rows(tokens: Any, ratio: int, state_tokens: int) -> Any:
    """Row slots a compressor emits for `tokens` inputs (state_tokens kept ones, then the new): ceil(new / ratio).
    Written with + and // only, so the same formula serves ints, torch's symbolic sizes and TensorRT's shape
    expressions."""
    return (tokens + (ratio - 1 - state_tokens)) // ratio


def block_tokens(cfg: V4Config) -> int:
    """Positions per block of the growing groups: the smallest multiple of every compression ratio that is at
    least MIN_BLOCK_TOKENS (V4: 128, HCA's ratio)."""
    return tokens_per_block(cfg.compress_rates.values())


def tokens_per_block(ratios: Iterable[int]) -> int:
    """block_tokens for these compression ratios."""
    lcm = math.lcm(*ratios)
    return lcm * -(-MIN_BLOCK_TOKENS // lcm)


def closed_windows(start: int, n: int, ratio: int) -> int:
    """Rows of the windows that close when n positions are committed after `start` (what a commit keeps)."""
    return (start + n) // ratio - start // ratio


class CacheLayout:
    """Every cache group of some layers, given as (layer index, kind) pairs: the target's (`CacheLayout.target`,
    all layers or a pipeline stage's), or a drafter's (its DraftSpec's `layout`, contract/drafting.py)."""

    def __init__(self, cfg: V4Config, layers: Sequence[tuple[int, str]], value_bytes: int = 4):
        self.cfg = cfg
        self.block_tokens = block_tokens(cfg)
        self.groups: list[CacheGroup] = []
        for layer, kind in layers:
            def group(name: str, width: int, **rows: int) -> CacheGroup:
                return CacheGroup(layer, name, kind, width, value_bytes, **rows)

            self.groups.append(group(WINDOW, cfg.head_dim, rows_fixed=window_rows(cfg, kind)))
            if kind not in (CSA, HCA):
                continue
            m, partial = cfg.compress_rates[kind], state_tokens(cfg, kind)
            width = 2 * cfg.head_dim if kind == CSA else cfg.head_dim
            self.groups += [group(name, width, rows_fixed=partial) for name in COMPRESSOR]
            self.groups.append(group(COMPRESSED, cfg.head_dim, ratio=m, block_rows=self.block_tokens // m))
            if kind == CSA:
                self.groups += [group(name, 2 * cfg.index_head_dim, rows_fixed=partial)
                                for name in INDEXER]
                self.groups.append(group(INDEX_KEYS, cfg.index_head_dim, ratio=m, block_rows=self.block_tokens // m))

    @classmethod
    def target(cls, cfg: V4Config, value_bytes: int = 4, layers: range | None = None) -> "CacheLayout":
        """The target's groups: of every layer, or of `layers` only (a pipeline stage's, contract/stages.py)."""
        kinds = list(enumerate(cfg.layer_types))
        return cls(cfg, kinds if layers is None else [kinds[i] for i in layers], value_bytes)

    def of_layer(self, layer: int) -> list[CacheGroup]:
        return [g for g in self.groups if g.layer == layer]

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.groups]

    def bytes_for(self, seq_len: int) -> int:
        """Bytes of every group for one sequence of `seq_len` tokens."""
        return sum(g.bytes_for(seq_len) for g in self.groups)

    @property
    def paged(self) -> bool:
        """Whether any group grows (and the graphs take a block table)."""
        return any(g.ratio for g in self.groups)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's rings (a slot of every fixed group)."""
        return sum(g.fixed_bytes for g in self.groups)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every growing group."""
        return sum(g.block_rows * g.width * g.value_bytes for g in self.groups if g.ratio)

    def blocks_for(self, seq_len: int) -> int:
        """Blocks a sequence of `seq_len` committed tokens holds rows in (a block is taken by its first row)."""
        return max((-(-(seq_len // g.ratio) // g.block_rows) for g in self.groups if g.ratio), default=0)

    def table_blocks(self, max_seq_len: int) -> int:
        """The widest block table a row of at most `max_seq_len` positions has, with one block to spare: the
        `blocks` dimension's bound in the exported graphs and profiles, and per row, the most the runtime's pool
        can ever use."""
        return self.blocks_for(max_seq_len) + 1

    def inputs(self, dtype: str) -> list[TensorSpec]:
        """`slots`, `block_table` (when a group grows), then `pool.*`: slot pools of rings, block pools of rows."""
        address = [TensorSpec(SLOTS, "int64", ("batch",))]
        if self.paged:
            address.append(TensorSpec(BLOCK_TABLE, "int64", ("batch", "blocks")))
        return address + [TensorSpec(g.pool, dtype, ("pool_blocks", g.block_rows, g.width) if g.ratio
                                     else ("pool_slots", g.rows_fixed, g.width)) for g in self.groups]

    def emitted(self, seq: int) -> dict[str, int]:
        """The rows dimension of the growing groups' `new.*` outputs in a call of `seq` positions, by name."""
        return {_dynamic_rows(g, "emitted"): emitted_rows(seq, g.ratio, 0) for g in self.groups if g.ratio}

    def outputs(self, dtype: str) -> list[TensorSpec]:
        """`new.*`: per-position deltas, or the rows of the windows a forward closed."""
        return [TensorSpec(g.new, dtype, ("batch", _dynamic_rows(g, "emitted") if g.ratio else "seq", g.width))
                for g in self.groups]


def _dynamic_rows(group: CacheGroup, what: str) -> str:
    return f"{what}_csa" if group.kind == CSA else f"{what}_hca"


def target_specs(cfg: V4Config, dtype: str = "float32", stage: Stage | None = None,
                 extra_inputs: Sequence[TensorSpec] = (), extra_outputs: Sequence[TensorSpec] = ()
                 ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the target graph, or of one pipeline stage of it: the engine contract.

    A pipeline stage of the target (contract/stages.py) takes the previous stage's `hidden` as `hidden_in` unless it
    is the first, returns `logits` only if it is the last, and reads and writes only its own layers' cache groups.
    `extra_inputs`, `extra_outputs`: what the engine's drafter adds to this stage (its DraftSpec's `stage_io`,
    contract/drafting.py: DSpark's captured rows, handed from stage to stage as `captured_in`)."""
    stage = stage or single_stage(cfg.num_hidden_layers)[0]
    layout = CacheLayout.target(cfg, layers=stage.layers)
    tokens = [TensorSpec("input_ids", "int64", ("batch", "seq")), TensorSpec("positions", "int64", ("batch", "seq"))]
    streams = TensorSpec(STREAMS, dtype, ("batch", "seq", cfg.hc_mult, cfg.hidden_size))
    logits = [TensorSpec("logits", "float32", ("batch", "seq", cfg.vocab_size))] if stage.last else []
    inputs = ([] if stage.first else [TensorSpec(STAGE_INPUT, dtype, streams.shape)]) + list(extra_inputs) + tokens
    return inputs + layout.inputs(dtype), logits + [streams] + list(extra_outputs) + layout.outputs(dtype)
