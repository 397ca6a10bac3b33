"""Lazy, zero-copy reader for DeepSeek-V4 safetensors checkpoints.

We parse the safetensors headers ourselves because the exporter needs the absolute byte
offset of every tensor: ONNX external data points straight into the checkpoint files.
Tensors are exposed under the official DeepSeek release names (see docs/model.md §5), whatever
naming scheme the files use, and are read through one read-only ``numpy.memmap`` per file.

Quantized formats (docs/model.md §9.1, §9.2):
- ``fp8_block``: F8_E4M3 weight, scale multiplies per 128×128 block; the scale is F8_E8M0
  ``<prefix>.scale`` (official) or float ``<prefix>.weight_scale_inv``.
- ``mxfp4``: I8/U8 weight [out, in/2], two e2m1 codes per byte (low nibble = even index),
  F8_E8M0 ``.scale`` [out, in/32] multiplying per 1×32 block.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from v4engine.contract.errors import V4EngineError
from v4engine.contract.untrusted import (HeaderError, JsonFields, in_blob_store, open_regular, read_header,
                                        read_json, shown)
from v4engine.plugins.moe import E2M1_VALUES, FP8_BLOCK, MXFP4_BLOCK, decode_mxfp4


class CheckpointError(V4EngineError):
    """The checkpoint is unreadable, inconsistent, or not a DeepSeek-V4 checkpoint."""


# safetensors dtype -> numpy dtype of its raw view (its itemsize is the dtype's width).
# BF16 and the 8-bit floats have no numpy dtype, so raw() shows their bits.
SAFETENSORS_DTYPES: dict[str, str] = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "I32": "<i4", "I64": "<i8",
    "F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8", "F8_E4M3": "|u1", "F8_E5M2": "|u1", "F8_E8M0": "|u1",
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a safetensors dtype."""
    return np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize


_INTEGER_DTYPES = {"BOOL", "U8", "I8", "I16", "I32", "I64"}
_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# config.json's quantization_config of a release (and of the quantized checkpoints v4build writes)
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
_FP8_MAX = 448.0
_E2M1_MAX = 6.0
MAX_SHARDS = 4096            # safetensors files one checkpoint may list (V4-Pro: 64); each is mapped at once

# Canonical (official release) names.
_BLOCK = (
    r"attn_norm\.weight|ffn_norm\.weight|hc_(?:attn|ffn)_(?:fn|base|scale)"
    r"|attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight|attn\.attn_sink"
    r"|attn\.(?:indexer\.)?compressor\.(?:wkv\.weight|wgate\.weight|ape|norm\.weight)"
    r"|attn\.indexer\.(?:wq_b|weights_proj)\.weight"
    r"|ffn\.gate\.(?:weight|bias|tid2eid)"
    r"|ffn\.shared_experts\.w[123]\.weight|ffn\.experts\.\d+\.w[123]\.weight"
)
# mtp.N.{embed,head}.weight: Flash-Base repeats the shared embedding/head there (docs/model.md §4.1).
_MTP_INPUTS = ("e_proj", "h_proj", "enorm", "hnorm")      # what makes mtp.0 V4's MTP layer (DSpark has none)
_MTP_ONLY = r"(?:e_proj|h_proj|enorm|hnorm|norm|embed|head)\.weight|hc_head_(?:fn|base|scale)"
# DSpark (V4-Flash-0731, V4-Pro-0813): main_proj/main_norm on its first stage, the heads on its last (model.md §4.2)
_DSPARK_ONLY = r"(?:main_proj|main_norm|markov_head\.markov_w1|markov_head\.markov_w2|confidence_head\.proj)\.weight"
_CANONICAL = re.compile(
    rf"(?:embed|head|norm)\.weight|hc_head_(?:fn|base|scale)"
    rf"|layers\.\d+\.(?:{_BLOCK})|mtp\.\d+\.(?:{_BLOCK}|{_MTP_ONLY}|{_DSPARK_ONLY})"
)

# transformers module names (DeepseekV4ForCausalLM.state_dict()) -> official, per layer.
_HF_LAYER = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hf}_hc.{p}": f"hc_{hf}_{p}" for hf in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
_HF_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    **{f"model.hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")},
}
_HF_ONLY = re.compile(
    r"model\.layers\.\d+\.(?:self_attn|mlp|input_layernorm|post_attention_layernorm|attn_hc|ffn_hc)\.")
_HF_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class TensorInfo:
    """Where one canonical tensor lives: a contiguous byte range of one safetensors file."""

    name: str
    file: Path
    stored_name: str  # the key in the file (for a fused HF expert tensor, the fused key)
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # stored shape
    offset: int  # absolute byte offset in `file`
    nbytes: int
    scale: TensorInfo | None = None
    format: str = "plain"  # "plain" | "fp8_block" | "mxfp4"


@dataclass(frozen=True)
class _Stored:
    """One tensor as its file's header describes it."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Checkpoint:
    """A DeepSeek-V4 checkpoint folder, read lazily under canonical (official) tensor names."""

    def __init__(self, directory: Path, files: list[Path], headers: list[bytes],
                 infos: dict[str, TensorInfo], scheme: str):
        self.directory = directory
        self.scheme = scheme  # "official" | "hf" | "save_pretrained"
        self._files = files
        self._headers = headers
        self._header_sha256 = {f: hashlib.sha256(h).hexdigest() for f, h in zip(files, headers)}
        self._infos = infos
        self._maps: dict[Path, np.memmap] = {}

    # ----------------------------------------------------------------- opening

    @classmethod
    def open(cls, directory: str | Path) -> Checkpoint:
        """Read every header (not the data), map names to canonical ones and validate.

        A checkpoint folder is untrusted: every file it names must stay inside it (checkpoint_file), and
        headers are checked before any tensor is (sizes, overlaps, truncation)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: checkpoint folder does not exist")
        files, index = _list_files(directory)
        stored: dict[str, _Stored] = {}
        headers = []
        for path in files:
            raw_header, tensors = _read_header(path)
            headers.append(raw_header)
            for t in tensors:
                if t.key in stored:
                    raise CheckpointError(f"{path}: tensor '{t.key}' is also in {stored[t.key].file.name}")
                stored[t.key] = t
        for key, file_name in (index or {}).items():
            if key not in stored or stored[key].file != directory / file_name:
                raise CheckpointError(f"{directory / file_name}: tensor '{key}' from the index is not in this file")
        scheme = _detect_scheme(stored)
        return cls(directory, files, headers, _canonical_infos(stored, scheme), scheme)

    # ----------------------------------------------------------------- queries

    def names(self) -> list[str]:
        """Canonical weight names in natural order (scales are attached to their weights)."""
        return sorted(self._infos, key=_natural_key)

    def files(self) -> list[Path]:
        return list(self._files)

    def has(self, name: str) -> bool:
        return name in self._infos

    __contains__ = has

    @property
    def draft_module(self) -> str | None:
        """What the checkpoint holds under `mtp.*`: "mtp" (V4's one-layer MTP draft, mtp.0 with its e_proj,
        h_proj, enorm and hnorm), "dspark" (the releases' DSpark drafter: mtp.0.main_proj, no MTP inputs), "other"
        (tensors of neither), or None (no draft tensors: transformers' save_pretrained drops them)."""
        draft = [name for name in self._infos if name.startswith("mtp.")]
        if not draft:
            return None
        if not all(_CANONICAL.fullmatch(n) for n in draft):
            return "other"
        if all(f"mtp.0.{part}.weight" in self._infos for part in _MTP_INPUTS):
            return "mtp" if all(n.startswith("mtp.0.") for n in draft) else "other"
        return "dspark" if "mtp.0.main_proj.weight" in self._infos else "other"

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing") from None

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """The dequantized shape: the stored one, except MXFP4 packs two values per byte."""
        info = self.info(name)
        if info.format == "mxfp4":
            return info.shape[:-1] + (info.shape[-1] * 2,)
        return info.shape

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Fail on the first tensor that the config needs but is missing or has another shape."""
        for name, shape in expected.items():
            info = self.info(name)
            actual = self.logical_shape(name)
            if actual != tuple(shape):
                raise CheckpointError(
                    f"{info.file}: tensor '{name}' has shape {list(actual)} "
                    f"but {list(shape)} is expected from config.json")

    def header_sha256(self, file: Path) -> str:
        """SHA-256 of one file's safetensors header: what an engine records of each checkpoint file it links."""
        return self._header_sha256[file]

    def fingerprint(self) -> str:
        """Identifies the checkpoint's layout (names, dtypes, shapes, headers) without reading data."""
        h = hashlib.sha256()
        for name in sorted(self._infos):
            info = self._infos[name]
            h.update(f"{name}\t{info.dtype}\t{list(info.shape)}\n".encode())
        for header in self._headers:
            h.update(header)
        return h.hexdigest()

    # ----------------------------------------------------------------- data

    def raw(self, name: str) -> np.ndarray:
        """The stored values as a read-only memmap view (FP8/E8M0 as uint8, BF16 as uint16)."""
        return self._raw(self.info(name))

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized tensor in `dtype`; integer tensors (tid2eid) come back as int64."""
        info = self.info(name)
        if info.format == "fp8_block":
            w = _decode(self._raw(info), info.dtype).float()
            s = _decode(self._raw(info.scale), info.scale.dtype).float()
            out, inp = info.shape
            s = s.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
            return (w * s).to(dtype)
        if info.format == "mxfp4":
            packed = torch.from_numpy(np.array(self._raw(info).view(np.uint8)))
            return decode_mxfp4(packed, _decode(self._raw(info.scale), info.scale.dtype).float()).to(dtype)
        if info.dtype in _INTEGER_DTYPES:
            return torch.from_numpy(np.array(self._raw(info), dtype=np.int64))
        return _decode(self._raw(info), info.dtype).to(dtype)

    def scale(self, name: str) -> torch.Tensor:
        """The float32 values of a quantized weight's scales (FP8: the 128x128 block grid; MXFP4: per 32 inputs)."""
        info = self.info(name)
        if info.scale is None:
            raise CheckpointError(f"{info.file}: tensor '{name}' is not quantized and has no scale")
        return _decode(self._raw(info.scale), info.scale.dtype).float()

    def raw_scale(self, name: str) -> np.ndarray:
        """A quantized weight's stored scale bytes, as raw() gives them (E8M0 as uint8)."""
        info = self.info(name)
        if info.scale is None:
            raise CheckpointError(f"{info.file}: tensor '{name}' is not quantized and has no scale")
        return self._raw(info.scale)

    def _raw(self, info: TensorInfo) -> np.ndarray:
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mm[info.offset:info.offset + info.nbytes].view(SAFETENSORS_DTYPES[info.dtype]).reshape(info.shape)


# --------------------------------------------------------------------- files and headers

def checkpoint_file(directory: Path, name: object, named_by: str) -> Path:
    """A file of the checkpoint folder, resolved; refused unless it stays inside the folder, or is a blob of a
    Hugging Face cache (a cache snapshot's files, and those of older `--local-dir` downloads, link there)."""
    pure = PurePosixPath(name) if isinstance(name, str) else None
    if pure is None or not name or pure.is_absolute() or ".." in pure.parts or "\0" in name or "\\" in name:
        raise CheckpointError(f"{named_by}: names {shown(name)}, which is not a file inside {directory}; refused")
    resolved = (directory / pure).resolve()
    if not (resolved.is_relative_to(directory.resolve()) or in_blob_store(resolved)):
        raise CheckpointError(f"{directory / pure}: leads outside the checkpoint folder (to {resolved}); refused")
    return resolved


def _list_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of the folder, plus the index's weight map when it is sharded."""
    index_path = directory / "model.safetensors.index.json"
    if os.path.lexists(index_path):
        checkpoint_file(directory, index_path.name, str(index_path))
        raw = read_json(index_path, CheckpointError, "not found")
        weight_map = JsonFields(raw, str(index_path), CheckpointError).get("weight_map", dict)
        for key, file_name in weight_map.items():
            checkpoint_file(directory, file_name, f"{index_path}: weight_map entry {shown(key, 60)}")
        names = sorted(set(weight_map.values()))
        if len(names) > MAX_SHARDS:
            raise CheckpointError(f"{index_path}: lists {len(names)} files, more than {MAX_SHARDS}; refused")
        files = [directory / f for f in names]
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {index_path.name} does not exist")
        return files, weight_map
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    if len(found) > 1:
        raise CheckpointError(f"{directory}: {len(found)} *.safetensors files but no model.safetensors.index.json")
    checkpoint_file(directory, found[0].name, str(found[0]))
    return found, None


def _read_header(path: Path) -> tuple[bytes, list[_Stored]]:
    """Parse and validate one safetensors header; returns its raw bytes and its tensors."""
    fd = open_regular(path, CheckpointError)
    try:
        header = read_header(fd)
    except HeaderError as e:
        raise CheckpointError(f"{path}: {e}") from None
    finally:
        os.close(fd)
    tensors = []
    for key, entry in header.entries.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not isinstance(dtype, str) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                     for d in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {shown(key, 60)} has a malformed header entry") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {shown(key, 60)} has unknown dtype {shown(dtype, 20)}")
        nbytes = math.prod(shape) * dtype_bytes(dtype)
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {shown(key, 60)} ({dtype} {list(shape)[:8]}) needs {nbytes} bytes "
                                  f"but spans {end - begin}")
        tensors.append(_Stored(key, path, dtype, shape, header.data_start + begin, nbytes))
    previous = None
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset):
        if t.offset + t.nbytes > header.file_bytes:
            raise CheckpointError(f"{path}: file is truncated; tensor {shown(t.key, 60)} ends past its "
                                  f"{header.file_bytes} bytes")
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise CheckpointError(f"{path}: tensors {shown(previous.key, 60)} and {shown(t.key, 60)} overlap in the "
                                  "file; refused")
        previous = t
    return header.raw, tensors


# --------------------------------------------------------------------- names

def _detect_scheme(stored: dict[str, _Stored]) -> str:
    """Which naming the keys use: official, hf (module names, state_dict) or save_pretrained (the mix)."""
    if "lm_head.weight" in stored or any(_HF_ONLY.match(k) for k in stored):
        return "hf"
    if any(k.startswith("model.") for k in stored):
        return "save_pretrained"
    return "official"


def _canonical_name(key: str, scheme: str) -> str | None:
    """The official name of a stored (non-scale) key, or None when it is no V4 tensor."""
    if scheme == "hf" and not key.startswith("mtp."):
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if key in _HF_TOP:
            key = _HF_TOP[key]
        elif m and m[2] in _HF_LAYER:
            key = f"layers.{m[1]}.{_HF_LAYER[m[2]]}"
        else:
            return None
    elif scheme == "save_pretrained":
        key = key.removeprefix("model.")
        key = {"embed_tokens.weight": "embed.weight"}.get(key, key)
        key = re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", key)
        key = re.sub(r"^(layers\.\d+)\.attn\.norm\.weight$", r"\1.attn.kv_norm.weight", key)
    return key if _CANONICAL.fullmatch(key) else None


def _canonical_infos(stored: dict[str, _Stored], scheme: str) -> dict[str, TensorInfo]:
    """Map stored tensors to canonical TensorInfos, attaching scales and splitting fused experts."""
    infos: dict[str, TensorInfo] = {}
    scales: dict[str, _Stored] = {}  # stored weight key -> its scale
    for key, t in stored.items():
        if key.endswith(".weight_scale_inv") and key.removesuffix("_scale_inv") in stored:
            scales[key.removesuffix("_scale_inv")] = t
        elif key.endswith(".scale") and key.removesuffix("scale") + "weight" in stored:
            scales[key.removesuffix("scale") + "weight"] = t
    scale_keys = {t.key for t in scales.values()}
    for key, t in stored.items():
        if key in scale_keys:
            continue
        fused = _HF_FUSED.fullmatch(key) if scheme == "hf" else None
        if fused:
            infos.update(_split_fused(t, fused[1], fused[2]))
            continue
        name = _canonical_name(key, scheme)
        if name is None and key.startswith("mtp."):      # a drafter of another kind (draft_module "other")
            name = key
        if name is None:
            raise CheckpointError(f"{t.file}: tensor {shown(key, 60)} is not a DeepSeek-V4 tensor")
        if name in infos:
            raise CheckpointError(f"{t.file}: tensors '{infos[name].stored_name}' and '{key}' both map to '{name}'")
        infos[name] = _with_scale(name, t, scales.get(key))
    return infos


def _split_fused(t: _Stored, layer: str, kind: str) -> dict[str, TensorInfo]:
    """Per-expert views of a fused HF expert tensor; each is a contiguous byte range."""
    if len(t.shape) != 3 or (kind == "gate_up_proj" and t.shape[1] % 2):
        raise CheckpointError(f"{t.file}: fused expert tensor '{t.key}' has unexpected shape {list(t.shape)}")
    if t.dtype in _FP8_DTYPES or t.dtype in _INTEGER_DTYPES:
        raise CheckpointError(f"{t.file}: fused expert tensor '{t.key}' is {t.dtype}; only float experts can be fused")
    n_experts, rows, cols = t.shape
    expert_bytes = t.nbytes // n_experts
    prefix = f"layers.{layer}.ffn.experts"
    if kind == "down_proj":
        parts = [("w2", 0, rows)]
    else:
        parts = [("w1", 0, rows // 2), ("w3", rows // 2, rows // 2)]
    row_bytes = cols * dtype_bytes(t.dtype)
    out = {}
    for e in range(n_experts):
        for w, first_row, n_rows in parts:
            name = f"{prefix}.{e}.{w}.weight"
            out[name] = TensorInfo(name, t.file, t.key, t.dtype, (n_rows, cols),
                                   t.offset + e * expert_bytes + first_row * row_bytes, n_rows * row_bytes)
    return out


def _with_scale(name: str, t: _Stored, scale: _Stored | None) -> TensorInfo:
    """Classify the weight's format from its dtype and its scale's dtype and shape."""
    info = TensorInfo(name, t.file, t.key, t.dtype, t.shape, t.offset, t.nbytes)
    if scale is None:
        if t.dtype in _FP8_DTYPES:
            raise CheckpointError(f"{t.file}: FP8 tensor '{t.key}' has no scale")
        return info
    scale_info = TensorInfo(name.removesuffix("weight") + "scale", scale.file, scale.key,
                            scale.dtype, scale.shape, scale.offset, scale.nbytes)
    if len(t.shape) == 2 and scale.dtype not in _INTEGER_DTYPES:
        out, inp = t.shape
        if t.dtype in _FP8_DTYPES and scale.shape == (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)):
            return replace(info, scale=scale_info, format="fp8_block")
        if (t.dtype in ("I8", "U8") and scale.dtype == "F8_E8M0"
                and inp * 2 % MXFP4_BLOCK == 0 and scale.shape == (out, inp * 2 // MXFP4_BLOCK)):
            return replace(info, scale=scale_info, format="mxfp4")
    raise CheckpointError(
        f"{t.file}: tensor '{t.key}' ({t.dtype} {list(t.shape)}) has scale '{scale.key}' "
        f"({scale.dtype} {list(scale.shape)}) that fits neither FP8 128x128 blocks nor MXFP4")


def _natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# --------------------------------------------------------------------- decoding

def _decode(raw: np.ndarray, dtype: str) -> torch.Tensor:
    """Float values of a stored float tensor (F16/F32/F64 keep their width; others float32)."""
    a = np.array(raw)  # copy out of the read-only memmap
    if dtype == "BF16":
        return torch.from_numpy((a.astype(np.uint32) << 16).view(np.float32))
    if dtype in _FP8_DTYPES:
        return torch.from_numpy(a).view(_FP8_DTYPES[dtype]).float()
    if dtype == "F8_E8M0":
        return torch.from_numpy(_e8m0_to_float32(a))
    return torch.from_numpy(a)


def _e8m0_to_float32(bits: np.ndarray) -> np.ndarray:
    """2^(e-127) by bit placement: e=0 is 2^-127 (a subnormal), e=255 is NaN; never a numeric cast."""
    bits = np.asarray(bits, dtype=np.uint8)
    out = bits.astype(np.uint32) << 23
    out[bits == 0] = 0x00400000
    out[bits == 0xFF] = 0x7FC00000
    return out.view(np.float32)


# --------------------------------------------------------------------- quantizers

def _e8m0_exponent(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Smallest power-of-two exponent k with amax / 2^k <= fmax, clamped to the E8M0 range."""
    mant, exp = torch.frexp(amax / fmax)  # amax/fmax = mant * 2^exp, mant in [0.5, 1)
    k = exp - (mant == 0.5).to(exp.dtype)
    k = torch.where(amax > 0, k, torch.zeros_like(k))
    return k.clamp(-127, 127)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [out, in] -> (float8_e4m3fn weight, float8_e8m0fnu scale [ceil(out/128), ceil(in/128)]).

    Scales are powers of two chosen so each block's max fits E4M3 (448); values round to
    nearest even. Both dtypes are written by safetensors as F8_E4M3 / F8_E8M0, like the
    official release; `.view(torch.uint8)` gives the bits.
    """
    w = w.float()
    out, inp = w.shape
    bo, bi = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    padded = torch.nn.functional.pad(w.abs(), (0, bi * FP8_BLOCK - inp, 0, bo * FP8_BLOCK - out))
    amax = padded.view(bo, FP8_BLOCK, bi, FP8_BLOCK).amax(dim=(1, 3))
    k = _e8m0_exponent(amax, _FP8_MAX)
    step = torch.ldexp(torch.ones_like(amax), k.float())
    step = step.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    q = (w / step).to(torch.float8_e4m3fn)
    return q, (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [out, in] -> (int8 packed [out, in/2], float8_e8m0fnu scale [out, in/32]).

    Per 1×32 block a power-of-two scale makes the max fit e2m1 (6); values round to the
    nearest e2m1 value, ties to the even code. Even input index goes in the low nibble.
    """
    w = w.float()
    out, inp = w.shape
    if inp % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {MXFP4_BLOCK}, got {inp}")
    blocks = w.view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    k = _e8m0_exponent(blocks.abs().amax(dim=-1), _E2M1_MAX)
    q = blocks / torch.ldexp(torch.ones_like(k, dtype=torch.float32), k.float()).unsqueeze(-1)
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:])])
    lo = torch.searchsorted(midpoints, q.abs(), right=False)
    hi = torch.searchsorted(midpoints, q.abs(), right=True)
    code = torch.where(lo % 2 == 0, lo, hi)  # lo != hi only on a tie: take the even code
    code = (code | ((q < 0) & (code > 0)).long() << 3).view(out, inp)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.to(torch.uint8).view(torch.int8), (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
