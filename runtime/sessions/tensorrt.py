"""TensorRT session over one serialized engine of an engine directory (`{graph}.plan`), on an NVIDIA GPU.

Device buffers are torch CUDA tensors. The cache pools live on the session's GPU (`pool_device`): the scheduler
allocates them there (runtime/pool_arrays.py) and each call gives TensorRT their addresses, so they never cross
PCIe; the rows a call produces (`new.*`) stay on the device, where the pool writes them. Per call: the small host
inputs (ids, positions, slots, block table, the draft's streams) are copied to the device, the tightest
optimization profile covering their shapes is made active (engine.json lists the profiles in the engine's
order), each input's shape and address are set, the outputs are allocated at the shapes TensorRT infers from
the inputs, the engine is enqueued on the session's stream, and the outputs other than new rows come back as
numpy arrays (bf16 as ml_dtypes' bfloat16), so fp32, fp16 and bf16 engines all run.

A stripped plan (engine.json `plans.{graph}.stripped`: built with STRIP_PLAN, the build's way since plans held every
weight) is refitted as it loads, from the graph's own weights: the graph's checked bytes go to TensorRT's ONNX
refitter (`OnnxParserRefitter.load_model_proto`, TensorRT 10.13+) and every initializer held in a weight file goes as
a pointer into the engine folder's checked memory maps of the checkpoint's own files (`load_initializer`), then
`refit_cuda_engine`; nothing is read through a path TensorRT opens itself, and no weight is copied on the host.
A refit that leaves any weight missing is refused in one line naming it. The plan holds one optimization profile
(`plan_profiles`); the calls' own profiles give the CUDA graphs' buckets.

The attention, indexer and compressor plugins run their ahead-of-time kernels (the builder marks those nodes
`aot=1`); the routed experts' plugin runs just in time (its kernels' torch launcher), so loading an engine with a
MoE needs the plugins registered in this process: `register_plugins` runs before every load.

CUDA graphs. An engine built with --cuda-graphs has graphs without control flow and names its verify and
draft-cycle profiles in engine.json (`cuda_graphs`): those calls are padded to buckets of static shapes and each
bucket's enqueue is recorded once by torch.cuda.graph and replayed after (contract/calls.py), as TensorRT's
guide describes: an execution context of its own per recorded bucket (its profile, shapes and addresses set once;
the contexts share one scratch allocation, ExecutionContextAllocationStrategy.USER_MANAGED, since one stream runs
them one at a time; the graphs share one memory pool for the same reason), outputs checked against the shapes
TensorRT infers, one enqueue on the call's own values before recording so that TensorRT's deferred shape work is
done outside the graph, recorded in thread-local mode (a pipeline's other stages may run meanwhile). Prefill
chunks longer than k + 1 run as before. Several contexts select the same profile, which TensorRT allows since 8.x
(not run here).
Written to TensorRT's documented Python API (10.x/11.x); not yet run against TensorRT (README, backends).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from v4engine.contract.backend_options import TensorRTSessionOptions
from v4engine.contract.backends import TensorRTCompiled
from v4engine.contract.buckets import Bucket
from v4engine.contract.calls import captured_buckets
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import EngineFolder, EngineFormatError, read_graph
from v4engine.contract.errors import V4EngineError
from v4engine.contract.profiles import choose_profile

from ..pool_arrays import to_numpy, to_torch
from ..static_calls import StaticCalls
from . import EngineSession


class TensorRTUnavailable(V4EngineError):
    """The engine needs TensorRT (and a CUDA GPU with torch), which this machine lacks."""


def _import_tensorrt() -> tuple[Any, Any]:
    try:
        import tensorrt as trt
        import torch
    except ImportError as e:
        raise TensorRTUnavailable(f"this engine runs on TensorRT, which cannot be imported here ({e}); install "
                                  "tensorrt 10.15+/11.x and a CUDA build of torch on a machine with an NVIDIA GPU"
                                  ) from None
    if not torch.cuda.is_available():
        raise TensorRTUnavailable("this engine runs on TensorRT, but torch sees no CUDA GPU here")
    from v4engine.plugins.tensorrt import register_plugins

    try:
        register_plugins()
    except ImportError as e:        # the plugins' kernels need Triton (and onnxscript): the MoE runs just in time
        raise TensorRTUnavailable(f"this engine's plugins cannot be registered here ({e}); install v4engine's "
                                  "kernels extra (pip install 'v4engine[kernels]': triton) beside TensorRT") from None
    return trt, torch


class TensorRTSession(EngineSession):
    def __init__(self, engine_dir: str | Path, manifest: EngineManifest, graph: str, device: int | None = None,
                 options: TensorRTSessionOptions = TensorRTSessionOptions(), alternating: bool = False):
        """`device`: the GPU (default: torch's current one). TensorRT takes no session options: an engine built
        --cuda-graphs always replays its recorded calls; `alternating` means nothing on a GPU's streams."""
        folder = EngineFolder(engine_dir)
        engine_dir = folder.directory
        trt, torch = _import_tensorrt()
        compiled = manifest.compiled
        assert isinstance(compiled, TensorRTCompiled)       # EngineManifest.read reads it by the backend's record
        if compiled.plans is None:
            raise EngineFormatError(f"{engine_dir}: the TensorRT engines were not built (--onnx-only); rebuild with "
                                    "v4build --backend tensorrt on a machine with TensorRT")
        self._torch, self._device = torch, torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.pool_device = str(self._device)
        self._profiles = compiled.in_plan(graph)
        built = compiled.plans[graph]
        data = folder.read_bytes(built.plan, f"build.compile.plans.{graph}.plan", "compiled")
        self._logger = trt.Logger(trt.Logger.WARNING)
        with torch.cuda.device(self._device):      # an engine lives on the device current when it is deserialized
            self._runtime = trt.Runtime(self._logger)
            self._engine = self._runtime.deserialize_cuda_engine(data)
            if self._engine is None:
                raise EngineFormatError(f"{engine_dir / built.plan}: TensorRT could not load this engine "
                                        "(built by another TensorRT version or for another GPU?)")
            if built.stripped:
                refit_from_weight_files(trt, self._engine, self._logger, folder, manifest, graph)
            self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream(self._device)
        self._active: int | None = None
        entry = manifest.graphs[graph]
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self._trt, self._plan, self._scratch = trt, engine_dir / built.plan, None
        self._captured: StaticCalls | None = None
        buckets = captured_buckets(compiled.profiles[graph], compiled.cuda_graphs, self.inputs)
        if buckets:                             # (a graph without a recorded profile runs as before)
            self._captured = StaticCalls(torch, self._device, buckets, self.inputs, self.outputs,
                                           manifest.layout_of(graph), self._capture, self.on_device)

    def _buffer(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A device tensor of `shape`; an empty one still gets one element, so its address is never null."""
        torch = self._torch
        storage = torch.empty(max(1, int(np.prod(shape))), dtype=getattr(torch, dtype), device=self._device)
        return storage[: int(np.prod(shape))].view(shape)

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        torch = self._torch
        bucket = self._captured.bucket_for(feeds) if self._captured is not None else None
        caller = torch.cuda.current_stream(self._device)        # the stream that wrote the pools
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):    # (a stage's worker thread too)
            self._stream.wait_stream(caller)                     # the pools' writes come first
            if bucket is not None:
                outputs = self._captured.run(feeds, bucket)
                self._stream.synchronize()                       # new rows are read on the caller's stream next
                return outputs
            index = choose_profile(self._profiles, {n: tuple(a.shape) for n, a in feeds.items()})
            if index != self._active:
                self._context.set_optimization_profile_async(index, self._stream.cuda_stream)
                self._active = index
            held = []
            for spec in self.inputs:
                value = feeds[spec.name]
                if isinstance(value, np.ndarray):      # a small host input: copied
                    tensor = self._buffer(value.shape, spec.dtype)
                    tensor.copy_(to_torch(np.ascontiguousarray(value)))
                else:                                  # a pool, on this device: used in place
                    tensor = value.to(self._device).contiguous()    # (a previous stage's streams: moved here)
                if not self._context.set_input_shape(spec.name, tuple(tensor.shape)):
                    raise V4EngineError(f"TensorRT refused shape {tuple(tensor.shape)} for input '{spec.name}'")
                self._context.set_tensor_address(spec.name, tensor.data_ptr())
                held.append(tensor)
            outputs = {}
            for spec in self.outputs:
                shape = tuple(self._context.get_tensor_shape(spec.name))
                outputs[spec.name] = self._buffer(shape, spec.dtype)
                self._context.set_tensor_address(spec.name, outputs[spec.name].data_ptr())
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise V4EngineError(f"TensorRT failed to run the engine on input_ids {feeds['input_ids'].shape}")
            self._stream.synchronize()
        return {name: t if self.on_device(name) else to_numpy(t) for name, t in outputs.items()}

    def _capture(self, bucket: Bucket, number: int, inputs: dict[str, Any], outputs: dict[str, Any]) -> Any:
        """Record one bucket's enqueue on its static buffers (the module doc says how); returns its replay."""
        trt, torch, stream = self._trt, self._torch, self._stream.cuda_stream
        if self._scratch is None:       # shared by every recorded context and graph: they run one at a time
            self._scratch = torch.empty(max(1, self._engine.device_memory_size_v2), dtype=torch.uint8,
                                        device=self._device)
            self._graph_pool = torch.cuda.graph_pool_handle()
        context = self._engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        context.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
        shapes = {name: tuple(tensor.shape) for name, tensor in inputs.items()}
        index = choose_profile(self._profiles, shapes)   # the plan's profile holding the bucket's shapes
        if not context.set_optimization_profile_async(index, stream):
            raise V4EngineError(f"TensorRT refused profile {self._profiles[index].name} for bucket {bucket.name}")
        for name, tensor in inputs.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise V4EngineError(f"TensorRT refused shape {tuple(tensor.shape)} for input '{name}' of bucket "
                                    f"{bucket.name}")
        for name, tensor in outputs.items():             # what TensorRT writes must fit what was allocated
            if tuple(context.get_tensor_shape(name)) != tuple(tensor.shape):
                raise EngineFormatError(f"{self._plan}: output '{name}' of bucket {bucket.name} has shape "
                                        f"{tuple(context.get_tensor_shape(name))} in this engine, not "
                                        f"{tuple(tensor.shape)} as engine.json says; refused")
        for name, tensor in (inputs | outputs).items():
            context.set_tensor_address(name, tensor.data_ptr())
        if not context.execute_async_v3(stream):         # once outside: TensorRT's deferred work is not recorded
            raise V4EngineError(f"TensorRT failed to run bucket {bucket.name} before recording it")
        self._stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._stream, capture_error_mode="thread_local"):
            if not context.execute_async_v3(stream):
                raise V4EngineError(f"TensorRT failed to record bucket {bucket.name} as a CUDA graph")
        return RecordedEnqueue(context, graph)


def refit_from_weight_files(trt: Any, engine: Any, logger: Any, folder: EngineFolder, manifest: EngineManifest,
                            graph: str) -> None:
    """Give a stripped plan its weights (the module doc): TensorRT's ONNX refitter reads the graph's checked bytes,
    and every initializer of the weight files from the engine folder's checked memory maps, in place."""
    entry = manifest.graphs[graph]
    weights = folder.map_weights(manifest.weights)
    model = read_graph(folder, entry, weights)
    refitter = trt.Refitter(engine, logger)
    parser = trt.OnnxParserRefitter(refitter, logger)
    where = folder.directory / entry.file
    if not parser.load_model_proto(model, str(folder.directory)):
        raise EngineFormatError(f"{where}: TensorRT's ONNX refitter cannot read it ({_first_error(parser)})")
    for name, view in weight_views(model, weights.maps):
        if not parser.load_initializer(name, view.ctypes.data, view.nbytes):
            raise EngineFormatError(f"{where}: TensorRT's ONNX refitter refused weight '{name}' "
                                    f"({_first_error(parser)})")
    if not parser.refit_model_proto():
        raise EngineFormatError(f"{where}: TensorRT could not refit its stripped plan from the weights "
                                f"({_first_error(parser)})")
    missing = list(refitter.get_missing_weights())
    if missing:
        raise EngineFormatError(f"{where}: the stripped plan still lacks {len(missing)} weight(s) after the refit, "
                                f"'{missing[0]}' first; refused")
    if not refitter.refit_cuda_engine():
        raise EngineFormatError(f"{where}: TensorRT refused the refitted weights (built from other weights?)")
    weights.release_pages()


def weight_views(model: bytes, maps: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(name, its bytes in place) for every initializer of the graph held in a weight file: the memory maps
    read_graph checked it against."""
    from onnx import ModelProto, TensorProto
    from onnx.external_data_helper import ExternalDataInfo

    views = []
    for tensor in ModelProto.FromString(model).graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            info = ExternalDataInfo(tensor)
            start = info.offset or 0
            views.append((tensor.name, maps[info.location][start:start + info.length]))
    return views


def _first_error(parser: Any) -> str:
    return str(parser.get_error(0).desc()) if getattr(parser, "num_errors", 0) else "no error given"


@dataclass(frozen=True)
class RecordedEnqueue:
    """A recorded enqueue: its graph, and the execution context whose addresses the graph holds (kept alive with
    it, and dropped with it when a bucket is recorded again)."""

    context: Any
    graph: Any

    def __call__(self) -> None:
        self.graph.replay()
