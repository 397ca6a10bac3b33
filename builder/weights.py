"""Attach weights to an exported graph without copying the checkpoint.

Every initializer of the exported graph is a checkpoint tensor (by its official name), a rope table, or a
StackedExperts weight [E, out, in], which is the experts' own tensors as [1, out, in] joined by one Concat.
- Where the checkpoint's bytes already are what the graph needs, the initializer is ONNX external data
  pointing into the checkpoint's own safetensors file (location, offset, length). Stored in another float
  type (bf16 weights, fp32 activations), it is referenced as stored and a Cast follows in the graph.
- FP8 e4m3 block weights stay FP8 and in place: a blocked DequantizeLinear (last axis, block 128) follows;
  its float32 scales (the 128x128 e8m0 grid, expanded along the output axis as ONNX blocked
  quantization wants) go to the converted-weights file.
- MXFP4 weights outside the experts: FLOAT4E2M1 in place, their E8M0 scales in place too, 2^(e-127) computed in
  the graph, and a blocked DequantizeLinear (block 32). E8M0 bytes are always typed int8 (TensorRT has no uint8
  tensors inside a network) and read back unsigned.
- Quantized routed experts take the form the backend's MoE reads (`Backend.expert_weights`):
  - INT8_CODES (ONNX Runtime, which has no FP4 kernel but an exact int8 MoE): the MXFP4 bytes stay in place and
    the graph widens them: each e2m1 code c becomes the uint8 128 + 2c through a table (int8_code_table), each
    scale 2^(e-128), stacked per layer; ONNX Runtime folds that at load, so the engine folder holds no copy of any
    expert (builder/backends/onnxruntime.py runs them);
  - STORED_BYTES (TensorRT, whose plugin dequantizes inside its kernel; MIGraphX): the bytes in place as int8,
    one Concat per layer (`…routed.w1.mxfp4` or `.fp8`), and their scales beside them (`….mxfp4_scale`: the E8M0
    bytes in place, int8, which the kernels decode as 2^(e-127); `….fp8_scale`: the rows of the 128x128 grid,
    converted to fp32);
  - PREPACKED (ONNX Runtime's CUDA provider, whose MoE kernels read one [E, ...] tensor per projection): each
    layer's experts written once, stacked, into the converted file in the layout its MoE takes, gate and up rows
    interleaved into fc1 (`prepacked_experts`): MXFP4 as QMoE's fp4 form (the e2m1 codes transposed to
    [E, in, out / 2], the E8M0 bytes [E, out, in / 32]), FP8 as their bytes [E, out, in] with float32 scale rows
    (the graph widens them on the device, per call), float experts in the activation dtype. The bytes keep their
    size: nothing is widened on the host, and the engine holds the experts once more on disk, not in memory;
  - STACKED: as any weight, then stacked [E, out, in] for the op's function.
  Each backend says which quantized formats it keeps (`quantized_in_place`); the others are dequantized into the
  converted file.
The engine folder reaches the checkpoint's files through `weights/`: hard links where the filesystem
allows (true zero copy, any consumer reads them), symlinks otherwise (the runtime hands those to ONNX
Runtime from memory maps, since ONNX Runtime refuses external data outside the model folder).
The converted file is written tensor by tensor, so peak memory does not grow with the checkpoint.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper, numpy_helper

from v4engine.contract.backends import INT8_CODES, PREPACKED, STORED_BYTES, Backend
from v4engine.contract.config import V4Config
from v4engine.contract.engine import WeightFile
from v4engine.plugins import DOMAIN
from v4engine.plugins.moe import NAME as ROUTED_EXPERTS
from v4engine.plugins.moe import PLUGIN_FUNCTIONS as EXPERT_FUNCTIONS
from v4engine.plugins.moe import QUANTIZED_FUNCTIONS

from .checkpoint import E2M1_VALUES, FP8_BLOCK, MXFP4_BLOCK, Checkpoint, TensorInfo
from .export import rope_table

_ONNX_TYPE = {"F32": TensorProto.FLOAT, "F16": TensorProto.FLOAT16, "BF16": TensorProto.BFLOAT16,
              "F64": TensorProto.DOUBLE, "I64": TensorProto.INT64, "I32": TensorProto.INT32,
              "I16": TensorProto.INT16, "I8": TensorProto.INT8, "U8": TensorProto.UINT8, "BOOL": TensorProto.BOOL,
              "F8_E4M3": TensorProto.FLOAT8E4M3FN, "F8_E5M2": TensorProto.FLOAT8E5M2}
_TORCH_OF_ONNX = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
                  TensorProto.BFLOAT16: torch.bfloat16}
ONNX_OF_TORCH = {**{t: o for o, t in _TORCH_OF_ONNX.items()}, torch.int64: TensorProto.INT64,
                 torch.int32: TensorProto.INT32}          # a model parameter's type as its exported initializer's
_BITS = {2: torch.int16, 4: torch.int32}          # reinterpret floats as bits numpy can hold (bf16 has no numpy type)
CONVERTED = "weights/converted.bin"
ALIGN = 64


def _external(name: str, onnx_type: int, shape: tuple[int, ...], location: str, offset: int, length: int
              ) -> TensorProto:
    """An initializer whose bytes are `length` bytes at `offset` of `location` (relative to the engine folder)."""
    external = ir.ExternalTensor(location, offset, length, ir.DataType(onnx_type), shape=ir.Shape(shape), name=name)
    return ir.serde.serialize_tensor(external)


class WeightWriter:
    """Links checkpoint files into `engine/weights/` and streams converted tensors into one file."""

    def __init__(self, engine_dir: Path):
        self.engine_dir = engine_dir
        (engine_dir / "weights").mkdir(parents=True, exist_ok=True)
        self.linked: dict[Path, WeightFile] = {}
        self._converted = open(engine_dir / CONVERTED, "wb")
        self._offset = 0

    def link(self, source: Path, header_sha256: str) -> str:
        """Relative location of `source` inside the engine folder (a hard link, else a symlink); the header's
        fingerprint goes into engine.json, so that the runtime reads only this file through the link."""
        source = source.resolve()
        if source not in self.linked:
            taken = {w.file for w in self.linked.values()} | {CONVERTED}     # shards of two folders may share a name
            rel, n = f"weights/{source.name}", 0
            while rel in taken:
                n += 1
                rel = f"weights/{n}-{source.name}"
            target = self.engine_dir / rel
            try:
                os.link(source, target)
                kind = "hardlink"
            except OSError:
                os.symlink(source, target)
                kind = "symlink"
            self.linked[source] = WeightFile(rel, source.stat().st_size, kind, str(source), header_sha256)
        return self.linked[source].file

    def convert(self, array: np.ndarray, align: bool = True) -> tuple[str, int, int]:
        """Append one converted tensor (at a multiple of ALIGN bytes unless not `align`: the next part of a tensor
        written in parts); returns (location, offset, length). An all-zero tensor becomes a hole in the file (a
        release layout without data stays sparse on disk; zeros when read)."""
        pad = -self._offset % ALIGN if align else 0
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        start = self._offset + pad
        if data.any():
            self._converted.seek(start)
            self._converted.write(data.tobytes())
        self._offset = start + len(data)
        self._converted.truncate(self._offset)        # (a hole at the end still counts in the file's size)
        self._converted.flush()
        return CONVERTED, start, len(data)

    def files(self) -> list[WeightFile]:
        """Every weight file so far (the converted one once it holds something)."""
        converted = [WeightFile(CONVERTED, self._offset, "converted")] if self._offset else []
        return list(self.linked.values()) + converted

    def close(self) -> list[WeightFile]:
        """Close the converted file (dropping it when empty); safe to call again."""
        if not self._converted.closed:
            self._converted.close()
            if not self._offset:
                (self.engine_dir / CONVERTED).unlink()
        return self.files()


def serialize_without_data(model: ir.Model) -> onnx.ModelProto:
    """The exported graph as a ModelProto; initializers keep name, type and shape, and get no data yet."""
    for value in model.graph.initializers.values():
        shape = ir.Shape([int(d) for d in value.shape])
        value.const_value = ir.ExternalTensor("unattached", 0, 0, value.dtype, shape=shape, name=value.name)
    return ir.serde.serialize_model(model)


def fp8_scale_rows(ckpt: Checkpoint, info: TensorInfo) -> np.ndarray:
    """The 128x128 block scale as float32 [out, ceil(in/128)]: one row per output row (blocked DQ on the last axis)."""
    grid = ckpt.scale(info.name).numpy()
    return np.repeat(grid, FP8_BLOCK, axis=0)[: info.shape[0]]


def stacked_expert_names(name: str, experts: int) -> list[str] | None:
    """The checkpoint tensors behind a StackedExperts weight (`layers.3.ffn.routed.w1` -> every
    `layers.3.ffn.experts.{e}.w1.weight`), or None for any other name."""
    match = _STACKED.fullmatch(name)
    if match is None:
        return None
    return [f"{match['ffn']}.experts.{e}.{match['w']}.weight" for e in range(experts)]


_STACKED = re.compile(r"(?P<ffn>.+\.ffn)\.routed\.(?P<w>w[123])")
TREATMENTS = ("in place", "in place + cast", "in place, gathered rows cast", "fp8 in place + dequantize",
              "fp4 in place + dequantize", "fp4 in place + int8 codes", "fp8 in place, bytes for the kernel",
              "fp4 in place, bytes for the kernel", "fp4 prepacked", "fp8 prepacked", "prepacked", "converted",
              "inline")
STORED_FORMATS = {"fp8_block": "fp8", "mxfp4": "mxfp4"}       # checkpoint format -> the stored experts' value suffix


def int8_code_table() -> np.ndarray:
    """[65536, 4] uint8: for two packed bytes read as one little-endian uint16 (four e2m1 codes, lowest nibble
    first), each code c as 128 + 2c. With the scale 2^(e-128) and zero point 128 that is c * 2^(e-127) exactly: 2c
    is an integer in [-12, 12]. Four codes per index halve the int32 indices ONNX Runtime's Gather needs, which are
    the largest thing folded at load."""
    nibble = np.array([128 + (-2 if n & 8 else 2) * E2M1_VALUES[n & 7] for n in range(16)], np.uint8)
    pairs = np.arange(65536)
    return np.stack([nibble[(pairs >> shift) & 15] for shift in (0, 4, 8, 12)], axis=1)


def _interleaved(parts: list[np.ndarray]) -> np.ndarray:
    """[rows, ...] arrays of one expert (gate and up, or one) with their rows interleaved: fc1's layout under
    swiglu_fusion=1, gate first ([2 rows, ...]); one array as it is."""
    if len(parts) == 1:
        return parts[0]
    return np.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])


def _fp4_transposed(ckpt: Checkpoint, parts: list[TensorInfo]) -> np.ndarray:
    """One expert's MXFP4 weight (gate and up rows interleaved, or one) as QMoE's CUDA fp4 kernels take it:
    [rows, cols / 2] bytes packed along cols become [cols, rows / 2] packed along rows, low nibble first (the e2m1
    codes moved, never decoded)."""
    stored = _interleaved([ckpt.raw(info.name).view(np.uint8) for info in parts])     # [rows, cols / 2]
    if not stored.any():                              # (a release layout without data: zeros stay zeros)
        return np.zeros((stored.shape[1] * 2, stored.shape[0] // 2), np.uint8)
    codes = np.stack([stored & 15, stored >> 4], axis=-1).reshape(stored.shape[0], -1)   # [rows, cols]
    columns = np.ascontiguousarray(codes.T)                                              # [cols, rows]
    return (columns[:, 0::2] | (columns[:, 1::2] << 4)).astype(np.uint8)


@dataclass
class WeightGroup:
    """One group of weights (`weight_group`): bytes by format as the checkpoint stores them, and as the backend
    holds them once an engine is loaded (`resident_form`). engine.json records them per graph."""

    stored: dict[str, int] = field(default_factory=dict)
    resident: dict[str, int] = field(default_factory=dict)


def weight_group(name: str) -> str:
    """The group a checkpoint tensor belongs to: routed experts, shared experts, attention (with its compressor and
    indexer), embedding, head, MTP projections, or other (norms, mHC mixes, routers)."""
    for pattern, group in _GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


GATHERED_TABLES = re.compile(r"^embed\.weight$|\.gate\.tid2eid$")     # the checkpoint tensors graphs only index

_GROUPS = ((r"\.ffn\.experts\.", "routed experts"), (r"\.ffn\.shared_experts\.", "shared experts"),
           (r"\.attn\.", "attention"), (r"^embed\.", "embedding"), (r"^head\.", "head"),
           (r"\.(e_proj|h_proj)\.", "MTP projections"))


_ELEMENT_BYTES = {TensorProto.UINT8: 1, TensorProto.FLOAT8E4M3FN: 1, TensorProto.FLOAT8E8M0: 1, TensorProto.FLOAT: 4,
                  TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2}
_LOADED_TYPES = {TensorProto.FLOAT: ("float32", 4), TensorProto.FLOAT16: ("float16", 2),
                 TensorProto.BFLOAT16: ("bfloat16", 2), TensorProto.INT64: ("int64", 8),
                 TensorProto.INT32: ("int32", 4)}     # what a weight is made into at load, and its width


def group_bytes(info: TensorInfo) -> int:
    """A checkpoint tensor's bytes with its scales."""
    return info.nbytes + (info.scale.nbytes if info.scale else 0)


def resident_form(treatment: str, backend: Backend, stored: int, elements: int, data_type: int) -> tuple[str, int]:
    """What a weight of this treatment is once the engine is loaded: (form, bytes). In place: the checkpoint's own
    bytes, memory-mapped; cast or dequantized: the activation dtype, made at load (where the backend folds the
    DequantizeLinear of constants, `dequantizes_at_load`; elsewhere FP8 stays FP8); int8 codes: a byte per weight and
    an fp32 scale per 32."""
    dtype, size = _LOADED_TYPES.get(data_type, ("", 0))
    width = elements * size
    if treatment in ("in place", "in place, gathered rows cast", "fp4 in place + dequantize") or (
            treatment == "fp8 in place + dequantize" and not backend.dequantizes_at_load):
        return "as stored", stored
    if treatment == "fp4 in place + int8 codes":
        return "int8 codes + float32 scales, made at load", elements + elements // MXFP4_BLOCK * 4
    if treatment == "fp4 in place, bytes for the kernel":
        return "as stored", stored
    if treatment == "fp8 in place, bytes for the kernel":
        return "as stored + float32 scales", elements + -(-elements // FP8_BLOCK) * 4
    if treatment == "fp4 prepacked":
        return "as stored, prepacked at build", stored
    if treatment == "fp8 prepacked":
        return "as stored, prepacked at build + float32 scales; widened on the device per call", \
            elements + -(-elements // FP8_BLOCK) * 4
    if treatment in ("converted", "prepacked"):
        return f"{dtype}, memory-mapped from converted.bin", width
    return f"{dtype}, made at load", width


def tensor_treatment(info: TensorInfo, backend: Backend, data_type: int, gathered: bool) -> str:
    """How a checkpoint tensor (not a stacked routed expert) becomes a graph initializer of `data_type`: one of
    TREATMENTS. gathered: the graph only gathers its rows (an embedding)."""
    if info.format != "plain" and info.format not in backend.quantized_in_place:
        return "converted"
    if info.format == "plain":
        if _ONNX_TYPE[info.dtype] == data_type:
            return "in place"
        return "in place, gathered rows cast" if gathered else "in place + cast"
    return "fp8 in place + dequantize" if info.format == "fp8_block" else "fp4 in place + dequantize"


def expert_treatment(form: str, fmt: str) -> str:
    """The treatment of a layer's routed experts kept in `form` (expert_form: INT8_CODES, STORED_BYTES, PREPACKED)."""
    if form == PREPACKED:
        return {"mxfp4": "fp4 prepacked", "fp8_block": "fp8 prepacked"}.get(fmt, "prepacked")
    if form == INT8_CODES:
        return "fp4 in place + int8 codes"
    return "fp4 in place, bytes for the kernel" if fmt == "mxfp4" else "fp8 in place, bytes for the kernel"


class _Attacher:
    """Builds, for one graph, the initializers and nodes that give each weight its bytes, counting treatments."""

    def __init__(self, ckpt: Checkpoint, writer: WeightWriter, backend: Backend):
        self.ckpt, self.writer, self.backend = ckpt, writer, backend
        self.initializers: list[TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.counts = dict.fromkeys(TREATMENTS, 0)
        self.groups: dict[str, WeightGroup] = {}
        self.cast_rows: dict[str, tuple[str, int]] = {}     # gathered table -> (its stored initializer, row type)
        self._constants: set[str] = set()

    def tensor(self, out: str, info: TensorInfo, shape: tuple[int, ...], data_type: int, gathered: bool = False
               ) -> None:
        """`out` (of `shape` and `data_type`) from the checkpoint tensor `info` (same values, maybe a leading 1).
        gathered: the graph only gathers rows of `out` (an embedding); a plain tensor stored in another type then
        stays as stored and the gathered rows are cast (`cast_rows`), not the whole table."""
        treatment = tensor_treatment(info, self.backend, data_type, gathered)
        if treatment == "converted":                            # dequantized here
            values = self.ckpt.load(info.name, dtype=_TORCH_OF_ONNX[data_type]).reshape(shape)
            self.initializers.append(_external(out, data_type, shape,
                                               *self.writer.convert(values.view(_BITS[values.element_size()]).numpy())))
        elif treatment == "in place, gathered rows cast":
            self.cast_rows[out] = (self._in_place(f"{out}.stored", _ONNX_TYPE[info.dtype], shape, info), data_type)
        elif treatment in ("in place", "in place + cast"):
            stored = _ONNX_TYPE[info.dtype]
            self._cast(self._in_place(out if stored == data_type else f"{out}.stored", stored, shape, info), out,
                       data_type)
        elif treatment == "fp8 in place + dequantize":
            rows = fp8_scale_rows(self.ckpt, info)
            scale = _external(f"{out}.scale", TensorProto.FLOAT, shape[:-1] + rows.shape[-1:],
                              *self.writer.convert(rows))
            self.initializers.append(scale)
            q = self._in_place(f"{out}.fp8", _ONNX_TYPE[info.dtype], shape, info)
            self._dequantize(q, scale.name, out, len(shape) - 1, FP8_BLOCK, data_type)
        else:   # mxfp4: e2m1 codes as FLOAT4E2M1 (low nibble first, as ONNX packs them)
            q = self._in_place(f"{out}.fp4", TensorProto.FLOAT4E2M1, shape, info)
            scale = self._e8m0_scale(f"{out}.scale", info.scale, shape[:-1] + (shape[-1] // MXFP4_BLOCK,))
            self._dequantize(q, scale, out, len(shape) - 1, MXFP4_BLOCK, data_type)
        self._account(treatment, [info], math.prod(shape), data_type)

    def stacked(self, out: str, infos: list[TensorInfo], shape: tuple[int, ...], data_type: int) -> None:
        """A StackedExperts weight [E, ...]: each expert's tensor as [1, ...], then one Concat."""
        parts = [f"{out}.{e}" for e in range(len(infos))]
        for part, info in zip(parts, infos):
            self.tensor(part, info, (1,) + shape[1:], data_type)
        self.nodes.append(helper.make_node("Concat", parts, [out], axis=0))

    def stored_bytes(self, out: str, infos: list[TensorInfo], shape: tuple[int, ...]) -> None:
        """Quantized experts [E, rows, cols] as their stored bytes, int8 `out.{fp8|mxfp4}` [E, rows, stored cols],
        and their scales `out.{fp8|mxfp4}_scale` [E, rows, blocks] (MXFP4: the E8M0 bytes, int8; FP8: fp32 rows of
        the grid): the bytes in place, one Concat each."""
        fmt = infos[0].format
        suffix, (rows, cols) = STORED_FORMATS[fmt], shape[1:]
        packed, scales = [f"{out}.{e}.{suffix}" for e in range(len(infos))], []
        for name, info in zip(packed, infos):
            self._in_place(name, TensorProto.INT8, (1, rows, cols // 2 if fmt == "mxfp4" else cols), info)
            if fmt == "mxfp4":
                scales.append(self._e8m0(f"{name}.e8m0", (1, rows, cols // MXFP4_BLOCK), info.scale))
            else:
                grid = fp8_scale_rows(self.ckpt, info)[None]
                self.initializers.append(_external(f"{name}.scale", TensorProto.FLOAT, grid.shape,
                                                   *self.writer.convert(grid)))
                scales.append(f"{name}.scale")
        self.nodes += [helper.make_node("Concat", packed, [f"{out}.{suffix}"], axis=0),
                       helper.make_node("Concat", scales, [f"{out}.{suffix}_scale"], axis=0)]
        self._account(expert_treatment(STORED_BYTES, fmt), infos, math.prod(shape), TensorProto.INT8)

    def int8_codes(self, out: str, experts: list[list[TensorInfo]], rows: int, cols: int) -> None:
        """MXFP4 experts as an exact int8 MoE's uint8 codes `out.codes` [E, rows, cols] (zero point 128) and fp32
        scales `out.scales` [E, rows, cols / 32], made in the graph from the stored bytes, layer-wide (a handful of
        nodes whatever the expert count). `experts`: one list of the E experts' tensors, or two (gate and up):
        ONNX Runtime's fc1 holds their rows interleaved, done here on the packed bytes, before they widen. The
        packed bytes are read two at a time, as UINT16 (int8_code_table)."""
        parts = []
        for part, infos in enumerate(experts):
            packed, exponents = [f"{out}.{part}.{e}.fp4" for e in range(len(infos))], []
            for name, info in zip(packed, infos):
                self._in_place(name, TensorProto.UINT16, (1, rows, cols // 4), info)
                exponents.append(self._e8m0(f"{name}.e8m0", (1, rows, cols // MXFP4_BLOCK), info.scale))
            self.nodes += [helper.make_node("Concat", packed, [f"{out}.{part}.fp4"], axis=0),
                           helper.make_node("Concat", exponents, [f"{out}.{part}.e8m0"], axis=0)]
            parts.append(f"{out}.{part}")
        experts_count, rows = len(experts[0]), rows * len(experts)
        fp4, e8m0 = (self._interleave([f"{p}.{kind}" for p in parts], f"{out}.{kind}", (experts_count, rows, width))
                     for kind, width in (("fp4", cols // 4), ("e8m0", cols // MXFP4_BLOCK)))
        self._constant("v4.e2m1_int8", int8_code_table())
        codes_shape = self._constant(f"v4.shape_{experts_count}x{rows}x{cols}",
                                     np.array([experts_count, rows, cols], np.int64))
        self.nodes += [helper.make_node("Cast", [fp4], [f"{out}.bytes"], to=TensorProto.INT32),
                       helper.make_node("Gather", ["v4.e2m1_int8", f"{out}.bytes"], [f"{out}.pairs"]),
                       helper.make_node("Reshape", [f"{out}.pairs", codes_shape], [f"{out}.codes"])]
        self._powers_of_two(e8m0, f"{out}.scales", bias=128.0)
        everything = [info for infos in experts for info in infos]
        self._account(expert_treatment(INT8_CODES, "mxfp4"), everything,
                      len(everything) * rows * cols // len(experts), TensorProto.UINT8)

    def prepacked(self, out: str, experts: list[list[TensorInfo]], rows: int, cols: int, data_type: int) -> None:
        """A layer's experts as one tensor per projection in the converted file, in the layout ONNX Runtime's CUDA
        MoE takes (the module doc): `experts` one list of the E experts' tensors, or two (gate and up: fc1, their
        rows interleaved, gate first). Each [rows, cols] expert (rows doubled for fc1) becomes, by format:
        `out.fp4` uint8 [E, cols, rows / 2] (codes transposed, packed along rows, low nibble first) and `out.e8m0`
        [E, rows, cols / 32]; `out.fp8` [E, rows, cols] with `out.fp8_scale` float32 [E, rows, ceil(cols / 128)];
        else `out` itself in `data_type`. Written expert by expert: memory stays one expert's."""
        fmt, count, total = experts[0][0].format, len(experts[0]), rows * len(experts)
        if fmt == "mxfp4":
            self._stacked_file(f"{out}.fp4", TensorProto.UINT8, (count, cols, total // 2),
                               (_fp4_transposed(self.ckpt, [part[e] for part in experts]) for e in range(count)))
            self._stacked_file(f"{out}.e8m0", TensorProto.FLOAT8E8M0, (count, total, cols // MXFP4_BLOCK),
                                       (_interleaved([self.ckpt.raw_scale(part[e].name) for part in experts])
                                        for e in range(count)))
        elif fmt == "fp8_block":
            self._stacked_file(f"{out}.fp8", TensorProto.FLOAT8E4M3FN, (count, total, cols),
                                        (_interleaved([self.ckpt.raw(part[e].name) for part in experts])
                                         for e in range(count)))
            self._stacked_file(f"{out}.fp8_scale", TensorProto.FLOAT, (count, total, -(-cols // FP8_BLOCK)),
                                       (_interleaved([fp8_scale_rows(self.ckpt, part[e]) for part in experts])
                                        for e in range(count)))
        else:
            dtype = _TORCH_OF_ONNX[data_type]
            self._stacked_file(out, data_type, (count, total, cols), (_interleaved(
                [self.ckpt.load(part[e].name, dtype=dtype).view(_BITS[dtype.itemsize]).numpy() for part in experts])
                for e in range(count)))
        everything = [info for part in experts for info in part]
        self._account(expert_treatment(PREPACKED, fmt), everything, count * total * cols, data_type)

    def _stacked_file(self, name: str, data_type: int, shape: tuple[int, ...], parts) -> str:
        """An initializer `name` of `shape`: the arrays `parts` yields, one per leading index, written one after
        another into the converted file (all-zero ones as holes: a release layout without data stays sparse)."""
        offset = None
        for part in parts:
            location, start, _ = self.writer.convert(part, align=offset is None)
            offset = start if offset is None else offset
        length = math.prod(shape) * _ELEMENT_BYTES[data_type]
        self.initializers.append(_external(name, data_type, shape, CONVERTED, offset, length))
        return name

    def _interleave(self, values: list[str], out: str, shape: tuple[int, int, int]) -> str:
        """The rows of `values` ([E, rows / n, width] each) interleaved into `out` [E, rows, width]; one value is
        itself."""
        if len(values) == 1:
            return values[0]
        axis = self._constant("v4.axis_2", np.array([2], np.int64))
        rows_shape = self._constant("v4.shape_{}x{}x{}".format(*shape), np.array(shape, np.int64))
        self.nodes += [helper.make_node("Unsqueeze", [v, axis], [f"{v}.rows"]) for v in values]
        self.nodes += [helper.make_node("Concat", [f"{v}.rows" for v in values], [f"{out}.pairs"], axis=2),
                       helper.make_node("Reshape", [f"{out}.pairs", rows_shape], [out])]
        return out

    def inline(self, tensor: TensorProto) -> None:
        self.initializers.append(tensor)
        self.counts["inline"] += 1

    def _cast(self, source: str, out: str, data_type: int) -> None:
        """`out` as `source` cast to data_type (nothing when `out` is `source` itself)."""
        if source != out:
            self.nodes.append(helper.make_node("Cast", [source], [out], to=data_type))

    def _dequantize(self, q: str, scale: str, out: str, axis: int, block: int, data_type: int) -> None:
        dq_out = out if data_type == TensorProto.FLOAT else f"{out}.dq"
        self.nodes.append(helper.make_node("DequantizeLinear", [q, scale], [dq_out], axis=axis, block_size=block))
        self._cast(dq_out, out, data_type)

    def _account(self, treatment: str, infos: list[TensorInfo], elements: int, data_type: int) -> None:
        """Count a weight's treatment, and its bytes as stored and as the backend holds them, by weight group."""
        self.counts[treatment] += len(infos)
        group = self.groups.setdefault(weight_group(infos[0].name), WeightGroup())
        for info in infos:
            stored = info.format if info.format != "plain" else info.dtype.lower()
            group.stored[stored] = group.stored.get(stored, 0) + group_bytes(info)
        form, nbytes = resident_form(treatment, self.backend, sum(group_bytes(i) for i in infos), elements,
                                     data_type)
        group.resident[form] = group.resident.get(form, 0) + nbytes

    def _constant(self, name: str, value: np.ndarray) -> str:
        """A small inline initializer shared by the whole graph (added once); its name."""
        if name not in self._constants:
            self.initializers.append(numpy_helper.from_array(value, name))
            self._constants.add(name)
        return name

    def _in_place(self, name: str, data_type: int, shape: tuple[int, ...], info: TensorInfo) -> str:
        """An initializer `name` that is the checkpoint tensor `info`'s own bytes, as `data_type` of `shape`."""
        location = self.writer.link(info.file, self.ckpt.header_sha256(info.file))
        self.initializers.append(_external(name, data_type, shape, location, info.offset, info.nbytes))
        return name

    def _e8m0(self, name: str, shape: tuple[int, ...], info: TensorInfo) -> str:
        """A scale's stored E8M0 bytes in place, typed int8 (TensorRT takes uint8 tensors only as network inputs and
        outputs; every backend reads int8): _powers_of_two reads them back unsigned."""
        return self._in_place(name, TensorProto.INT8, shape, info)

    def _e8m0_scale(self, out: str, info: TensorInfo, shape: tuple[int, ...]) -> str:
        """The stored E8M0 bytes (in place) as the scales 2^(e-127) of a blocked DequantizeLinear."""
        return self._powers_of_two(self._e8m0(f"{out}.e8m0", shape, info), out, bias=127.0)

    def _powers_of_two(self, e8m0: str, out: str, bias: float) -> str:
        """2^(e-bias) computed in the graph from E8M0 bytes held as int8 (`_e8m0`: -128..-1 stand for 128..255):
        opset 23 has no E8M0 scales. Exact for every exponent a weight uses; the codes' edges differ from
        Checkpoint.load (e = 255, E8M0's NaN, gives inf here; e = 0 gives the subnormal 2^-127, which hardware that
        flushes subnormals reads as 0)."""
        two = self._constant("v4.two", np.array(2.0, np.float32))
        offset = self._constant(f"v4.e8m0_bias_{bias:g}", np.array(bias, np.float32))
        zero, wrap = (self._constant(f"v4.float_{v:g}", np.array(v, np.float32)) for v in (0.0, 256.0))
        self.nodes += [helper.make_node("Cast", [e8m0], [f"{out}.exp"], to=TensorProto.FLOAT),
                       helper.make_node("Less", [f"{out}.exp", zero], [f"{out}.wrapped_byte"]),
                       helper.make_node("Add", [f"{out}.exp", wrap], [f"{out}.byte_plus_256"]),
                       helper.make_node("Where", [f"{out}.wrapped_byte", f"{out}.byte_plus_256", f"{out}.exp"],
                                        [f"{out}.unsigned"]),
                       helper.make_node("Sub", [f"{out}.unsigned", offset], [f"{out}.unbiased"]),
                       helper.make_node("Pow", [two, f"{out}.unbiased"], [out])]
        return out


def _prepacked_experts(attach: _Attacher, ckpt: Checkpoint, name: str, experts: list[str], shape: tuple[int, ...],
                       data_type: int) -> None:
    """A layer's experts for ONNX Runtime's CUDA MoE: `…routed.fc1` (gate and up, from the w1 initializer; w3's
    adds nothing) and `…routed.w2` (builder/backends/onnxruntime_cuda.py reads them by these names)."""
    layer, weight = name.rsplit(".", 1)
    if weight == "w1":
        gate_up = [[ckpt.info(e) for e in experts], [ckpt.info(e.replace(".w1.", ".w3.")) for e in experts]]
        attach.prepacked(f"{layer}.fc1", gate_up, *shape[1:], data_type)
    elif weight == "w2":
        attach.prepacked(name, [[ckpt.info(e) for e in experts]], *shape[1:], data_type)


def _int8_experts(attach: _Attacher, ckpt: Checkpoint, name: str, experts: list[str], shape: tuple[int, ...]
                  ) -> None:
    """A layer's MXFP4 experts for ONNX Runtime's QMoE: `…routed.fc1` (gate and up, from the w1 initializer; w3's
    adds nothing) and `…routed.w2`, each as `.codes` and `.scales` (the rewrite in builder/backends/onnxruntime.py
    reads them by these names)."""
    layer, weight = name.rsplit(".", 1)
    if weight == "w1":
        gate_up = [[ckpt.info(e) for e in experts], [ckpt.info(e.replace(".w1.", ".w3.")) for e in experts]]
        attach.int8_codes(f"{layer}.fc1", gate_up, *shape[1:])
    elif weight == "w2":
        attach.int8_codes(name, [[ckpt.info(e) for e in experts]], *shape[1:])


def expert_form(backend: Backend, fmt: str) -> str | None:
    """The form the backend's MoE reads experts of checkpoint format `fmt` in (expert_weights), or None: stacked.
    INT8_CODES holds MXFP4 only (an integer code cannot hold e4m3 exactly) and needs the format kept in place;
    STORED_BYTES are plain int8 bytes, which any backend holds (MIGraphX, which reads no FP8 or FP4 type, too);
    PREPACKED takes every format."""
    if backend.expert_weights == PREPACKED:
        return PREPACKED
    if backend.expert_weights == STORED_BYTES and fmt in STORED_FORMATS:
        return STORED_BYTES
    if backend.expert_weights == INT8_CODES and fmt == "mxfp4" and "mxfp4" in backend.quantized_in_place:
        return INT8_CODES
    return None


EXPERT_OPS = {f.name for f in EXPERT_FUNCTIONS}


def use_stored_experts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Each v4::RoutedExperts node whose experts attach_weights gave as stored bytes (`…w1.fp8` or `….mxfp4` is
    made in the graph) becomes the op that takes them (Fp8RoutedExperts, Mxfp4RoutedExperts), in place; returns
    every routed-experts node, rewritten or not."""
    produced = {out for node in model.graph.node for out in node.output}
    found = []
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type not in EXPERT_OPS:
            continue
        found.append(node)
        if node.op_type != ROUTED_EXPERTS:                   # rewritten before (a prepared graph, prepared again)
            continue
        x, indices, weights, w1, w2, w3 = node.input
        fmt = next((f for f in STORED_FORMATS.values() if f"{w1}.{f}" in produced), None)
        if fmt is not None:
            node.op_type = QUANTIZED_FUNCTIONS[fmt].name
            del node.input[:]
            node.input.extend([x, indices, weights] + [f"{w}.{fmt}{part}" for w in (w1, w2, w3)
                                                       for part in ("", "_scale")])
    return found


def attach_weights(proto: onnx.ModelProto, ckpt: Checkpoint, cfg: V4Config, writer: WeightWriter, backend: Backend,
                   prefix: str = "model.") -> tuple[dict[str, int], dict[str, WeightGroup]]:
    """Give every initializer its bytes (see module doc), the backend's way: the quantized formats it keeps in
    place (`quantized_in_place`; the others are dequantized into the converted file) and the form of quantized
    experts (`expert_weights`). Returns counts per treatment and the bytes by weight group."""
    graph = proto.graph
    attach = _Attacher(ckpt, writer, backend)
    gathered = _gathered_only(graph)
    for tensor in graph.initializer:
        name = tensor.name.removeprefix(prefix)
        table = rope_table(cfg, name)
        shape = tuple(tensor.dims)
        experts = stacked_expert_names(name, cfg.n_routed_experts)
        if table is not None:
            attach.inline(numpy_helper.from_array(table.numpy(), tensor.name))
        elif experts is not None and (form := expert_form(backend, ckpt.info(experts[0]).format)) == INT8_CODES:
            _int8_experts(attach, ckpt, tensor.name, experts, shape)
        elif experts is not None and form == PREPACKED:
            _prepacked_experts(attach, ckpt, tensor.name, experts, shape, tensor.data_type)
        elif experts is not None and form == STORED_BYTES:
            attach.stored_bytes(tensor.name, [ckpt.info(e) for e in experts], shape)
        elif experts is not None:
            attach.stacked(tensor.name, [ckpt.info(e) for e in experts], shape, tensor.data_type)
        else:
            attach.tensor(tensor.name, ckpt.info(name), shape, tensor.data_type, tensor.name in gathered)
    del graph.initializer[:]
    graph.initializer.extend(attach.initializers)
    old = [new for node in graph.node for new in _rows_cast(node, attach.cast_rows)]
    del graph.node[:]
    graph.node.extend(attach.nodes + old)
    return attach.counts, attach.groups


def _gathered_only(graph: onnx.GraphProto) -> set[str]:
    """Initializers the graph reads only as the data of Gather nodes (the embedding, hash routing's tid2eid:
    GATHERED_TABLES, which builder/stages.py names without a graph)."""
    readers: dict[str, set[bool]] = {}
    for node in graph.node:
        for i, value in enumerate(node.input):
            readers.setdefault(value, set()).add(node.op_type == "Gather" and i == 0)
    return {t.name for t in graph.initializer if readers.get(t.name) == {True}}


def _rows_cast(node: onnx.NodeProto, cast_rows: dict[str, tuple[str, int]]) -> list[onnx.NodeProto]:
    """A Gather of a table kept as stored: the Gather of the stored table, then its rows cast; any other node as is."""
    if node.op_type != "Gather" or node.input[0] not in cast_rows:
        return [node]
    stored, data_type = cast_rows[node.input[0]]
    rows = f"{node.output[0]}.stored_rows"
    gather = onnx.NodeProto()
    gather.CopyFrom(node)
    gather.input[0], gather.output[0] = stored, rows
    return [gather, helper.make_node("Cast", [rows], [node.output[0]], to=data_type)]
