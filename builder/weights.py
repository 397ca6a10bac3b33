"""Attach weights to an exported graph without copying the checkpoint.

Every initializer of the exported graph is a checkpoint tensor (by its official name), a rope table, or a
StackedExperts weight [E, out, in], which is the experts' own tensors as [1, out, in] joined by one Concat.
- Where the checkpoint's bytes already are what the graph needs, the initializer is ONNX external data
  pointing into the checkpoint's own safetensors file (location, offset, length). Stored in another float
  type (bf16 weights, fp32 activations), it is referenced as stored and a Cast follows in the graph.
- FP8 e4m3 block weights stay FP8 and in place: a blocked DequantizeLinear (last axis, block 128) follows;
  its float32 scales (the 128x128 e8m0 grid, expanded along the output axis as ONNX blocked
  quantization wants) go to the converted-weights file.
- MXFP4 experts: for ONNX Runtime, which has no FP4 DequantizeLinear, dequantized into the converted file;
  for TensorRT FLOAT4E2M1 in place, their E8M0 scales in place too, 2^(e-127) computed in the graph, and a
  blocked DequantizeLinear (block 32). Each backend says which quantized formats it keeps (`quantized_in_place`);
  the others are dequantized into the converted file.
The engine folder reaches the checkpoint's files through `weights/`: hard links where the filesystem
allows (true zero copy, any consumer reads them), symlinks otherwise (the runtime hands those to ONNX
Runtime from memory maps, since ONNX Runtime refuses external data outside the model folder).
The converted file is written tensor by tensor, so peak memory does not grow with the checkpoint.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper, numpy_helper

from v4engine.runtime.config import V4Config
from v4engine.runtime.engine import WeightFile

from .checkpoint import FP8_BLOCK, MXFP4_BLOCK, Checkpoint, TensorInfo
from .export import rope_table

_ONNX_TYPE = {"F32": TensorProto.FLOAT, "F16": TensorProto.FLOAT16, "BF16": TensorProto.BFLOAT16,
              "F64": TensorProto.DOUBLE, "I64": TensorProto.INT64, "I32": TensorProto.INT32,
              "I16": TensorProto.INT16, "I8": TensorProto.INT8, "U8": TensorProto.UINT8, "BOOL": TensorProto.BOOL,
              "F8_E4M3": TensorProto.FLOAT8E4M3FN, "F8_E5M2": TensorProto.FLOAT8E5M2}
_TORCH_OF_ONNX = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
                  TensorProto.BFLOAT16: torch.bfloat16}
_BITS = {2: torch.int16, 4: torch.int32}          # reinterpret floats as bits numpy can hold (bf16 has no numpy type)
CONVERTED = "weights/converted.bin"
ALIGN = 64


def _external(name: str, onnx_type: int, shape: tuple[int, ...], location: str, offset: int, length: int
              ) -> TensorProto:
    """An initializer whose bytes are `length` bytes at `offset` of `location` (relative to the engine folder)."""
    tensor = TensorProto()
    tensor.name, tensor.data_type = name, onnx_type
    tensor.dims.extend(shape)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


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

    def convert(self, array: np.ndarray) -> tuple[str, int, int]:
        """Append one converted tensor; returns (location, offset, length)."""
        pad = -self._offset % ALIGN
        self._converted.write(b"\0" * pad)
        self._offset += pad
        data = np.ascontiguousarray(array).tobytes()
        self._converted.write(data)
        self._converted.flush()
        start, self._offset = self._offset, self._offset + len(data)
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
TREATMENTS = ("in place", "in place + cast", "fp8 in place + dequantize", "fp4 in place + dequantize", "converted",
              "inline")


class _Attacher:
    """Builds, for one graph, the initializers and nodes that give each weight its bytes, counting treatments."""

    def __init__(self, ckpt: Checkpoint, writer: WeightWriter, quantized_in_place: frozenset[str]):
        self.ckpt, self.writer, self.in_place = ckpt, writer, quantized_in_place
        self.initializers: list[TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.counts = dict.fromkeys(TREATMENTS, 0)
        self._e8m0_constants = False

    def tensor(self, out: str, info: TensorInfo, shape: tuple[int, ...], data_type: int) -> None:
        """`out` (of `shape` and `data_type`) from the checkpoint tensor `info` (same values, maybe a leading 1)."""
        if info.format != "plain" and info.format not in self.in_place:    # dequantized by the builder
            values = self.ckpt.load(info.name, dtype=_TORCH_OF_ONNX[data_type]).reshape(shape)
            self.initializers.append(_external(out, data_type, shape,
                                               *self.writer.convert(values.view(_BITS[values.element_size()]).numpy())))
            self.counts["converted"] += 1
            return
        location = self.writer.link(info.file, self.ckpt.header_sha256(info.file))
        if info.format == "plain":
            stored = _ONNX_TYPE[info.dtype]
            name_as_stored = out if stored == data_type else f"{out}.stored"
            self.initializers.append(_external(name_as_stored, stored, shape, location, info.offset, info.nbytes))
            self._cast(name_as_stored, out, data_type, "in place")
        elif info.format == "fp8_block":
            rows = fp8_scale_rows(self.ckpt, info)
            scale = _external(f"{out}.scale", TensorProto.FLOAT, shape[:-1] + rows.shape[-1:],
                              *self.writer.convert(rows))
            q = _external(f"{out}.fp8", _ONNX_TYPE[info.dtype], shape, location, info.offset, info.nbytes)
            self.initializers += [q, scale]
            self._dequantize(q.name, scale.name, out, len(shape) - 1, FP8_BLOCK, data_type, "fp8 in place + dequantize")
        else:   # mxfp4: e2m1 codes as FLOAT4E2M1 (low nibble first, as ONNX packs them)
            q = _external(f"{out}.fp4", TensorProto.FLOAT4E2M1, shape, location, info.offset, info.nbytes)
            scale = self._e8m0_scale(f"{out}.scale", info.scale, shape[:-1] + (shape[-1] // MXFP4_BLOCK,))
            self.initializers.append(q)
            self._dequantize(q.name, scale, out, len(shape) - 1, MXFP4_BLOCK, data_type, "fp4 in place + dequantize")

    def stacked(self, out: str, infos: list[TensorInfo], shape: tuple[int, ...], data_type: int) -> None:
        """A StackedExperts weight [E, ...]: each expert's tensor as [1, ...], then one Concat."""
        parts = [f"{out}.{e}" for e in range(len(infos))]
        for part, info in zip(parts, infos):
            self.tensor(part, info, (1,) + shape[1:], data_type)
        self.nodes.append(helper.make_node("Concat", parts, [out], axis=0))

    def inline(self, tensor: TensorProto) -> None:
        self.initializers.append(tensor)
        self.counts["inline"] += 1

    def _cast(self, source: str, out: str, data_type: int, treatment: str) -> None:
        if source != out:
            self.nodes.append(helper.make_node("Cast", [source], [out], to=data_type))
            treatment = "in place + cast" if treatment == "in place" else treatment
        self.counts[treatment] += 1

    def _dequantize(self, q: str, scale: str, out: str, axis: int, block: int, data_type: int, treatment: str
                    ) -> None:
        dq_out = out if data_type == TensorProto.FLOAT else f"{out}.dq"
        self.nodes.append(helper.make_node("DequantizeLinear", [q, scale], [dq_out], axis=axis, block_size=block))
        self._cast(dq_out, out, data_type, treatment)

    def _e8m0_scale(self, out: str, info: TensorInfo, shape: tuple[int, ...]) -> str:
        """2^(e-127) computed in the graph from the stored E8M0 bytes (in place): opset 23 has no E8M0 scales.
        Exact for every exponent a weight uses; the codes' edges differ from Checkpoint.load (e = 255, E8M0's NaN,
        gives inf here; e = 0 gives the subnormal 2^-127, which hardware that flushes subnormals reads as 0)."""
        if not self._e8m0_constants:
            self.initializers += [numpy_helper.from_array(np.array(2.0, np.float32), "v4.two"),
                                  numpy_helper.from_array(np.array(127.0, np.float32), "v4.e8m0_bias")]
            self._e8m0_constants = True
        location = self.writer.link(info.file, self.ckpt.header_sha256(info.file))
        self.initializers.append(_external(f"{out}.e8m0", TensorProto.UINT8, shape, location, info.offset, info.nbytes))
        self.nodes += [helper.make_node("Cast", [f"{out}.e8m0"], [f"{out}.exp"], to=TensorProto.FLOAT),
                       helper.make_node("Sub", [f"{out}.exp", "v4.e8m0_bias"], [f"{out}.unbiased"]),
                       helper.make_node("Pow", ["v4.two", f"{out}.unbiased"], [out])]
        return out


def attach_weights(proto: onnx.ModelProto, ckpt: Checkpoint, cfg: V4Config, writer: WeightWriter,
                   quantized_in_place: frozenset[str], prefix: str = "model.") -> dict[str, int]:
    """Give every initializer its bytes (see module doc). Returns counts per treatment.

    quantized_in_place: the quantized formats ("fp8_block", "mxfp4") the backend keeps quantized in place behind a
    blocked DequantizeLinear; weights of the other formats are dequantized into the converted file (ONNX Runtime
    has no FP4 kernel; MIGraphX reads no FLOAT8E4M3FN and no blocked DequantizeLinear at its opset)."""
    graph = proto.graph
    attach = _Attacher(ckpt, writer, quantized_in_place)
    for tensor in graph.initializer:
        name = tensor.name.removeprefix(prefix)
        table = rope_table(cfg, name)
        shape = tuple(tensor.dims)
        experts = stacked_expert_names(name, cfg.n_routed_experts)
        if table is not None:
            attach.inline(numpy_helper.from_array(table.numpy(), tensor.name))
        elif experts is not None:
            attach.stacked(tensor.name, [ckpt.info(e) for e in experts], shape, tensor.data_type)
        else:
            attach.tensor(tensor.name, ckpt.info(name), shape, tensor.data_type)
    del graph.initializer[:]
    graph.initializer.extend(attach.initializers)
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(attach.nodes + old)
    return attach.counts
