"""V4Config: the DeepSeek-V4 model configuration, read from either form of config.json.

Two forms are in use (docs/model.md §1, §9.4):
- what transformers writes: `layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters{main,compress}`;
- what the official release ships: `compress_ratios` (one entry per layer plus one per MTP layer),
  `num_hash_layers`, `rope_scaling` (YaRN, compress layers only), `compress_rope_theta`.
Both become the same typed, validated object. It lives in the runtime because engine.json carries it
and the runtime's cache accounting needs its derived facts; the builder imports it from here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .untrusted import MISSING, JsonFields, read_json, shown

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"


# Upper bounds of the size fields (README, "Security"): far beyond V4-Pro (its value in the comment), and small
# enough that nothing a config.json sizes can exhaust memory before the checkpoint's headers confirm the sizes.
SIZE_BOUNDS = {
    "vocab_size": 1 << 20,                  # 129,280
    "hidden_size": 1 << 16,                 # 7,168
    "moe_intermediate_size": 1 << 16,       # 3,072
    "num_hidden_layers": 512,               # 61
    "num_attention_heads": 1024,            # 128
    "head_dim": 4096,                       # 512
    "q_lora_rank": 1 << 16,                 # 1,536
    "o_groups": 1024,                       # 16
    "o_lora_rank": 1 << 16,                 # 1,024
    "sliding_window": 1 << 16,              # 128
    "index_n_heads": 1024,                  # 64
    "index_head_dim": 4096,                 # 128
    "index_topk": 1 << 16,                  # 512
    "hc_mult": 64,                          # 4
    "hc_sinkhorn_iters": 100,               # 20 (the exported graphs unroll every round)
    "n_routed_experts": 4096,               # 384
    "num_experts_per_tok": 256,             # 6
    "n_shared_experts": 64,                 # 1
    "max_position_embeddings": 1 << 24,     # 1,048,576
    "num_nextn_predict_layers": 8,          # 1 (the DSpark drafter of V4-Flash-0731: 3)
    "compress_rate": 1 << 16,               # 128
}
MAX_EXPERTS = 1 << 16           # routed experts over all layers (V4-Pro: 61 x 384 = 23,424)
DSPARK_PREFIX = "dspark_"       # config keys of the DSpark drafter (V4-Flash-0731), which is not an MTP layer
DSPARK_STAGES = 3               # the blocks of the releases' DSpark drafter (mtp.0..2)
MAX_DSPARK_BLOCK = 16           # drafted tokens per cycle a DSpark block may have (the releases: 5; recipes use 7)
V41_MODEL_TYPE = "deepseek_v41" # DeepSeek-V4.1: another architecture (encoder/decoder layers, CSA2, Engram tables)


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter of the current V4 releases (V4-Flash-0731, V4-Pro-0813, the -DSpark repacks): `stages`
    V4 blocks under mtp.0..stages-1 that read the mean of the target's hc streams after each of
    `target_layer_ids`, draft `block_size` tokens per cycle by default from a block [anchor, noise x (N - 1)], and
    correct each draft with a Markov head of rank `markov_rank` (docs/model.md §4.2)."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    stages: int = DSPARK_STAGES

    @classmethod
    def read(cls, f: JsonFields, n_layers: int, vocab: int) -> "DSparkConfig | None":
        """The dspark_* keys (and inference/config.json's n_mtp_layers) checked, or None without dspark_* keys."""
        if not any(k.startswith(DSPARK_PREFIX) for k in f.raw):
            return None
        ids = f.items("dspark_target_layer_ids", int, most=n_layers)
        for layer in ids:
            if not 0 <= layer < n_layers:
                f.fail("dspark_target_layer_ids", f"entries must be target layers, 0 to {n_layers - 1}", layer)
        if ids != sorted(set(ids)) or not ids:
            f.fail("dspark_target_layer_ids", "must list target layers in ascending order, at least one", ids)
        return cls(block_size=f.integer("dspark_block_size", 1, MAX_DSPARK_BLOCK),
                   noise_token_id=f.integer("dspark_noise_token_id", 0, vocab - 1),
                   target_layer_ids=tuple(ids),
                   markov_rank=f.integer("dspark_markov_rank", 1, SIZE_BOUNDS["hidden_size"]),
                   stages=f.integer("n_mtp_layers", 1, SIZE_BOUNDS["num_nextn_predict_layers"], DSPARK_STAGES))

    def to_json(self) -> dict[str, Any]:
        """As config.json says it."""
        return {"dspark_block_size": self.block_size, "dspark_noise_token_id": self.noise_token_id,
                "dspark_target_layer_ids": list(self.target_layer_ids), "dspark_markov_rank": self.markov_rank,
                "n_mtp_layers": self.stages}


@dataclass(frozen=True)
class Yarn:
    """DeepSeek YaRN on the compress rope (no mscale: cos and sin are not scaled)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class Rope:
    """The rotary of one layer: interleaved pairs on the trailing `dim` channels of each head."""

    theta: float
    dim: int
    yarn: Yarn | None = None


# What a config.json may leave out, and what it then is (DeepSeek-V4's own values)
DEFAULTS = {"sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "n_shared_experts": 1, "max_position_embeddings": 1048576,
            "num_nextn_predict_layers": 1}
DEFAULT_NUMBERS = {"hc_eps": 1e-6, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6}
AT_LEAST_ZERO = ("n_shared_experts", "num_nextn_predict_layers")


def _transformers_form(f: JsonFields, n_layers: int, n_draft: int, rates: dict[str, int]
                       ) -> tuple[list[str], list[str]]:
    """(layer kinds, MoE kinds) of transformers' form: listed, as `layer_types` and `mlp_layer_types`."""
    return f.items("layer_types", str, most=n_layers), _mlp_kinds(f, n_layers)


def _official_form(f: JsonFields, n_layers: int, n_draft: int, rates: dict[str, int]) -> tuple[list[str], list[str]]:
    """(layer kinds, MoE kinds) of the official form: each layer's compression ratio (`compress_ratios`, the draft
    layers' after the target's, all 0: the MTP layer's, or DSpark's stages)."""
    ratios = f.items("compress_ratios", int, None, most=n_layers + n_draft)
    if ratios is None:
        raise ConfigError(f"{f.source}: field 'layer_types' (or 'compress_ratios') is missing")
    if len(ratios) not in (n_layers, n_layers + n_draft):
        f.fail("compress_ratios", f"must have num_hidden_layers ({n_layers}) + the draft layers ({n_draft}) "
               "entries", len(ratios))
    if any(r != 0 for r in ratios[n_layers:]):
        f.fail("compress_ratios", "must be 0 (sliding) for the draft layers after the target's", ratios[n_layers:])
    kind_of = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
    bad = [r for r in ratios if r not in kind_of]
    if bad:
        f.fail("compress_ratios", f"entries must be one of {sorted(kind_of)}", bad[0])
    return [kind_of[r] for r in ratios[:n_layers]], _mlp_kinds(f, n_layers)


def _mlp_kinds(f: JsonFields, n_layers: int) -> list[str]:
    """`mlp_layer_types` when listed, else the first `num_hash_layers` (default 3) hash-routed, the rest scored."""
    listed = f.items("mlp_layer_types", str, None, most=n_layers)
    if listed is not None:
        return listed
    n_hash = f.integer("num_hash_layers", 0, SIZE_BOUNDS["num_hidden_layers"], 3)
    return [HASH_MOE] * min(n_layers, n_hash) + [MOE] * max(0, n_layers - n_hash)


def _rope_dim(f: JsonFields, head_dim: int) -> int:
    """qk_rope_head_dim (official), or head_dim x partial_rotary_factor (transformers), or V4's 64."""
    if "qk_rope_head_dim" in f.raw:
        return f.integer("qk_rope_head_dim", 1, SIZE_BOUNDS["head_dim"])
    if f.raw.get("partial_rotary_factor") is not None:
        return int(head_dim * f.number("partial_rotary_factor", 0.0, 1.0))
    return 64


def _compress_rates(f: JsonFields) -> dict[str, int]:
    """CSA's and HCA's compression ratios m and m': named (transformers' form), or inferred from the ratios of the
    official form (the smaller is CSA's overlapping m, the larger HCA's)."""
    named = f.get("compress_rates", dict, {})
    if named:
        rates = JsonFields(named, f.source, ConfigError, "compress_rates.")
        return {kind: rates.integer(kind, 2, SIZE_BOUNDS["compress_rate"], default)
                for kind, default in ((CSA, 4), (HCA, 128))}
    ratios = f.items("compress_ratios", int, [], most=SIZE_BOUNDS["num_hidden_layers"] * 2)
    nonzero = sorted({r for r in ratios if r})
    inferred = dict(zip((CSA, HCA), nonzero)) if len(nonzero) == 2 else {}
    if len(nonzero) == 1:
        inferred = {CSA: nonzero[0]} if nonzero[0] == 4 else {HCA: nonzero[0]}
    bound = SIZE_BOUNDS["compress_rate"]
    return {CSA: f.integer("compress_rate_csa", 2, bound, inferred.get(CSA, 4)),
            HCA: f.integer("compress_rate_hca", 2, bound, inferred.get(HCA, 128))}


def _ropes(f: JsonFields) -> tuple[float, float, Yarn | None]:
    """(main theta, compress theta, YaRN of the compress rope) from rope_parameters{main, compress} (transformers'
    form) or rope_theta, compress_rope_theta and rope_scaling (the official form)."""
    rope_theta = f.number("rope_theta", default=10000.0)         # finite and positive: validate()
    compress_theta = f.number("compress_rope_theta", default=160000.0)
    params = f.nested("rope_parameters", {})
    if isinstance(params.raw.get("compress"), dict):
        main, scaling = params.nested("main", {}), params.nested("compress")
        rope_theta = main.number("rope_theta", default=rope_theta)
        compress_theta = scaling.number("rope_theta", default=compress_theta)
    else:
        scaling = f.nested("rope_scaling", {}) if f.raw.get("rope_scaling") else params
    if (scaling.get("rope_type", str, None) or scaling.get("type", str, None)) != "yarn":
        return rope_theta, compress_theta, None
    yarn = Yarn(factor=scaling.number("factor", 1.0, 1e6),
                original_max_position_embeddings=scaling.integer("original_max_position_embeddings", 1,
                                                                 SIZE_BOUNDS["max_position_embeddings"]),
                beta_fast=scaling.number("beta_fast", default=32.0) or 32.0,
                beta_slow=scaling.number("beta_slow", default=1.0) or 1.0)
    return rope_theta, compress_theta, yarn


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    mlp_layer_types: tuple[str, ...]
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    max_position_embeddings: int
    num_key_value_heads: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None
    expert_dtype: str | None = None
    dspark: DSparkConfig | None = None            # the drafter of a checkpoint whose draft module is DSpark
    source: str = field(default="config.json", compare=False)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_file(cls, path: str | Path) -> "V4Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json(path, ConfigError, "config.json not found"), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "V4Config":
        """Read the transformers form or the official form (told apart by `layer_types`).

        config.json is untrusted: every field is type-checked here, and every size bounded (SIZE_BOUNDS) before
        anything is computed from it; the rest of the checks are validate()'s. What the two forms say differently
        (the layer kinds, the MoE kinds) each form's own function reads; the rest is common, with DEFAULTS for what
        a config may leave out."""
        f = JsonFields(raw, source, ConfigError)
        if f.get("model_type", str, "deepseek_v4") == V41_MODEL_TYPE:
            raise ConfigError(f"{source}: model_type '{V41_MODEL_TYPE}' is DeepSeek-V4.1, another architecture "
                              "(encoder/decoder layers, CSA2, Engram tables, 32x32 FP8 blocks) that v4engine does not "
                              "build; it builds DeepSeek-V4 ('deepseek_v4')")
        if f.get("model_type", str, "deepseek_v4") != "deepseek_v4":
            f.fail("model_type", "must be 'deepseek_v4'", raw["model_type"])
        sizes = {name: f.integer(name, 0 if name in AT_LEAST_ZERO else 1, bound, DEFAULTS.get(name, MISSING))
                 for name, bound in SIZE_BOUNDS.items() if name not in ("compress_rate", "moe_intermediate_size")}
        sizes["moe_intermediate_size"] = f.integer(      # transformers' configs of other models say intermediate_size
            "moe_intermediate_size", 1, SIZE_BOUNDS["moe_intermediate_size"],
            f.integer("intermediate_size", 1, SIZE_BOUNDS["moe_intermediate_size"], None) or MISSING)
        numbers = {name: f.number(name, default=default) for name, default in DEFAULT_NUMBERS.items()}
        form = _transformers_form if raw.get("layer_types") is not None else _official_form
        compress_rates = _compress_rates(f)
        dspark = DSparkConfig.read(f, sizes["num_hidden_layers"], sizes["vocab_size"])
        layer_types, mlp_layer_types = form(f, sizes["num_hidden_layers"],
                                            dspark.stages if dspark else sizes["num_nextn_predict_layers"],
                                            compress_rates)
        rope_theta, compress_theta, yarn = _ropes(f)
        quant = f.get("quantization_config", dict, None)
        expert_dtype = f.get("expert_dtype", str, None)
        if expert_dtype is None and quant is not None:
            expert_dtype = JsonFields(quant, source, ConfigError, "quantization_config.").get("expert_dtype", str, None)
        eos = f.get("eos_token_id", (int, list), None)
        cfg = cls(
            **sizes, **numbers,
            qk_rope_head_dim=_rope_dim(f, sizes["head_dim"]),
            layer_types=tuple(layer_types),
            compress_rates=compress_rates,
            mlp_layer_types=tuple(mlp_layer_types),
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            yarn=yarn,
            num_key_value_heads=f.get("num_key_value_heads", int, 1),
            scoring_func=f.get("scoring_func", str, "sqrtsoftplus"),
            norm_topk_prob=f.get("norm_topk_prob", bool, True),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
            bos_token_id=f.get("bos_token_id", int, None) if "bos_token_id" in raw else 0,
            eos_token_id=(f.items("eos_token_id", int, most=1024) if isinstance(eos, list) else eos)
            if "eos_token_id" in raw else 1,
            torch_dtype=f.get("torch_dtype", str, None) or f.get("dtype", str, "bfloat16"),
            quantization=dict(quant) if quant is not None else None,
            expert_dtype=expert_dtype,
            dspark=dspark,
            source=source,
        )
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict in the transformers form (round-trips through from_dict)."""
        d = asdict(self)
        d.pop("source")
        d.pop("yarn")
        d.pop("dspark")
        d.update(self.dspark.to_json() if self.dspark is not None else {})
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["quantization_config"] = d.pop("quantization")
        compress: dict[str, Any] = {"rope_type": "default", "rope_theta": self.compress_rope_theta}
        if self.yarn is not None:
            compress = {"rope_type": "yarn", "rope_theta": self.compress_rope_theta, "attention_factor": 1.0,
                        **asdict(self.yarn)}
        d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": self.rope_theta}, "compress": compress}
        d["model_type"] = "deepseek_v4"
        return d

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first impossible field."""
        src = self.source

        def fail(name: str, why: str, value: Any) -> None:
            raise ConfigError(f"{src}: field '{name}' {why} (got {shown(value)})")

        for name, bound in SIZE_BOUNDS.items():
            if name == "compress_rate":
                continue
            v, low = getattr(self, name), 0 if name in ("n_shared_experts", "num_nextn_predict_layers") else 1
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= bound:
                fail(name, f"must be an integer from {low} to {bound}", v)
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "swiglu_limit",
                     "routed_scaling_factor"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                fail(name, "must be a positive finite number", v)
        if self.num_key_value_heads != 1:
            fail("num_key_value_heads", "must be 1 (V4 attention is MQA with one shared K=V head)",
                 self.num_key_value_heads)
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            fail("qk_rope_head_dim", f"must be even and in [2, head_dim={self.head_dim}]", self.qk_rope_head_dim)
        if self.qk_rope_head_dim > self.index_head_dim:
            fail("index_head_dim", f"must be >= qk_rope_head_dim ({self.qk_rope_head_dim})", self.index_head_dim)
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail("o_groups", f"must divide num_attention_heads*head_dim ({self.num_attention_heads * self.head_dim})",
                 self.o_groups)
        if self.num_hidden_layers * self.n_routed_experts > MAX_EXPERTS:
            fail("n_routed_experts", f"times num_hidden_layers ({self.num_hidden_layers}) must be at most "
                 f"{MAX_EXPERTS}", self.n_routed_experts)
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"must be <= n_routed_experts ({self.n_routed_experts})",
                 self.num_experts_per_tok)
        if self.scoring_func != "sqrtsoftplus":
            fail("scoring_func", "must be 'sqrtsoftplus' (the only router DeepSeek-V4 uses)", self.scoring_func)
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"must have num_hidden_layers ({self.num_hidden_layers}) entries",
                 len(self.layer_types))
        for t in self.layer_types:
            if t not in LAYER_KINDS:
                fail("layer_types", f"entries must be one of {LAYER_KINDS}", t)
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            fail("mlp_layer_types", f"must have num_hidden_layers ({self.num_hidden_layers}) entries",
                 len(self.mlp_layer_types))
        for t in self.mlp_layer_types:
            if t not in (HASH_MOE, MOE):
                fail("mlp_layer_types", f"entries must be one of {(HASH_MOE, MOE)}", t)
        for kind, m in self.compress_rates.items():
            if not isinstance(m, int) or not 2 <= m <= SIZE_BOUNDS["compress_rate"]:
                fail(f"compress_rates.{kind}", f"must be an integer from 2 to {SIZE_BOUNDS['compress_rate']}", m)
        if self.compress_rates[CSA] == self.compress_rates[HCA]:
            fail("compress_rates", "CSA and HCA must use different ratios", self.compress_rates)
        if self.yarn is not None:
            y = self.yarn
            if not (math.isfinite(y.factor) and y.factor >= 1):
                fail("rope_scaling.factor", "must be a finite number >= 1", y.factor)
            if not 1 <= y.original_max_position_embeddings <= SIZE_BOUNDS["max_position_embeddings"]:
                fail("rope_scaling.original_max_position_embeddings",
                     f"must be from 1 to {SIZE_BOUNDS['max_position_embeddings']}", y.original_max_position_embeddings)
            if not (math.isfinite(y.beta_fast) and math.isfinite(y.beta_slow)):
                fail("rope_scaling.beta_fast", "and beta_slow must be finite", (y.beta_fast, y.beta_slow))
        if self.num_nextn_predict_layers > 1 and self.dspark is None:
            fail("num_nextn_predict_layers", "must be 0 or 1 (v4engine drafts with the original V4 mtp.0 layer)",
                 self.num_nextn_predict_layers)

    # ------------------------------------------------------------------ derived facts
    def ratio(self, layer: int) -> int:
        """Compression ratio m of a target layer (0 for sliding-only)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def rope(self, kind: str) -> Rope:
        """Sliding layers (and the MTP layer) use the main rope; CSA/HCA use the compress rope + YaRN."""
        if kind == SLIDING:
            return Rope(self.rope_theta, self.qk_rope_head_dim, None)
        return Rope(self.compress_rope_theta, self.qk_rope_head_dim, self.yarn)
