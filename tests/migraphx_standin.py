"""A stand-in for MIGraphX's Python module, for machines without ROCm: the documented semantics our session relies
on, executed by ONNX Runtime on the CPU.

What it holds to, as MIGraphX does (ROCm 6.4-7.2, src/py/migraphx_py.cpp, src/program.cpp):
- `parse_onnx_buffer(bytes, map_input_dims=...)` fixes every input's shape; a graph input left dynamic is refused;
- `compile(target, offload_copy=False)`: the outputs become parameters `main:#output_N` (`main:#output_:000NN`
  from 10 on), which the caller must pass, at their exact shapes, and which the program writes in place;
- `run_async(params, stream, "ihipStream_t")`: every parameter present, each `argument_from_pointer` of exactly
  the compiled shape (type, lens), read and written at its address; nothing is copied for the caller; no
  argument of bf16 or fp8 (the bindings read each back as a Python buffer, which has neither).
Programs go to disk and back through `save`/`load`. The "device" is host memory: the session runs with torch CPU
tensors standing for the GPU's.
"""
from __future__ import annotations

import ctypes
import math
import pickle
from functools import cache

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

TYPES = {"float_type": np.float32, "half_type": np.float16, "bf16_type": ml_dtypes.bfloat16,
         "double_type": np.float64, "int64_type": np.int64, "int32_type": np.int32, "int8_type": np.int8,
         "uint8_type": np.uint8, "bool_type": np.bool_}
ONNX_TYPES = {1: "float_type", 10: "half_type", 16: "bf16_type", 11: "double_type", 7: "int64_type",
              6: "int32_type", 3: "int8_type", 2: "uint8_type", 9: "bool_type"}

runs: list[str] = []          # the parameters of every run_async, in order (what a test may look at)


class shape:                  # noqa: N801 (MIGraphX's spelling)
    def __init__(self, type: str = "float_type", lens: list[int] | tuple[int, ...] = (1,)):
        if type not in TYPES:
            raise RuntimeError(f"MIGRAPHX: unknown type {type}")
        self._type, self._lens = type, tuple(int(d) for d in lens)

    def lens(self) -> list[int]:
        return list(self._lens)

    def type_string(self) -> str:
        return self._type

    def __eq__(self, other: object) -> bool:
        return isinstance(other, shape) and (self._type, self._lens) == (other._type, other._lens)

    def __repr__(self) -> str:
        return f"{self._type}, {list(self._lens)}"


class argument:               # noqa: N801
    def __init__(self, s: shape, address: int):
        self.shape, self.address = s, address

    def array(self) -> np.ndarray:
        dtype, count = np.dtype(TYPES[self.shape.type_string()]), math.prod(self.shape.lens())
        buffer = (ctypes.c_char * max(1, count * dtype.itemsize)).from_address(self.address)
        return np.frombuffer(buffer, dtype, count=count).reshape(self.shape.lens())


def argument_from_pointer(s: shape, address: int) -> argument:
    return argument(s, int(address))


def get_target(name: str) -> str:
    assert name == "gpu"
    return name


@cache
def _session(model: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _output_name(i: int) -> str:
    return f"main:#output_{i}" if i < 10 else f"main:#output_:{i:05d}"


class program:                # noqa: N801
    def __init__(self, model: bytes, inputs: dict[str, shape], outputs: list[shape] | None = None):
        self.model, self.inputs, self.outputs = model, inputs, outputs

    def compile(self, target: str, offload_copy: bool = True, fast_math: bool = True) -> None:
        assert target == "gpu" and offload_copy is False, "our programs take device buffers: offload_copy=False"
        session = _session(self.model)           # the static output shapes: one run at the compiled input shapes
        feeds = {name: np.zeros(s.lens(), TYPES[s.type_string()]) for name, s in self.inputs.items()}
        self.outputs = [shape(ONNX_TYPES[o.type.tensor_type.elem_type], r.shape) for o, r in
                        zip(onnx.load_from_string(self.model).graph.output, session.run(None, feeds))]

    def get_parameter_shapes(self) -> dict[str, shape]:
        assert self.outputs is not None, "not compiled"
        return self.inputs | {_output_name(i): s for i, s in enumerate(self.outputs)}

    def run_async(self, params: dict[str, argument], stream: int, stream_name: str) -> list[argument]:
        if stream_name != "ihipStream_t":
            raise RuntimeError("any_ptr: type mismatch")
        runs.append(",".join(sorted(params)))
        for name, value in params.items():          # each argument is read back as a Python buffer: none of bf16
            if value.shape.type_string() in ("bf16_type", "fp8e4m3fn_type"):
                raise RuntimeError("MIGRAPHX PYTHON: Unsupported data type. For fp8 and bf16 literals try using "
                                   "migraphx.generate_argument with a corresponding shape")
        for name, s in self.get_parameter_shapes().items():
            if name not in params:
                raise RuntimeError(f"Parameter not found: {name}")
            if params[name].shape != s:
                raise RuntimeError(f"Incorrect shape {params[name].shape} for parameter: {name} should be: {s}")
        results = _session(self.model).run(None, {name: params[name].array() for name in self.inputs})
        written = [params[_output_name(i)] for i in range(len(results))]
        for target, value in zip(written, results):
            np.copyto(target.array(), value.astype(TYPES[target.shape.type_string()]))
        return written


def parse_onnx_buffer(data: bytes, map_input_dims: dict[str, list[int]] | None = None) -> program:
    model = onnx.load_from_string(data)
    assert not model.graph.initializer or all(t.data_location != onnx.TensorProto.EXTERNAL
                                              for t in model.graph.initializer), "weights must be parameters"
    inputs = {}
    for value in model.graph.input:
        dims = (map_input_dims or {}).get(value.name) or [d.dim_value if d.HasField("dim_value") else None
                                                          for d in value.type.tensor_type.shape.dim]
        if any(d is None for d in dims):
            raise RuntimeError(f"{value.name}: dynamic input without map_input_dims (only static shapes here)")
        inputs[value.name] = shape(ONNX_TYPES[value.type.tensor_type.elem_type], dims)
    return program(data, inputs)


def save(p: program, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump((p.model, p.inputs, p.outputs), f)


def load(path: str) -> program:
    with open(path, "rb") as f:
        return program(*pickle.load(f))
