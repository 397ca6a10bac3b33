"""V4Config reads both config.json forms in use, validates them, and derives what the rest needs."""
from __future__ import annotations

import json

import pytest

from v4engine.builder.tiny import TINY_CONFIGS, hf_config
from v4engine.contract.config import CSA, HCA, SLIDING, V4Config
from v4engine.contract.errors import ConfigError

# The published V4-Flash config.json (docs/model.md §9.4), official form.
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-6,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02,
    "max_position_embeddings": 1048576, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1,
    "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-6, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                           "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_the_published_flash_config():
    cfg = V4Config.from_dict(FLASH)
    assert cfg.layer_types[:2] == (SLIDING, SLIDING)
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    assert cfg.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 40
    assert cfg.rope(SLIDING).yarn is None and cfg.rope(SLIDING).theta == 10000
    assert cfg.rope(CSA).theta == 160000 and cfg.rope(CSA).yarn.factor == 16
    assert cfg.expert_dtype == "fp4" and cfg.quantization["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_official_and_transformers_forms_read_the_same(name):
    official = TINY_CONFIGS[name]
    assert V4Config.from_dict(official) == V4Config.from_dict(hf_config(official))


def test_what_transformers_writes_reads_back():
    from transformers import DeepseekV4Config

    written = DeepseekV4Config(num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA]).to_dict()
    cfg = V4Config.from_dict(json.loads(json.dumps(written)))
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.qk_rope_head_dim == 64 and cfg.mlp_layer_types[:3] == ("hash_moe",) * 3


def test_to_dict_round_trips():
    cfg = V4Config.from_dict(FLASH)
    assert V4Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("field, value, needle", [
    ("hidden_size", 0, "hidden_size"),
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("qk_rope_head_dim", 1000, "qk_rope_head_dim"),
    ("num_experts_per_tok", 300, "num_experts_per_tok"),
    ("scoring_func", "softmax", "scoring_func"),
    ("compress_ratios", [0, 4, 7], "compress_ratios"),
    ("compress_ratios", [0] * 43 + [4], "compress_ratios"),
    ("hc_eps", float("nan"), "hc_eps"),
    ("o_groups", 3, "o_groups"),
    ("num_hash_layers", -1, "num_hash_layers"),
])
def test_an_impossible_value_names_its_field(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        V4Config.from_dict({**FLASH, field: value})


def test_a_missing_field_is_named():
    raw = dict(FLASH)
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        V4Config.from_dict(raw)
