"""DeepSeek-V4 as released, without the bytes: the release configs, and checkpoints of their exact layout whose
tensor data are holes.

`write_release_checkpoint` writes every tensor of a release (names, safetensors dtypes and shapes as the release
stores them: BF16, FP8 E4M3 with 128x128 E8M0 block scales, MXFP4 routed experts with one E8M0 scale per 32
inputs, I64 hash tables, the draft module under `mtp.*` in the last shard: the MTP layer, or the DSpark drafter of
the 0731 and 0813 releases) into sharded safetensors files with valid
headers, each file then extended to its full length with a hole: sparse files that use no disk. The values read
back are zeros. It is how the builder is run and measured at full size (V4-Flash: 43 layers, 256 experts,
about 160 GB) on a machine without the weights.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

from v4engine.contract.config import V4Config
from v4engine.contract.errors import ConfigError
from v4engine.contract.staging import check_destination

from .checkpoint import FP8_BLOCK, FP8_QUANTIZATION_CONFIG, MXFP4_BLOCK, dtype_bytes
from .model import Transformer
from .model.dspark import DSpark
from .tiny import CHECKPOINT_FOLDER, check_shards, stored_form, write_checkpoint_folder

_FLASH: dict[str, Any] = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "torch_dtype": "bfloat16",
    "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "compress_rope_theta": 160000,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                          "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "num_hash_layers": 3, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_nextn_predict_layers": 1, "hidden_act": "silu",
    "attention_bias": False, "expert_dtype": "fp4",
    "quantization_config": FP8_QUANTIZATION_CONFIG,
}

# V4-Pro's sizes are known only from a mirror of its config.json (docs/model.md §1, §6) and its compress_ratios not
# at all: this takes transformers' default schedule (two HCA layers, then CSA and HCA alternating).
_PRO = {**_FLASH, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
        "o_groups": 16, "n_routed_experts": 384, "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5,
        "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]}

# The current releases: the same target architecture, a three-stage DSpark drafter under mtp.0..2 instead of the
# MTP layer (docs/model.md §4.2): compress_ratios then lists 0 for each stage; num_nextn_predict_layers stays 1.
_DSPARK = {"dspark_block_size": 5, "dspark_noise_token_id": 128799}
_FLASH_0731 = {**_FLASH, **_DSPARK, "compress_ratios": _FLASH["compress_ratios"][:43] + [0, 0, 0],
               "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256}
_PRO_0813 = {**_PRO, **_DSPARK, "compress_ratios": _PRO["compress_ratios"][:61] + [0, 0, 0],
             "dspark_target_layer_ids": [58, 59, 60], "dspark_markov_rank": 512}

RELEASES: dict[str, tuple[dict[str, Any], int, str]] = {
    "v4-flash": (_FLASH, 46, "DeepSeek-V4-Flash: config.json values and tensor layout as released (docs/model.md §9)"),
    "v4-pro": (_PRO, 64, "DeepSeek-V4-Pro: sizes from a mirror of its config.json; compress_ratios assumed"),
    "v4-flash-0731": (_FLASH_0731, 46, "DeepSeek-V4-Flash-0731: V4-Flash with the DSpark drafter (mtp.0..2) in place "
                      "of the MTP layer"),
    "v4-pro-0813": (_PRO_0813, 64, "DeepSeek-V4-Pro-0813: V4-Pro (its assumed compress_ratios) with the DSpark "
                    "drafter (Markov rank 512, target layers 58-60)"),
}


def release_tensors(raw: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor the release stores for this config: name -> (safetensors dtype, shape), in model order."""
    cfg = V4Config.from_dict(raw)
    quantize = "mxfp4" if raw.get("expert_dtype") == "fp4" else "fp8" if raw.get("quantization_config") else None
    float_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[raw.get("torch_dtype", "bfloat16")]
    with torch.device("meta"):
        state = Transformer(cfg, mtp=cfg.dspark is None).state_dict()
        if cfg.dspark is not None:               # its own tensors: the embedding and head are the target's
            state |= {k: v for k, v in DSpark(cfg).state_dict().items() if k.startswith("mtp.")}
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, value in state.items():
        shape = tuple(value.shape)
        form = stored_form(name, value.dtype == torch.int64, quantize)
        scale = name.removesuffix("weight") + "scale"
        if form == "as_is":
            out[name] = ("I64" if value.dtype == torch.int64 else "F32", shape)
        elif form == "mxfp4":
            out[name] = ("I8", shape[:-1] + (shape[-1] // 2,))
            out[scale] = ("F8_E8M0", shape[:-1] + (shape[-1] // MXFP4_BLOCK,))
        elif form == "fp8":
            out[name] = ("F8_E4M3", shape)
            out[scale] = ("F8_E8M0", tuple(-(-d // FP8_BLOCK) for d in shape))
        else:
            out[name] = (float_dtype, shape)
    return out


def _write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """A safetensors file with a valid header for `tensors`, its data a hole; returns its size in bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "content": "no data: a sparse stand-in"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * dtype_bytes(dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)                  # the data start 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return offset


def write_release_checkpoint(out: str | Path, release: str = "v4-flash", shards: int | None = None,
                             force: bool = False) -> Path:
    """Write the release's checkpoint folder (config.json, sharded safetensors + index) with no tensor data;
    `force` replaces `out` only if v4build wrote it."""
    if release not in RELEASES:
        raise ConfigError(f"unknown release {release!r}; choose one of {sorted(RELEASES)}")
    raw, release_shards, _ = RELEASES[release]
    if shards is not None:
        check_shards(shards)
    check_destination(Path(out), force, CHECKPOINT_FOLDER)      # before any work
    tensors = release_tensors(raw)
    return write_checkpoint_folder(out, raw, list(tensors), shards or release_shards,
                                   lambda path, names: _write_sparse_safetensors(path, {k: tensors[k] for k in names}),
                                   force=force)


__all__ = ["RELEASES", "release_tensors", "write_release_checkpoint"]
