"""MIGraphX session over one graph of an engine directory, on an AMD GPU under ROCm.

Two ways to run a MIGraphX engine, chosen by what is installed:
- the `migraphx` Python module: the programs the build (or compile_migraphx.sh) compiled, one per bucket of static
  shapes (contract/buckets.py: MIGraphX's releases compile and run our graphs only at static shapes), listed in
  engine.json; each call is padded up to the smallest bucket covering it and runs that bucket's program;
- ONNX Runtime's MIGraphX execution provider (onnxruntime-migraphx): the MIGraphX variant graph, which ONNX
  Runtime hands to MIGraphX (nodes MIGraphX cannot take fall back to the CPU). Its releases keep one compiled
  program per graph and compile again whenever a call's shapes change, so it suits a fixed batch, not decoding.

The programs were compiled with offload_copy off and with the weights the graph reads from the engine's weight
files as parameters (builder/backends/migraphx.py), so that every tensor they touch is ours, on the GPU, passed
by address (`argument_from_pointer`), never copied by MIGraphX:
- the weights, read once from the engine's weight files (through the engine folder's checks) into torch tensors
  on the GPU, shared by all the buckets' programs (a program holding its own weights would hold the model once
  per bucket); bf16 ones as float32 (`parameter_type`);
- the cache pools, torch tensors on the GPU that the scheduler allocates at the buckets' pool sizes
  (`pool_shape`) and the pool writes in place (runtime/pool_arrays.py);
- the call's small inputs, copied to the GPU and padded there into buffers of the bucket's shape allocated once;
  the outputs, buffers of the bucket's shapes given as the program's output parameters (`main:#output_N`), cut
  back to the call's and copied out: the new rows stay on the GPU, the rest come to the host. Those buffers and a
  program's arguments over them are made on a bucket's first call (runtime/static_calls.py `StaticCalls`, which CUDA
  graphs run through too).
MIGraphX's Python bindings read every argument back as a Python buffer, which has no bf16 (nor fp8): a bf16
engine runs only through onnxruntime-migraphx. Programs are loaded on first use (each holds scratch memory on
the GPU), and checked then against the shapes and types this session passes.
The program runs on torch's current stream (`run_async`), so it follows the pools' writes and precedes the reads
of its outputs without a host wait. torch here is a ROCm build (its GPUs are torch.cuda's), of the same HIP
runtime as MIGraphX's.
Written to MIGraphX's documented Python API (ROCm 6.4 to 7.2); not yet run on ROCm (README, backends).
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from v4engine.contract.backend_options import MIGraphXSessionOptions, OnnxRuntimeSessionOptions
from v4engine.contract.backends import MIGraphXCompiled
from v4engine.contract.buckets import Bucket, call_dims, choose_bucket
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFolder, EngineFormatError, MappedWeights, read_graph
from v4engine.contract.errors import V4EngineError
from v4engine.contract.untrusted import shown

from ..pool_arrays import to_torch
from ..static_calls import StaticCalls
from . import EngineRunError, EngineSession, checked_outputs

PROVIDER = "MIGraphXExecutionProvider"
OUTPUT_PARAMETER = "#output_"        # MIGraphX names output buffers main:#output_0.. (main:#output_:00010 from 10)
SHAPE_TYPES = {"float32": "float_type", "float16": "half_type", "bfloat16": "bf16_type", "float64": "double_type",
               "int64": "int64_type", "int32": "int32_type", "int8": "int8_type", "uint8": "uint8_type",
               "bool": "bool_type"}          # torch dtype name -> migraphx.shape type


class MIGraphXUnavailable(V4EngineError):
    """Neither the migraphx module (with torch on a ROCm GPU) nor ONNX Runtime's MIGraphX provider is here."""


def _migraphx() -> Any | None:
    try:
        import migraphx
    except ImportError:
        return None
    return migraphx


def _gpu(device: int | None) -> tuple[Any, Any]:
    """(torch, the torch device the programs and their tensors live on): a ROCm GPU, `device` or the current one."""
    try:
        import torch
    except ImportError:
        raise MIGraphXUnavailable("MIGraphX's programs take their tensors from torch: install a ROCm build of torch "
                                  "beside the migraphx module") from None
    if not torch.cuda.is_available():
        raise MIGraphXUnavailable("MIGraphX's programs run on an AMD GPU, and torch sees none here")
    return torch, torch.device("cuda", torch.cuda.current_device() if device is None else device)


def weight_parameters(graph: Any) -> list[Any]:
    """The initializers of an ONNX graph whose bytes live in the engine's weight files: what the MIGraphX programs
    take as parameters (the build turns exactly these into graph inputs; small constants stay inside)."""
    from onnx import TensorProto

    return [t for t in graph.initializer if t.data_location == TensorProto.EXTERNAL]


def parameter_type(data_type: int) -> int:
    """The ONNX element type a weight parameter of `data_type` is declared and fed as. MIGraphX's Python bindings
    (up to ROCm 7.2.4) read every argument back as a Python buffer and take no bf16 one, so bf16 weights go as
    float32: they widen exactly, and the Cast the graph has after each (bf16 weights are kept in place + cast)
    then gives the activation type the same values it would have."""
    from onnx import TensorProto

    return TensorProto.FLOAT if data_type == TensorProto.BFLOAT16 else data_type


def _output_index(name: str) -> int:
    return int(name.rsplit(OUTPUT_PARAMETER, 1)[1].lstrip(":"))


class MIGraphXSession(EngineSession):
    def __init__(self, engine_dir: str | Path, manifest: EngineManifest, graph: str, device: int | None = None,
                 options: MIGraphXSessionOptions = MIGraphXSessionOptions(), alternating: bool = False):
        """`device`: the GPU (for the programs: the one current while they load, which they then run on; for
        ONNX Runtime's provider: its device_id). MIGraphX takes no session options; `alternating` means nothing on
        a GPU's streams."""
        folder = EngineFolder(engine_dir)
        entry = manifest.graphs[graph]
        self.graph, self.inputs, self.outputs = folder.directory / entry.file, entry.inputs, entry.outputs
        compiled = manifest.compiled
        assert isinstance(compiled, MIGraphXCompiled)       # EngineManifest.read reads it by the backend's record
        migraphx = _migraphx()
        self._onnxruntime = None
        if migraphx is not None and compiled.programs is not None:
            self._open_programs(folder, manifest, graph, migraphx, device)
            return
        import onnxruntime as ort

        if PROVIDER not in ort.get_available_providers():
            raise MIGraphXUnavailable(
                f"{folder.directory} is a MIGraphX engine: install MIGraphX's Python module (and run "
                "compile_migraphx.sh there) or onnxruntime-migraphx, on a ROCm machine")
        from .onnxruntime import OnnxRuntimeSession

        self._onnxruntime = OnnxRuntimeSession(engine_dir, manifest, graph, device=device,
                                               options=OnnxRuntimeSessionOptions((PROVIDER, "CPUExecutionProvider")))
        self.pool_device = self._onnxruntime.pool_device      # its pools on the GPU, bound through an IOBinding

    # ------------------------------------------------------------------ the programs
    def _open_programs(self, folder: EngineFolder, manifest: EngineManifest, graph: str, migraphx: Any,
                       device: int | None) -> None:
        compiled = manifest.compiled
        if any(spec.dtype == "bfloat16" for spec in (*self.inputs, *self.outputs)):
            raise MIGraphXUnavailable(f"{folder.directory}: a bf16 engine, and MIGraphX's Python bindings (up to ROCm "
                                      "7.2.4) take no bf16 buffers: build it with --dtype fp16 or fp32 for MIGraphX's "
                                      "programs, or run it through onnxruntime-migraphx")
        self._migraphx = migraphx
        self._torch, self._device = _gpu(device)
        self.pool_device = str(self._device)
        self._layout = manifest.layout_of(graph)
        self._buckets = compiled.buckets(graph, self.inputs)
        self.pool_shape = {n: v for n, v in self._buckets[0].dims.items() if n.startswith("pool_")}
        # Checked now, loaded on first use: each loaded program holds its own scratch memory on the GPU
        self._files = [folder.checked_path(program.file, f"build.compile.programs.{graph}[{i}].file", "compiled")
                       for i, program in enumerate(compiled.programs[graph])]
        self._programs: list[tuple[Any, list[str]] | None] = [None] * len(self._files)
        weights = folder.map_weights(manifest.weights)
        self._weights = self._resident_weights(folder, manifest.graphs[graph], weights)
        weights.release_pages()
        self._weight_arguments = {name: self._argument(tensor) for name, tensor in self._weights.items()}
        self._calls = StaticCalls(self._torch, self._device, self._buckets, self.inputs, self.outputs, self._layout,
                                  self._bind, self.on_device)

    def _program(self, index: int) -> tuple[Any, list[str]]:
        """Bucket `index`'s program and its output parameters, loaded on the session's GPU the first time."""
        if self._programs[index] is None:
            with self._on_device():          # a program belongs to the GPU current when it is loaded
                program = self._migraphx.load(str(self._files[index]))
            self._programs[index] = program, self._checked_parameters(program, self._buckets[index])
        return self._programs[index]

    def _on_device(self) -> Any:
        return self._torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()

    def _checked_parameters(self, program: Any, bucket: Any) -> list[str]:
        """The program's output parameters in output order, once its inputs, outputs and weights have the types and
        shapes this session passes (a program compiled for another shape than engine.json says is refused, not
        run on every call)."""
        shapes = program.get_parameter_shapes()
        outputs = sorted((name for name in shapes if OUTPUT_PARAMETER in name), key=_output_index)
        more = self._layout.emitted(bucket.dims["seq"])
        expected = [(spec.name, spec.dtype, bucket.shape(spec)) for spec in self.inputs]
        expected += [(name, spec.dtype, bucket.shape(spec, more)) for name, spec in zip(outputs, self.outputs)]
        expected += [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in self._weights.items()]
        for name, dtype, shape in expected:
            got = (shapes[name].type_string(), tuple(shapes[name].lens())) if name in shapes else None
            if got != (SHAPE_TYPES[dtype], shape) or len(outputs) != len(self.outputs):
                raise EngineFormatError(f"{self.graph}: the program for bucket {bucket.name} takes {shown(name)} as "
                                        f"{got} and has {len(outputs)} outputs, not {(SHAPE_TYPES[dtype], shape)} and "
                                        f"{len(self.outputs)}; compiled for another engine? refused")
        return outputs

    def _resident_weights(self, folder: EngineFolder, entry: Any, weights: MappedWeights) -> dict[str, Any]:
        """Every weight parameter, from its checked bytes in the engine's weight files to a tensor on the device."""
        from onnx import ModelProto, TensorProto, helper
        from onnx.external_data_helper import ExternalDataInfo

        proto = ModelProto.FromString(read_graph(folder, entry, weights))     # external data checked there
        resident = {}
        for tensor in weight_parameters(proto.graph):
            info = ExternalDataInfo(tensor)
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
            if info.length != int(np.prod(tensor.dims)) * dtype.itemsize:
                raise EngineFormatError(f"{self.graph}: tensor {shown(tensor.name)} has {info.length} bytes of "
                                        f"external data for shape {list(tensor.dims)} of {dtype}; refused")
            stored = weights.maps[info.location][info.offset or 0: (info.offset or 0) + info.length]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")             # read-only map: torch only copies it to the device
                value = to_torch(stored.view(dtype).reshape(tuple(tensor.dims))).to(self._device)
            if parameter_type(tensor.data_type) == TensorProto.FLOAT and tensor.data_type != TensorProto.FLOAT:
                value = value.float()
            resident[tensor.name] = value
        return resident

    def _argument(self, tensor: Any) -> Any:
        """A MIGraphX argument over a contiguous torch tensor's memory, by address (nothing copied)."""
        shape = self._migraphx.shape(type=SHAPE_TYPES[str(tensor.dtype).removeprefix("torch.")],
                                     lens=list(tensor.shape))
        return self._migraphx.argument_from_pointer(shape, tensor.data_ptr())

    def _bind(self, bucket: Bucket, number: int, inputs: dict[str, Any], outputs: dict[str, Any]) -> Any:
        """Bucket `bucket`'s program over the weights and these buffers, by address; returns what runs it."""
        program, output_parameters = self._program(self._buckets.index(bucket))
        arguments = dict(self._weight_arguments)
        arguments.update({name: self._argument(tensor) for name, tensor in inputs.items()})
        arguments.update({parameter: self._argument(outputs[spec.name])
                          for spec, parameter in zip(self.outputs, output_parameters)})

        def run() -> None:
            torch = self._torch
            stream = torch.cuda.current_stream(self._device).cuda_stream if self._device.type == "cuda" else 0
            try:
                with self._on_device():
                    program.run_async(arguments, stream, "ihipStream_t")
            except RuntimeError as e:
                raise EngineRunError(f"{self.graph}: MIGraphX failed on bucket {bucket.name}: "
                                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

        return run

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        if self._onnxruntime is not None:
            return self._onnxruntime.run(feeds)
        bucket = choose_bucket(self._buckets, call_dims(feeds, self.inputs))     # none: one line naming the call
        return checked_outputs(self, feeds, self._calls.run(feeds, bucket), self.graph)
