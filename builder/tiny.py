"""Tiny DeepSeek-V4 checkpoints for tests and examples: random, seeded, laid out like the real release.

`make_tiny` writes config.json + sharded safetensors + model.safetensors.index.json, including the
`mtp.0.*` draft layer, optionally quantized as the official release is (FP8 e4m3 with 128x128 e8m0 block
scales; MXFP4 routed experts with one e8m0 scale per 32 inputs). `names="hf"` writes the layout that
transformers' `save_pretrained` writes (and `DeepseekV4ForCausalLM.from_pretrained` loads).
"""
from __future__ import annotations

import json
import re
import shutil
import string
from pathlib import Path, PurePosixPath
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from v4engine.contract.config import V4Config
from v4engine.contract.errors import ConfigError
from v4engine.contract.staging import Ours, check_destination, staged_folder

from .checkpoint import FP8_QUANTIZATION_CONFIG, quantize_fp8_block, quantize_mxfp4
from .model import Transformer
from .model.dspark import DSpark
from .model.v4 import FP32_PARAMETERS

_YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
_COMMON: dict[str, Any] = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_key_value_heads": 1,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "n_shared_experts": 1, "num_nextn_predict_layers": 1, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "float32",
}

# Official-form configs. Together they cover every layer kind, hash and scored MoE, o_groups that split a
# head in two, windows shorter than the test sequences, and more compressed rows than index_topk.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixed": {**_COMMON, "vocab_size": 128, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 48, "o_groups": 2,
              "o_lora_rank": 24, "sliding_window": 8, "compress_ratios": [0, 4, 8, 4, 0], "compress_rate_csa": 4,
              "compress_rate_hca": 8, "num_hash_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "index_n_heads": 2, "index_head_dim": 16, "index_topk": 3, "rope_scaling": _YARN},
    "split_groups": {**_COMMON, "vocab_size": 96, "hidden_size": 64, "moe_intermediate_size": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 32, "qk_rope_head_dim": 8,
                     "q_lora_rank": 32, "o_groups": 4, "o_lora_rank": 16, "sliding_window": 16,
                     "compress_ratios": [16, 4, 0], "compress_rate_csa": 4, "compress_rate_hca": 16,
                     "num_hash_layers": 1, "n_routed_experts": 3, "num_experts_per_tok": 2, "index_n_heads": 3,
                     "index_head_dim": 16, "index_topk": 2},
    "flash_like": {**_COMMON, "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
                   "q_lora_rank": 64, "o_groups": 8, "o_lora_rank": 16, "sliding_window": 16,
                   "compress_ratios": [0, 0, 4, 32, 0], "compress_rate_csa": 4, "compress_rate_hca": 32,
                   "num_hash_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 3, "index_n_heads": 4,
                   "index_head_dim": 32, "index_topk": 4, "rope_scaling": _YARN},
}

# A wide config, not a tiny one (so not in TINY_CONFIGS, which the tests run): one sliding, one CSA and one HCA
# layer and the MTP layer at V4's head and index widths, 64 experts top-6 (V4-Flash: 256 top-6). With
# --quantize mxfp4 it is a 0.3 GB checkpoint in which, as in the release, routed experts are most of the bytes: what
# a tiny model hides (expert count, width, context) shows here (benchmarks/bench_slice.py).
WIDE_CONFIGS: dict[str, dict[str, Any]] = {
    "slice": {**_COMMON, "vocab_size": 16384, "hidden_size": 1024, "moe_intermediate_size": 512,
              "num_hidden_layers": 3, "num_attention_heads": 8, "head_dim": 512, "qk_rope_head_dim": 64,
              "q_lora_rank": 512, "o_groups": 4, "o_lora_rank": 256, "sliding_window": 128,
              "compress_ratios": [0, 4, 128, 0], "compress_rate_csa": 4, "compress_rate_hca": 128,
              "num_hash_layers": 1, "n_routed_experts": 64, "num_experts_per_tok": 6, "index_n_heads": 8,
              "index_head_dim": 128, "index_topk": 64, "max_position_embeddings": 65536,
              "rope_scaling": {**_YARN, "original_max_position_embeddings": 4096}},
}
CONFIGS = {**TINY_CONFIGS, **WIDE_CONFIGS}

FP8_WEIGHTS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|"
                         r"e_proj|h_proj|main_proj)\.weight$")
DRAFTERS = ("mtp", "dspark")           # the draft modules make-tiny writes under mtp.*


def dspark_config(raw: dict[str, Any], markov_rank: int = 16) -> dict[str, Any]:
    """`raw` (with an MTP layer) as the 0731 release lays out a DSpark drafter: the dspark_* keys (it reads the
    last three target layers, or all of fewer), three draft stages in compress_ratios, num_nextn_predict_layers
    still 1."""
    layers = raw["num_hidden_layers"]
    return {**raw, "compress_ratios": raw["compress_ratios"][:layers] + [0, 0, 0], "dspark_block_size": 5,
            "dspark_noise_token_id": raw["vocab_size"] - 1, "dspark_target_layer_ids": list(range(max(0, layers - 3),
                                                                                                 layers)),
            "dspark_markov_rank": markov_rank}
ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def random_model(cfg: V4Config, seed: int, agree: float | None = None) -> Transformer:
    """Seeded weights of a plausible scale: unit-variance activations, routers that disagree, live sinks.

    `agree` (e.g. 0.1) builds an MTP layer that mostly predicts what the target will: every block's output
    projections are scaled by `agree`, so the target is close to a bigram model head(norm(emb(t))), and the
    MTP layer reads only emb(t_{i+1}) (e_proj = I, h_proj = 0), which makes it the same bigram one step
    ahead. Context still moves both a little, so drafts are accepted often but not always, and every cache
    path (accept, reject, rollback) is exercised with outputs that depend on the caches."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(cfg, mtp=cfg.dspark is None)
    with torch.no_grad():
        randomize(model, gen)
        if agree is not None:
            model.embed.weight.mul_(cfg.hidden_size ** 0.5)            # embeddings of unit RMS dominate the stream
            for name, p in model.named_parameters():
                if re.search(r"(attn\.wo_b|ffn\.experts\.\d+\.w2|ffn\.shared_experts\.w2)\.weight$", name):
                    p.mul_(agree)
            for mtp in model.mtp:
                mtp.e_proj.weight.copy_(torch.eye(cfg.hidden_size))
                mtp.h_proj.weight.zero_()
                mtp.enorm.weight.fill_(1.0)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                        for _ in range(cfg.vocab_size)]
                buf.copy_(torch.stack(rows))
    return model


def randomize(model: nn.Module, gen: torch.Generator) -> None:
    """Every parameter at a plausible scale: norms near 1, matrices of unit gain, the rest (hc mixes, sinks) small;
    drawn on the generator's device. Under no_grad of its own: parameters are leaves that require grad."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=gen.device)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * noise)


def random_dspark(target: Transformer, seed: int, agree: float | None = None) -> DSpark:
    """A seeded DSpark drafter for `target` (whose config has the dspark_* keys), sharing its embedding and head.

    `agree` (with a target made with the same `agree`, close to the bigram head(norm(emb(t)))): the Markov head
    becomes that bigram (W1 = the final norm of each embedding, W2 = the head; dspark_markov_rank must be the
    hidden size) and the stages' part of the logits is scaled by `agree`, so drafts are often accepted but not
    always, and the block still moves them a little."""
    gen = torch.Generator().manual_seed(seed + 1)
    drafter = DSpark(target.cfg)
    with torch.no_grad():
        randomize(drafter, gen)
        drafter.embed.weight.copy_(target.embed.weight)
        drafter.head.weight.copy_(target.head.weight)
        if agree is not None:
            last = drafter.mtp[-1]
            last.markov_head.markov_w1.weight.copy_(target.norm(target.embed.weight))
            last.markov_head.markov_w2.weight.copy_(target.head.weight)
            last.norm.weight.mul_(agree)
    return drafter


def official_to_hf_name(name: str) -> str:
    """The name transformers' save_pretrained gives an official tensor (mtp.0.* is kept as is)."""
    if name.startswith("mtp."):
        return name
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name.startswith("hc_head_"):
        return "model.hc_head.hc_" + name[len("hc_head_"):]
    if name == "head.weight":
        return name
    name = re.sub(r"\.attn\.kv_norm\.weight$", ".attn.norm.weight", name)
    return "model." + name


def hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The transformers form of an official-form config (what save_pretrained writes)."""
    cfg = V4Config.from_dict(raw)
    out = {k: v for k, v in raw.items() if k not in ("compress_ratios", "num_hash_layers", "rope_scaling",
                                                     "compress_rate_csa", "compress_rate_hca", "topk_method")}
    out.update(layer_types=list(cfg.layer_types), mlp_layer_types=list(cfg.mlp_layer_types),
               compress_rates=dict(cfg.compress_rates), dtype=raw.get("torch_dtype", "float32"))
    factor = cfg.qk_rope_head_dim / cfg.head_dim
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta, "partial_rotary_factor": factor}
    if "rope_scaling" in raw:
        compress.update({k: v for k, v in raw["rope_scaling"].items() if k != "type"}, rope_type="yarn",
                        attention_factor=1.0)
    out.update(partial_rotary_factor=factor, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": factor},
        "compress": compress})
    return out


def stored_form(name: str, is_integer: bool, quantize: str | None) -> str:
    """How the release stores a parameter: 'as_is' (integers, fp32 mixes), 'mxfp4', 'fp8' or 'dtype' (the
    checkpoint's float dtype). quantize: None (no quantization), 'fp8', or 'mxfp4' (the V4-Flash release)."""
    if is_integer or FP32_PARAMETERS.search(name):
        return "as_is"
    if quantize == "mxfp4" and ROUTED_EXPERT.search(name):
        return "mxfp4"
    if quantize and (FP8_WEIGHTS.search(name) or ROUTED_EXPERT.search(name)):
        return "fp8"
    return "dtype"


def stored_tensors(model: nn.Module, dtype: torch.dtype, quantize: str | None, scale_suffix: str = "scale"
                   ) -> dict[str, torch.Tensor]:
    """`model`'s tensors as a checkpoint stores them: each in its stored form (stored_form), FP8 and MXFP4 with
    their scales (`scale_suffix`: "scale", official, or transformers' "weight_scale_inv")."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.detach().contiguous()
        form = stored_form(name, value.dtype == torch.int64, quantize)
        if form == "as_is":
            out[name] = value
        elif form == "mxfp4":
            packed, scale = quantize_mxfp4(value)
            out[name], out[name[: -len("weight")] + "scale"] = packed, scale
        elif form == "fp8":
            q, scale = quantize_fp8_block(value)
            out[name] = q
            prefix = name[: -len("weight")]
            if scale_suffix == "scale":
                out[prefix + "scale"] = scale
            else:  # transformers' fp8 naming: a float32 multiplier
                out[prefix + "weight_scale_inv"] = torch.exp2(scale.view(torch.uint8).float() - 127)
        else:
            out[name] = value.to(dtype)
    return out


MAX_SHARDS = 64


def check_shards(shards: object) -> None:
    """A checkpoint writer's shard count: 0 or -1 must not quietly mean one."""
    if not (isinstance(shards, int) and not isinstance(shards, bool) and 1 <= shards <= MAX_SHARDS):
        raise ConfigError(f"shards must be an integer from 1 to {MAX_SHARDS} (got {shards!r})")


def make_tiny(out: str | Path, config: str = "mixed", seed: int = 0, quantize: str | None = None,
              names: str = "official", dtype: str = "float32", shards: int = 2, mtp: bool = True,
              agree: float | None = None, force: bool = False, drafter: str = "mtp") -> Path:
    """Write a tiny random checkpoint folder; returns its path. `force` replaces `out` only if v4build wrote it.
    `drafter`: the draft module under mtp.* (DRAFTERS: V4's MTP layer, or the 0731 release's DSpark); `mtp=False`
    writes none (the dspark_* keys stay in config.json)."""
    if config not in CONFIGS:
        raise ConfigError(f"unknown tiny config {config!r}; choose one of {sorted(CONFIGS)}")
    if drafter not in DRAFTERS:
        raise ConfigError(f"unknown drafter {drafter!r}; choose one of {list(DRAFTERS)}")
    check_shards(shards)
    if agree is not None and not (isinstance(agree, (int, float)) and 0 < agree <= 1):
        raise ConfigError(f"agree must be a number above 0 and at most 1 (got {agree!r})")
    check_destination(Path(out), force, CHECKPOINT_FOLDER)      # before any work
    raw = dict(CONFIGS[config], torch_dtype=dtype)
    if drafter == "dspark":
        raw = dspark_config(raw, raw["hidden_size"] if agree is not None else 16)
    model = random_model(V4Config.from_dict(raw, source=f"tiny config {config}"), seed, agree)
    draft = random_dspark(model, seed, agree) if drafter == "dspark" and mtp else None
    return save_checkpoint(model, raw, out, quantize=quantize, names=names, dtype=dtype, shards=shards, mtp=mtp,
                           texts={"tokenizer.json": character_tokenizer(raw["vocab_size"])}, force=force,
                           draft=draft)


def character_tokenizer(vocab_size: int) -> str:
    """tokenizer.json of a tokenizer of single characters, for a tiny random model, so that its engine takes text
    like a real one: <bos> and <eos> at the tiny configs' ids (0, 1), <unk> for a character outside, then space,
    newline, letters, digits and punctuation (the rarest last), as many as the vocabulary holds; every id left is a
    reserved special token (`<reserved_N>`, decoded to nothing), so that any id the model can write is one of the
    tokenizer's, as in a real checkpoint."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    rare = "`~|^\\$"
    punctuation = "".join(c for c in string.punctuation if c not in rare) + rare
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    for c in (" \n" + string.ascii_lowercase + string.ascii_uppercase + string.digits + punctuation)[:vocab_size - 3]:
        vocab[c] = len(vocab)
    reserved = [f"<reserved_{i}>" for i in range(len(vocab), vocab_size)]
    vocab.update({name: len(vocab) + i for i, name in enumerate(reserved)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")    # every character
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<bos>", "<eos>", *reserved])
    return tokenizer.to_str()


def save_checkpoint(model: Transformer, raw: dict[str, Any], out: str | Path, quantize: str | None = None,
                    names: str = "official", dtype: str = "float32", shards: int = 2, mtp: bool = True,
                    extra_files: dict[str, Path] | None = None, texts: dict[str, str] | None = None,
                    force: bool = False, draft: DSpark | None = None) -> Path:
    """Write `model` as a checkpoint folder laid out like the release (config.json in official form `raw`,
    sharded safetensors + index, mtp.* in the last shard), or as save_pretrained writes it (names="hf").
    `draft`: a DSpark drafter whose mtp.* tensors go beside the target's (its embedding and head are the target's).
    Built in a temporary folder and renamed at the end; `extra_files` (e.g. tokenizer.json) are copied in, `texts`
    written as given."""
    raw = dict(raw, torch_dtype=dtype)
    scale_suffix = "scale" if names == "official" else "weight_scale_inv"
    tensors = stored_tensors(model, getattr(torch, dtype), quantize, scale_suffix)
    if draft is not None:
        tensors |= {k: v for k, v in stored_tensors(draft, getattr(torch, dtype), quantize, scale_suffix).items()
                    if k.startswith("mtp.")}
    if not mtp:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    if names == "hf":
        tensors = {official_to_hf_name(k): v for k, v in tensors.items()}
        raw = hf_config(raw)
    if quantize:
        raw["quantization_config"] = FP8_QUANTIZATION_CONFIG
        raw["expert_dtype"] = "fp4" if quantize == "mxfp4" else "fp8"

    def write_shard(path: Path, names: list[str]) -> int:
        save_file({k: tensors[k] for k in names}, str(path), metadata={"format": "pt"})
        return sum(tensors[k].numel() * tensors[k].element_size() for k in names)

    return write_checkpoint_folder(out, raw, list(tensors), shards, write_shard, extra_files, texts, force)


MADE = ".v4build-checkpoint"           # marks a checkpoint folder v4build wrote: the only kind --force replaces


def _checkpoint_entry(entry: PurePosixPath) -> bool:
    """What a checkpoint writer writes: the marker, config and tokenizer files, safetensors shards and their index."""
    return len(entry.parts) == 1 and (entry.name == MADE or entry.suffix in (".json", ".safetensors"))


CHECKPOINT_FOLDER = Ours("a checkpoint folder written by v4build (make-tiny, make-release)", MADE, _checkpoint_entry)


def write_checkpoint_folder(out: str | Path, raw: dict[str, Any], names: list[str], shards: int,
                            write_shard: Callable[[Path, list[str]], int],
                            extra_files: dict[str, Path] | None = None, texts: dict[str, str] | None = None,
                            force: bool = False) -> Path:
    """A checkpoint folder laid out like the release: `names` over `shards` safetensors files (write_shard(path,
    names) writes one and returns its data bytes), the index, config.json `raw`, `extra_files` and `texts`; built in a
    temporary folder and renamed at the end. An existing `out` is replaced only with `force`, and only if it is
    a checkpoint folder v4build wrote (it holds MADE)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(out, "writing", force, CHECKPOINT_FOLDER) as tmp:
        (tmp / MADE).write_text("written by v4build; `--force` may replace this folder\n")
        groups = shard_groups(names, shards)
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            total += write_shard(tmp / fname, group)
            weight_map.update(dict.fromkeys(group, fname))
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        for name, source in (extra_files or {}).items():
            shutil.copy2(source, tmp / name)
        for name, text in (texts or {}).items():
            (tmp / name).write_text(text)
    return out


def shard_groups(names: list[str], shards: int) -> list[list[str]]:
    """Target tensors spread over shards-1 files (all of them if shards == 1); mtp.0.* in the last, as released."""
    target = [n for n in names if not n.startswith("mtp.")]
    draft = [n for n in names if n.startswith("mtp.")]
    n = max(1, shards - 1) if draft and shards > 1 else max(1, shards)
    per = -(-len(target) // n)
    groups = [target[i * per:(i + 1) * per] for i in range(n)]
    if draft:
        if shards > 1:
            groups.append(draft)
        else:
            groups[-1] += draft
    return [g for g in groups if g]


__all__ = ["DRAFTERS", "dspark_config", "random_dspark", "TINY_CONFIGS", "WIDE_CONFIGS", "CONFIGS", "make_tiny", "save_checkpoint", "stored_tensors", "random_model", "official_to_hf_name", "hf_config",
           "stored_form", "shard_groups", "write_checkpoint_folder"]
