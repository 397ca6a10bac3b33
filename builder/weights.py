"""Attach weights to an exported graph without copying the checkpoint.

Every initializer of the exported graph is a checkpoint tensor (by its official name), or a rope table.
- Where the checkpoint's bytes already are what the graph needs, the initializer is ONNX external data
  pointing into the checkpoint's own safetensors file (location, offset, length). Stored in another float
  type (bf16 weights, fp32 activations), it is referenced as stored and a Cast follows in the graph.
- FP8 e4m3 block weights stay FP8 and in place: a blocked DequantizeLinear (axis 1, block 128) follows;
  its float32 scales (the 128x128 e8m0 grid, expanded along the output axis as ONNX blocked
  quantization wants) go to the converted-weights file.
- MXFP4 experts: ONNX Runtime has no FP4 DequantizeLinear, so they are dequantized into the converted file.
The engine folder reaches the checkpoint's files through `weights/`: hard links where the filesystem
allows (true zero copy, any consumer reads them), symlinks otherwise (the runtime hands those to ONNX
Runtime from memory maps, since ONNX Runtime refuses external data outside the model folder).
The converted file is written tensor by tensor, so peak memory does not grow with the checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper, numpy_helper

from v4engine.runtime.config import V4Config
from v4engine.runtime.engine import WeightFile

from .checkpoint import Checkpoint, TensorInfo
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
FP8_BLOCK = 128


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

    def link(self, source: Path) -> str:
        """Relative location of `source` inside the engine folder (a hard link, else a symlink)."""
        source = source.resolve()
        if source not in self.linked:
            rel = f"weights/{source.name}"
            target = self.engine_dir / rel
            try:
                os.link(source, target)
                kind = "hardlink"
            except OSError:
                os.symlink(source, target)
                kind = "symlink"
            self.linked[source] = WeightFile(rel, source.stat().st_size, kind, str(source))
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
    """The 128x128 block scale as float32 [out, ceil(in/128)]: one row per output row (blocked DQ on axis 1)."""
    grid = ckpt.scale(info.name).numpy()
    return np.repeat(grid, FP8_BLOCK, axis=0)[: info.shape[0]]


def attach_weights(proto: onnx.ModelProto, ckpt: Checkpoint, cfg: V4Config, writer: WeightWriter,
                   prefix: str = "model.") -> dict[str, int]:
    """Give every initializer its bytes (see module doc). Returns counts per treatment."""
    graph = proto.graph
    kept: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    counts = {"in place": 0, "in place + cast": 0, "fp8 in place + dequantize": 0, "converted": 0, "inline": 0}
    for tensor in graph.initializer:
        table = rope_table(cfg, tensor.name.removeprefix(prefix))
        if table is not None:
            kept.append(numpy_helper.from_array(table.numpy(), tensor.name))
            counts["inline"] += 1
            continue
        name = tensor.name.removeprefix(prefix)
        info = ckpt.info(name)
        shape = tuple(tensor.dims)
        if info.format == "plain":
            stored = _ONNX_TYPE[info.dtype]
            name_as_stored = tensor.name if stored == tensor.data_type else f"{tensor.name}.stored"
            kept.append(_external(name_as_stored, stored, shape, writer.link(info.file), info.offset, info.nbytes))
            if name_as_stored == tensor.name:
                counts["in place"] += 1
            else:
                nodes.append(helper.make_node("Cast", [name_as_stored], [tensor.name], to=tensor.data_type))
                counts["in place + cast"] += 1
        elif info.format == "fp8_block":
            q = _external(f"{tensor.name}.fp8", _ONNX_TYPE[info.dtype], shape, writer.link(info.file), info.offset,
                          info.nbytes)
            scale = _external(f"{tensor.name}.scale", TensorProto.FLOAT, (shape[0], -(-shape[1] // FP8_BLOCK)),
                              *writer.convert(fp8_scale_rows(ckpt, info)))
            dq_out = tensor.name if tensor.data_type == TensorProto.FLOAT else f"{tensor.name}.dq"
            nodes.append(helper.make_node("DequantizeLinear", [q.name, scale.name], [dq_out], axis=1,
                                          block_size=FP8_BLOCK))
            if dq_out != tensor.name:
                nodes.append(helper.make_node("Cast", [dq_out], [tensor.name], to=tensor.data_type))
            kept += [q, scale]
            counts["fp8 in place + dequantize"] += 1
        else:  # mxfp4: no FP4 DequantizeLinear on the CPU; dequantize into the converted file
            values = ckpt.load(name, dtype=_TORCH_OF_ONNX[tensor.data_type])
            kept.append(_external(tensor.name, tensor.data_type, shape,
                                  *writer.convert(values.view(_BITS[values.element_size()]).numpy())))
            counts["converted"] += 1
    del graph.initializer[:]
    graph.initializer.extend(kept)
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + old)
    return counts
