"""Our V4 equals transformers' DeepseekV4ForCausalLM (5.23, fp32, indexer ties by lowest index) within 1e-4."""
from __future__ import annotations

import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.contract.config import CSA, HCA
from v4engine.testkit.oracle import load_transformers, transformers_logits

TOL = 1e-4
# per config: a length past the window with several compressed rows and more CSA rows than index_topk
LENGTHS = {"mixed": 50, "split_groups": 70, "flash_like": 100}


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    state = ModelState(model.cfg, ids.shape[0])
    with torch.no_grad():
        return model(ids, state.positions(ids.shape[1]), state.views()).logits


@pytest.fixture(scope="module", params=sorted(LENGTHS))
def pair(request, tiny_checkpoint):
    folder = tiny_checkpoint(request.param, names="hf")
    return request.param, load_model(folder, mtp=True), load_transformers(folder)


def test_the_tiny_configs_cover_what_they_must(pair):
    name, ours, _ = pair
    cfg, length = ours.cfg, LENGTHS[name]
    assert length > cfg.sliding_window
    if CSA in cfg.layer_types:
        assert length // cfg.compress_rates[CSA] > cfg.index_topk, "more CSA rows than index_topk"
    if HCA in cfg.layer_types:
        assert length // cfg.compress_rates[HCA] >= 2, "several HCA rows"


def test_every_layer_kind_moe_kind_and_split_groups_are_covered():
    from v4engine.builder.tiny import TINY_CONFIGS
    from v4engine.contract.config import V4Config

    cfgs = [V4Config.from_dict(raw) for raw in TINY_CONFIGS.values()]
    assert {k for c in cfgs for k in c.layer_types} == {"sliding_attention", CSA, HCA}
    assert {k for c in cfgs for k in c.mlp_layer_types} == {"hash_moe", "moe"}
    assert any(c.num_attention_heads < c.o_groups for c in cfgs), "a group holds part of a head"


def test_prefill_logits_equal_transformers(pair):
    name, ours, hf = pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, LENGTHS[name]), generator=gen)
    diff = (our_logits(ours, ids) - transformers_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("length", [1, 7, 13])
def test_short_prompts_equal_transformers(pair, length):
    _, ours, hf = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    assert (our_logits(ours, ids) - transformers_logits(hf, ids)).abs().max().item() <= TOL


def test_logits_at_t_do_not_change_when_tokens_are_appended(pair):
    name, ours, _ = pair
    length = LENGTHS[name]
    ids = torch.randint(0, ours.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(2))
    full = our_logits(ours, ids)
    for t in (length // 2, length - 9, length - 1):
        prefix = our_logits(ours, ids[:, : t + 1])
        assert (prefix - full[:, : t + 1]).abs().max().item() <= 1e-5, f"position {t}"


def test_a_checkpoint_saved_by_transformers_loads_and_matches(pair, tmp_path):
    name, _, hf = pair
    hf.save_pretrained(tmp_path / "saved")
    ours = load_model(tmp_path / "saved", mtp=False)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, LENGTHS[name]), generator=torch.Generator().manual_seed(3))
    assert (our_logits(ours, ids) - transformers_logits(hf, ids)).abs().max().item() <= TOL
