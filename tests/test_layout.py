"""The cache layout (contract/layout.py) is the one home of the caches' facts: their groups and names, the rows
they hold and a forward reads, the rows a forward emits, and the graphs' inputs and outputs that follow. Whoever
else names or sizes a cache (the eager model, the exporter, the runtime's cache manager, the compressor ops) is
checked against it here or by the engine tests that run them together."""
from __future__ import annotations

from dataclasses import fields

import pytest

from v4engine.builder.model.v4 import LayerTensors
from v4engine.builder.release import RELEASES
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.contract.config import CSA, HCA, V4Config
from v4engine.contract.drafting import DRAFT_SPECS, MTP
from v4engine.contract.layout import (CacheLayout, closed_windows, emitted_rows, target_specs, open_window_tokens,
                                     state_tokens)

FLASH = V4Config.from_dict(RELEASES["v4-flash"][0])


def test_cache_accounting_of_flash():
    layout = CacheLayout.target(FLASH, value_bytes=2)
    groups = layout.groups
    # growth per token: 21 CSA layers * (512 + 128) / 4 + 20 HCA layers * 512 / 128 = 3440 values (docs/model.md)
    assert sum(g.bytes_per_token for g in groups) == 3440 * 2
    windows = [g for g in groups if g.name == "window_kv"]
    assert len(windows) == 43 and all(g.rows_fixed == 127 for g in windows)
    draft = MTP.layout(FLASH, value_bytes=2).groups
    assert [(g.layer, g.name, g.kind, g.rows_fixed, g.bytes_per_token) for g in draft] == [
        (43, "window_kv", "mtp", 127, 0.0)]
    csa_state = next(g for g in groups if g.name == "compressor_kv" and g.kind == CSA)
    assert (csa_state.rows_fixed, csa_state.width) == (7, 1024)
    # one block is 128 positions: 32 CSA rows, one HCA row; the first row of a block takes it
    assert layout.block_tokens == 128
    assert {(g.kind, g.block_rows) for g in groups if g.ratio} == {(CSA, 32), (HCA, 1)}
    assert [layout.blocks_for(n) for n in (0, 3, 4, 128, 131, 132, 1000)] == [0, 0, 1, 1, 1, 2, 8]
    assert sum(g.bytes_for(1000) for g in groups) == sum(g.fixed_bytes for g in groups) + sum(
        (1000 // g.ratio) * g.width * 2 for g in groups if g.ratio)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_the_eager_model_holds_a_field_for_every_group(name):
    cfg = V4Config.from_dict(TINY_CONFIGS[name])
    names = {g.name for layout in (CacheLayout.target(cfg), MTP.layout(cfg)) for g in layout.groups}
    assert names <= {f.name for f in fields(LayerTensors)}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_the_graphs_read_and_write_every_group_by_its_name(name):
    cfg = V4Config.from_dict(TINY_CONFIGS[name])
    graphs = [(target_specs(cfg), CacheLayout.target(cfg))]                 # the target, and every draft graph
    graphs += [(spec.graph_specs(cfg, "float32", 3), spec.layout(cfg)) for spec in DRAFT_SPECS.values()]
    assert CacheLayout.target(cfg).paged and not MTP.layout(cfg).paged
    for (inputs, outputs), layout in graphs:
        assert [s.name for s in inputs if s.name.startswith("pool.")] == [g.pool for g in layout.groups]
        assert [s.name for s in outputs if s.name.startswith("new.")] == [g.new for g in layout.groups]
        assert ("block_table" in {s.name for s in inputs}) == layout.paged
        for spec, g in zip((s for s in inputs if s.name.startswith("pool.")), layout.groups):
            assert spec.shape == (("pool_blocks", g.block_rows, g.width) if g.ratio
                                  else ("pool_slots", g.rows_fixed, g.width))
            assert not g.ratio or g.block_rows * g.ratio == layout.block_tokens


@pytest.mark.parametrize("kind, ratio", [(CSA, 4), (HCA, 128), (HCA, 8)])
def test_a_compressor_emits_one_row_slot_per_window_its_new_tokens_touch(kind, ratio):
    kept = open_window_tokens(kind, ratio)
    for new in range(1, 3 * ratio + 2):
        assert emitted_rows(kept + new, ratio, kept) == -(-new // ratio)


def test_state_tokens_come_from_the_layer_kind():
    assert [state_tokens(FLASH, kind) for kind in (CSA, HCA, "sliding_attention", "mtp")] == [7, 127, 0, 0]


def test_a_commit_keeps_the_rows_of_the_windows_it_closes():
    for ratio in (4, 128):
        for start in range(0, 3 * ratio):
            for n in range(0, 2 * ratio):
                assert closed_windows(start, n, ratio) == sum((p + 1) % ratio == 0 for p in range(start, start + n))
