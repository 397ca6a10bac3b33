"""V4Config: the DeepSeek-V4 model configuration, read from either form of config.json.

Two forms are in use (V4_MODEL.md §1, §9.4):
- what transformers writes: `layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters{main,compress}`;
- what the official release ships: `compress_ratios` (one entry per layer plus one per MTP layer),
  `num_hash_layers`, `rope_scaling` (YaRN, compress layers only), `compress_rope_theta`.
Both become the same typed, validated object. It lives in the runtime because engine.json carries it
and the runtime's cache accounting needs its derived facts; the builder imports it from here.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"


def read_json(path: Path, error: type[Exception], missing: str) -> Any:
    """The parsed JSON file, or `error` with one line naming the file (missing, or not valid JSON)."""
    if not path.is_file():
        raise error(f"{path}: {missing}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None


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


# Cache groups that grow one row per closed window of `ratio` tokens; a forward emits their rows per window
# closed, the other groups' per new position.
ROW_GROUPS = ("compressed_kv", "index_keys")


@dataclass(frozen=True)
class CacheGroup:
    """One cache the runtime allocates per sequence for one layer.

    `rows_fixed` rows are allocated up front (windows, compressor partial windows); `per_token`
    rows grow with the sequence (one compressed row per `ratio` tokens). `width` values per row of
    `value_bytes` bytes each.
    """

    layer: int
    name: str
    width: int
    value_bytes: int
    rows_fixed: int = 0
    ratio: int = 0

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
        """Read the transformers form or the official form (told apart by `compress_ratios`)."""

        def need(key: str) -> Any:
            if key not in raw:
                raise ConfigError(f"{source}: field '{key}' is missing")
            return raw[key]

        def get(key: str, default: Any) -> Any:
            return raw.get(key, default)

        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"{source}: field 'model_type' must be 'deepseek_v4' (got {raw['model_type']!r})")
        n_layers = need("num_hidden_layers")
        n_mtp = get("num_nextn_predict_layers", 1)
        compress_rates = dict(get("compress_rates", None) or {})
        if not compress_rates:
            # Official form: the ratios themselves say it (the smaller is CSA's overlapping m, the larger HCA's m').
            nonzero = sorted({r for r in raw.get("compress_ratios", []) if r})
            inferred = dict(zip((CSA, HCA), nonzero)) if len(nonzero) == 2 else {}
            if len(nonzero) == 1:
                inferred = {CSA: nonzero[0]} if nonzero[0] == 4 else {HCA: nonzero[0]}
            compress_rates = {CSA: get("compress_rate_csa", inferred.get(CSA, 4)),
                              HCA: get("compress_rate_hca", inferred.get(HCA, 128))}
        compress_rates.setdefault(CSA, 4)
        compress_rates.setdefault(HCA, 128)
        ratio_to_kind = {0: SLIDING, compress_rates[CSA]: CSA, compress_rates[HCA]: HCA}

        if "layer_types" in raw and raw["layer_types"] is not None:
            layer_types = tuple(raw["layer_types"])
        elif "compress_ratios" in raw:
            ratios = list(raw["compress_ratios"])
            if not isinstance(n_layers, int) or len(ratios) not in (n_layers, n_layers + n_mtp):
                raise ConfigError(
                    f"{source}: field 'compress_ratios' has {len(ratios)} entries; expected "
                    f"num_hidden_layers ({n_layers}) + num_nextn_predict_layers ({n_mtp})"
                )
            for r in ratios[n_layers:]:
                if r != 0:
                    raise ConfigError(f"{source}: field 'compress_ratios': the MTP layer must be 0 (sliding), got {r}")
            bad = [r for r in ratios if r not in ratio_to_kind]
            if bad:
                raise ConfigError(
                    f"{source}: field 'compress_ratios' entries must be one of {sorted(ratio_to_kind)} (got {bad[0]})"
                )
            layer_types = tuple(ratio_to_kind[r] for r in ratios[:n_layers])
        else:
            raise ConfigError(f"{source}: field 'layer_types' (or 'compress_ratios') is missing")

        if raw.get("mlp_layer_types") is not None:
            mlp_layer_types = tuple(raw["mlp_layer_types"])
        else:
            n_hash = get("num_hash_layers", 3)
            if not isinstance(n_hash, int) or n_hash < 0:
                raise ConfigError(f"{source}: field 'num_hash_layers' must be an integer >= 0 (got {n_hash!r})")
            mlp_layer_types = tuple([HASH_MOE] * min(n_layers, n_hash) + [MOE] * max(0, n_layers - n_hash))

        head_dim = need("head_dim")
        if "qk_rope_head_dim" in raw:
            rope_dim = raw["qk_rope_head_dim"]
        elif raw.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * raw["partial_rotary_factor"])
        else:
            rope_dim = 64

        rope_theta = get("rope_theta", 10000.0)
        compress_theta = get("compress_rope_theta", 160000.0)
        yarn_raw: dict | None = None
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("compress"), dict):
            compress = params["compress"]
            main = params.get("main", {})
            rope_theta = main.get("rope_theta", rope_theta)
            compress_theta = compress.get("rope_theta", compress_theta)
            if compress.get("rope_type", compress.get("type")) == "yarn":
                yarn_raw = compress
        else:
            scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None)
            if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
                yarn_raw = scaling
        yarn = None
        if yarn_raw is not None:
            try:
                yarn = Yarn(
                    factor=float(yarn_raw["factor"]),
                    original_max_position_embeddings=int(yarn_raw["original_max_position_embeddings"]),
                    beta_fast=float(yarn_raw.get("beta_fast") or 32),
                    beta_slow=float(yarn_raw.get("beta_slow") or 1),
                )
            except KeyError as e:
                raise ConfigError(f"{source}: field 'rope_scaling.{e.args[0]}' is missing (yarn)") from None

        quant = raw.get("quantization_config")
        cfg = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            moe_intermediate_size=get("moe_intermediate_size", get("intermediate_size", None)) or need("moe_intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=need("num_attention_heads"),
            head_dim=head_dim,
            q_lora_rank=need("q_lora_rank"),
            qk_rope_head_dim=rope_dim,
            o_groups=need("o_groups"),
            o_lora_rank=need("o_lora_rank"),
            sliding_window=get("sliding_window", 128),
            layer_types=layer_types,
            compress_rates={CSA: compress_rates[CSA], HCA: compress_rates[HCA]},
            mlp_layer_types=mlp_layer_types,
            rope_theta=float(rope_theta),
            compress_rope_theta=float(compress_theta),
            yarn=yarn,
            index_n_heads=get("index_n_heads", 64),
            index_head_dim=get("index_head_dim", 128),
            index_topk=get("index_topk", 512),
            hc_mult=get("hc_mult", 4),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", 20),
            hc_eps=float(get("hc_eps", 1e-6)),
            n_routed_experts=need("n_routed_experts"),
            num_experts_per_tok=need("num_experts_per_tok"),
            n_shared_experts=get("n_shared_experts", 1),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            num_nextn_predict_layers=n_mtp,
            max_position_embeddings=get("max_position_embeddings", 1048576),
            num_key_value_heads=get("num_key_value_heads", 1),
            scoring_func=get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=get("bos_token_id", 0),
            eos_token_id=get("eos_token_id", 1),
            torch_dtype=str(get("torch_dtype", get("dtype", "bfloat16"))),
            quantization=dict(quant) if isinstance(quant, dict) else None,
            expert_dtype=get("expert_dtype", quant.get("expert_dtype") if isinstance(quant, dict) else None),
            source=source,
        )
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict in the transformers form (round-trips through from_dict)."""
        d = asdict(self)
        d.pop("source")
        d.pop("yarn")
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
            raise ConfigError(f"{src}: field '{name}' {why} (got {value!r})")

        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                     "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
                     "num_experts_per_tok", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(name, "must be a positive integer", v)
        for name in ("n_shared_experts", "num_nextn_predict_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                fail(name, "must be an integer >= 0", v)
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
            if not isinstance(m, int) or m < 2:
                fail(f"compress_rates.{kind}", "must be an integer >= 2", m)
        if self.compress_rates[CSA] == self.compress_rates[HCA]:
            fail("compress_rates", "CSA and HCA must use different ratios", self.compress_rates)
        if self.yarn is not None:
            if not (self.yarn.factor >= 1):
                fail("rope_scaling.factor", "must be >= 1", self.yarn.factor)
            if self.yarn.original_max_position_embeddings < 1:
                fail("rope_scaling.original_max_position_embeddings", "must be >= 1",
                     self.yarn.original_max_position_embeddings)
        if self.num_nextn_predict_layers > 1:
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

    def state_tokens(self, kind: str) -> int:
        """Past tokens whose compressor inputs an open window still needs (CSA overlaps two windows)."""
        if kind == SLIDING:
            return 0
        m = self.compress_rates[kind]
        return 2 * m - 1 if kind == CSA else m - 1

    def cache_groups(self, draft: bool, mtp: int, value_bytes: int = 4) -> list[CacheGroup]:
        """Every cache a sequence needs, per layer, for the target (draft=False) or the MTP layer.

        Windows hold `sliding_window - 1 + mtp + 1` rows (the engine reads the last window-1 committed
        rows, a verify writes mtp+1 more before commit). Compressor partial windows likewise hold
        `state_tokens + mtp + 1` per-token rows (values and gates). Compressed rows and index keys grow
        one row per `ratio` tokens.
        """
        spare = mtp + 1
        win = self.sliding_window - 1 + spare
        if draft:
            return [CacheGroup(self.num_hidden_layers, "window_kv", self.head_dim, value_bytes, rows_fixed=win)]
        groups: list[CacheGroup] = []
        for i, kind in enumerate(self.layer_types):
            groups.append(CacheGroup(i, "window_kv", self.head_dim, value_bytes, rows_fixed=win))
            if kind == SLIDING:
                continue
            m = self.compress_rates[kind]
            width = 2 * self.head_dim if kind == CSA else self.head_dim
            state_rows = self.state_tokens(kind) + spare
            groups.append(CacheGroup(i, "compressor_kv", width, value_bytes, rows_fixed=state_rows))
            groups.append(CacheGroup(i, "compressor_gate", width, value_bytes, rows_fixed=state_rows))
            groups.append(CacheGroup(i, "compressed_kv", self.head_dim, value_bytes, ratio=m))
            if kind == CSA:
                groups.append(CacheGroup(i, "indexer_kv", 2 * self.index_head_dim, value_bytes, rows_fixed=state_rows))
                groups.append(CacheGroup(i, "indexer_gate", 2 * self.index_head_dim, value_bytes,
                                         rows_fixed=state_rows))
                groups.append(CacheGroup(i, "index_keys", self.index_head_dim, value_bytes, ratio=m))
        return groups
