"""ONNX Runtime session over one graph of an engine directory (CPU by default, CUDA when asked and present).

ONNX Runtime never opens a file of the engine itself: the graph arrives as bytes, and every weight file as a
read-only memory map, each checked first (engine_folder.py). That keeps reads inside the engine folder (ONNX
Runtime's own refusal of external data outside the model folder does not apply to memory maps), and it makes
engines whose weights are symlinks load like any other (ONNX Runtime takes in-memory weight files for all of a
graph's locations or for none).

Weights widen at load (FP8 and bf16 to float32, MXFP4 to QMoE's int8 codes): on the CPU the runtime does it for
the routed experts before the session is made, a group of weights at a time (widening.py), so loading peaks near
the resident size; ONNX Runtime's constant folding, which did it all at once (3.6x the resident size at peak on the
slice), keeps the weights its GEMMs pack, and does everything for a GPU provider and with runtime_widening=False.
On the CPU, first of all, the dense FP8 and bf16 projections and the MXFP4 routed experts move to v4engine's
kernels, which read the stored bytes in place (stored_weights.py; stored_weights=False: the stock kernels, QMoE over
int8 codes and MatMul over float32 weights).

Routed experts stored as MXFP4 run in ONNX Runtime's QMoE as int8 codes, exact only on its fp32 path: the kernel
reads ORT_QMOE_CPU_QNBIT_GEMM when a session is made, and by default quantizes activations to int8 (1e-2 off).
So it is set to fp32 when this module is imported, for the whole process (a later session of anyone's reads it too;
it only makes QMoE exact), and unset only while a session of an engine built --int8-moe-activations is made
(engine.json `build.compile.moe_activations`: lossy, 1.5x the slice's decode speed), under a lock our sessions
share.

Threads. By default each session has its own intra-op pool of OMP_NUM_THREADS threads where that is set (the
convention torch and the BLAS libraries follow: processes that share cores, like a test run's workers, set it once
for all), else ONNX Runtime's default, one per physical core; a session that takes turns with another (target
and MTP draft) lets its idle threads sleep rather than spin: two spinning pools on two cores made MTP 3 slower
than no drafting. `share_thread_pool()` gives every later session one process-wide pool instead, spinning, so the
draft and the verify after it run on threads already awake. ONNX Runtime makes that switch for the whole process
and for good: after it, it refuses any session made with a pool of its own (anyone's), so only a program's entry
point asks for it (`Generator.from_engine_dir(..., own_process=True)`: v4generate, the demo, the benchmarks),
never the library on its own.

Where the caches live. On the CPU provider the pools are numpy arrays, which ONNX Runtime reads in place. On a GPU
provider (CUDA; MIGraphX through onnxruntime-migraphx) they are torch tensors on the session's device
(`pool_device`), bound by DLPack through an IOBinding, never copied; the rows a call produces (`new.*`) are left
on the device for the CUDA provider and the pool writes them there (runtime/pool_arrays.py); the other outputs
come to the host. The option `device_pools=True` runs the same binding path on the CPU provider with torch CPU
tensors (how it is tested without a GPU).

Engines built for the CUDA provider (v4build --device cuda: engine.json `build.compile.device`) run there by
default and nowhere else: their graphs hold kernels only the CUDA provider has (QMoE's fp4 path, the FP8 MatMul,
bf16 throughout), so a CPU provider first is refused in one line, as is an ONNX Runtime without the CUDA provider.
Their sessions leave every DequantizeLinear of a constant unfolded (no session.disable_quant_qdq): the FP8 experts
are widened by one on the device at each call, never on the host at load.

CUDA graphs. An engine built with --cuda-graphs runs its verify and draft-cycle calls on the CUDA provider as
recorded CUDA graphs (contract/calls.py): the provider is made with `enable_cuda_graph`, each bucket of static
shapes gets an IOBinding over buffers allocated once and a graph id of its own (the run option `gpu_graph_id`,
onnxruntime 1.18 on), which ONNX Runtime records after a warm-up run and replays after that; every other call
runs with graph id -1 (not recorded). ONNX Runtime runs on a stream of its own, so a replay first waits for
torch's, on which the inputs were copied. ONNX Runtime records only a session whose every compute node runs on
CUDA: one it refuses is loaded without recording, with a warning. The option `cuda_graphs=True` takes the same
static-buffer path on the CPU provider (no graph is recorded there; the pools become torch tensors): how it is
tested without a GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import ModelProto

from v4engine.contract.backend_options import OnnxRuntimeSessionOptions
from v4engine.contract.backends import OnnxRuntimeCompiled
from v4engine.contract.buckets import Bucket
from v4engine.contract.calls import captured_buckets
from v4engine.contract.engine import EngineManifest
from v4engine.contract.engine_folder import ELEMENT_TYPES, EngineFolder, EngineFormatError, MappedWeights, read_graph
from v4engine.contract.errors import V4EngineError
from v4engine.contract.untrusted import first_line

from ..pool_arrays import NUMPY_DTYPES, to_numpy
from ..sampling import RequestError
from ..static_calls import StaticCalls
from . import EngineRunError, EngineSession, checked_outputs, stored_weights
from .widening import WidenedGraph, widen_weights

QMOE_GEMM = "ORT_QMOE_CPU_QNBIT_GEMM"
os.environ[QMOE_GEMM] = "fp32"        # for the whole process, from this module's import on (the module doc)
_qmoe_lock = threading.Lock()
# Providers whose sessions keep the pools on their GPU, with the IOBinding device their outputs may stay on (None:
# outputs come to the host; MIGraphX's device names differ between ONNX Runtime builds, and only new rows move)
DEVICE_PROVIDERS = {"CUDAExecutionProvider": "cuda", "MIGraphXExecutionProvider": None}
Provider = str | tuple[str, dict]
CPU_PREFILL_CHUNK = 256     # prompt tokens per call on the CPU: less arena than 512, about as fast (RESULTS.md)
ARENA_KEPT_ROWS = 64        # token rows of a call whose intermediates the CPU arena keeps (a verify of 8 x 8 at most);
                            # what longer calls (a prompt's chunks, a drafter's catch-up) grew is given back after them
SHRINK_ARENA = "memory.enable_memory_arena_shrinkage"   # the run option: free the arena's unused regions after a call
BFLOAT16 = NUMPY_DTYPES["bf16"]                          # ml_dtypes' bfloat16
GRAPH_ID = "gpu_graph_id"                                # the run option naming a call's recorded graph (-1: none)


def _device_of(providers: list[Provider]) -> tuple[str, str | None, int] | None:
    """(provider, IOBinding device type for outputs, device id) of the first provider that runs on a GPU, or None."""
    for provider in providers:
        name, options = (provider, {}) if isinstance(provider, str) else provider
        if name == "CPUExecutionProvider":
            return None
        if name in DEVICE_PROVIDERS:
            return name, DEVICE_PROVIDERS[name], int(options.get("device_id", 0))
    return None
def _with_option(providers: list[Provider], names: Any, key: str, value: Any) -> list[Provider]:
    """`providers` with option `key` set to `value` on those named in `names`."""
    out: list[Provider] = []
    for provider in providers:
        name, options = (provider, {}) if isinstance(provider, str) else provider
        out.append((name, {**options, key: value}) if name in names else provider)
    return out


def providers_on(providers: list[Provider], device: int) -> list[Provider]:
    """`providers` with each GPU provider's device_id set to `device`."""
    return _with_option(providers, DEVICE_PROVIDERS, "device_id", device)


_shared_pool = False             # share_thread_pool() ran: every session of this process uses one pool


@contextlib.contextmanager
def _moe_activations(compiled: OnnxRuntimeCompiled | None) -> Iterator[None]:
    """QMoE's fp32 path while a session is made, unless the engine was built for int8 inputs (the module doc; no
    record yet: the build's own load check)."""
    with _qmoe_lock:
        if compiled is not None and compiled.moe_activations == "int8":
            os.environ.pop(QMOE_GEMM, None)
        try:
            yield
        finally:
            os.environ[QMOE_GEMM] = "fp32"


def default_threads() -> int | None:
    """Intra-op threads of a session not told how many: OMP_NUM_THREADS where set (its first level), else None
    (ONNX Runtime's default, a thread per physical core)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise V4EngineError(f"OMP_NUM_THREADS must be a positive number of threads (got {value!r:.40})")
    return int(value)


def share_thread_pool(threads: int | None = None) -> None:
    """From now on, every ONNX Runtime session of this process runs on one intra-op pool of `threads` (default:
    default_threads()), ours and anyone's; a session asking for its own pool is refused by ONNX Runtime (see the
    module doc). Later calls change nothing."""
    global _shared_pool
    if not _shared_pool:
        ort.set_global_thread_pool_sizes(threads or default_threads() or 0, 1)
        _shared_pool = True


def release_freed_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere): widening weights
    at load (ours or ONNX Runtime's constant folding) frees intermediates that glibc would keep; without this a
    loaded engine held about 1.6 times its weights."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


@dataclass(frozen=True)
class Placement:
    """Where a session runs: its providers, the GPU provider that comes first (provider, IOBinding device type for
    outputs, device id; None: the CPU), and whether its per-token calls take static buffers (`cuda_graphs`) and are
    recorded as CUDA graphs (`recording`: only on the CUDA provider of an ONNX Runtime that records per bucket)."""

    providers: list[Provider]
    gpu: tuple[str, str | None, int] | None
    cuda_graphs: bool
    recording: bool


def built_for(manifest: EngineManifest) -> str:
    """What an ONNX Runtime engine was built for: "cpu", or "cuda" (v4build --device cuda)."""
    compiled = manifest.compiled
    return compiled.device if isinstance(compiled, OnnxRuntimeCompiled) else "cpu"


def placement(folder: EngineFolder, manifest: EngineManifest, options: OnnxRuntimeSessionOptions, device: int | None
              ) -> Placement:
    """The options resolved against the engine and this ONNX Runtime (the module doc says how)."""
    cuda_engine = built_for(manifest) == "cuda"
    default = ["CUDAExecutionProvider"] if cuda_engine else ["CPUExecutionProvider"]
    providers = list(options.providers or default)
    if device is not None:
        providers = providers_on(list(options.providers or ["CUDAExecutionProvider", "CPUExecutionProvider"]), device)
    compiled = manifest.compiled
    captured = compiled.cuda_graphs if isinstance(compiled, OnnxRuntimeCompiled) else ()
    gpu = _device_of(providers)
    available = ort.get_available_providers()
    if cuda_engine and (gpu is None or gpu[0] != "CUDAExecutionProvider" or gpu[0] not in available):
        runs = providers[0] if isinstance(providers[0], str) else providers[0][0]
        why = "this ONNX Runtime has no CUDAExecutionProvider (install onnxruntime-gpu)" \
            if "CUDAExecutionProvider" not in available else f"it was opened on {runs}"
        raise EngineFormatError(f"{folder.directory}: built for ONNX Runtime's CUDA provider (v4build --device cuda) "
                                f"and runs nowhere else, but {why}; rebuild without --device cuda to run on the CPU")
    if device is not None and gpu is not None and gpu[0] not in available:   # not quietly the CPU instead
        raise RequestError(f"devices: GPU {device} was asked for, but this ONNX Runtime has no {gpu[0]} (its "
                           f"providers: {', '.join(available)}); leave devices out to run on the CPU")
    on_cuda = gpu is not None and gpu[0] == "CUDAExecutionProvider" and gpu[0] in available
    if options.cuda_graphs and not captured:
        raise EngineFormatError(f"{folder.directory}: built without --cuda-graphs, so its graphs cannot be "
                                "recorded as CUDA graphs; rebuild with v4build --cuda-graphs")
    cuda_graphs = bool(captured) and on_cuda if options.cuda_graphs is None else options.cuda_graphs
    return Placement(providers, gpu, cuda_graphs, cuda_graphs and on_cuda and _records_graph_ids())


def session_options(files: dict[str, np.ndarray], threads: int | None, alternating: bool, load_check: bool,
                    kernels: Path | None = None, memory_pattern: bool = True, fold_quantized: bool = True
                    ) -> ort.SessionOptions:
    """ONNX Runtime's options for one session: threads (the module doc), the load check's or a run's graph
    optimizations, the weight files (location -> bytes: memory maps, widened weights) used in place, v4engine's
    kernel library where the graph uses it (stored_weights.py), and whether ONNX Runtime plans each call's memory
    as one block by the inputs' shapes (`memory_pattern`; off on the CPU: a decode's shapes change with every token,
    and the plans and blocks kept for them held 8 MiB more on the slice after four prompts, at the same speed), and
    whether it folds the DequantizeLinear of constant weights at load (`fold_quantized`; not for engines built for
    CUDA, whose experts' DequantizeLinear widens them on the device at each call)."""
    options = ort.SessionOptions()
    options.enable_mem_pattern = memory_pattern
    if kernels is not None:
        options.register_custom_ops_library(str(kernels))
    options.log_severity_level = 3          # errors only: what goes wrong reaches the caller as one line
    threads = threads or default_threads()
    if _shared_pool:
        options.use_per_session_threads = False
    elif threads:
        options.intra_op_num_threads = threads
    if alternating and not _shared_pool:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if load_check:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.add_session_config_entry("session.disable_prepacking", "1")
    elif fold_quantized:    # fold DequantizeLinear of FP8/FP4 weights once at load, not dequantize them every call
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if files:       # used in place, not copied: they live as long as the session (self._weights, self._widened)
        options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
        options.add_external_initializers_from_files_in_memory(list(files), list(files.values()),
                                                               [f.nbytes for f in files.values()])
    return options


def stored_projections(model: bytes, weights: MappedWeights | None = None, experts: bool = True,
                       graph: object = "graph") -> tuple[bytes, Path | None]:
    """`model` with its dense FP8 and bf16 projections (and, `experts`, its MXFP4 routed experts; its embedding's
    rows) on v4engine's kernels, and the kernels' library; or `model` as it is and None where it has none or the
    kernels cannot be built here (said once: stored_weights.py). `weights`: the engine's weight files. A graph that
    places the kernels itself is refused (EngineFormatError naming `graph`)."""
    proto = ModelProto.FromString(model)
    try:
        done = stored_weights.rewrite(proto, weights and weights.maps, experts, opened=weights and weights.opened)
    except ValueError as e:
        raise EngineFormatError(f"{graph}: {e}; refused") from None
    if not done.projections:
        return model, None
    kernels = stored_weights.library()
    if isinstance(kernels, str):
        stored_weights.warn_unavailable(kernels)
        return model, None
    return proto.SerializeToString(), kernels


class OnnxRuntimeSession(EngineSession):
    @classmethod
    def own_process(cls, options: OnnxRuntimeSessionOptions) -> None:
        share_thread_pool(options.threads)

    @classmethod
    def prefill_chunk(cls, options: OnnxRuntimeSessionOptions, devices: object,
                      manifest: EngineManifest | None = None) -> int | None:
        """CPU_PREFILL_CHUNK on the CPU provider: ONNX Runtime's arena keeps what the largest call needed, and a
        512-token chunk needs more for as good as no speed (4,000 prompt tokens: 4.5 s against 4.2 on the slice,
        0.97 s against 1.04 on tiny-v4; 15-25% less memory kept after them)."""
        cuda_engine = manifest is not None and built_for(manifest) == "cuda"
        on_cpu = devices is None and not cuda_engine and \
            _device_of(list(options.providers or ["CPUExecutionProvider"])) is None
        return CPU_PREFILL_CHUNK if on_cpu else None

    def __init__(self, engine_dir: str | Path, manifest: EngineManifest, graph: str, device: int | None = None,
                 options: OnnxRuntimeSessionOptions = OnnxRuntimeSessionOptions(), alternating: bool = False,
                 load_check: bool = False):
        """`device`: the GPU (its `device_id`) for the GPU providers of options.providers (default: CUDA, then the
        CPU). options.device_pools: keep the pools as torch tensors on the session's device (None: when a GPU
        provider comes first; True on the CPU provider: torch CPU tensors through the same binding path).
        options.cuda_graphs: run the per-token calls of an engine built with --cuda-graphs as recorded graphs (None:
        when it was, on the CUDA provider; True on the CPU provider: the same static buffers, nothing recorded).
        options.runtime_widening: on the CPU, the routed experts' stored weights are widened here before the
        session is made (widening.py; False: all by ONNX Runtime's constant folding, at once).
        options.stored_weights: on the CPU, dense FP8 and bf16 projections read their stored bytes in v4engine's
        kernels (stored_weights.py). `alternating`: this
        session takes turns with another (target and draft graph). Then, on a pool of its own, its idle threads
        must not spin: two spinning pools on the same cores made MTP = 3 slower than no drafting
        (0.73x). options.threads and `alternating` mean nothing once the process shares one pool (own_process).
        `load_check` (the build's): only prove that ONNX Runtime loads and resolves the graph, with every weight left
        in its memory-mapped file (no graph optimization, no prepacking): memory stays flat in the model size."""
        folder = EngineFolder(engine_dir)
        entry = manifest.graphs[graph]
        place = placement(folder, manifest, options, device)
        self._recording = place.recording
        weights = folder.map_weights(manifest.weights)
        model = read_graph(folder, entry, weights)          # checked first: its refusals name the field at fault
        kernels = None
        if options.stored_weights and place.gpu is None and not load_check:
            int8 = manifest.compiled is not None and manifest.compiled.moe_activations == "int8"
            model, kernels = stored_projections(model, weights, not int8, folder.directory / entry.file)
        try:
            with _moe_activations(manifest.compiled):
                widened = WidenedGraph(model)
                if options.runtime_widening and place.gpu is None and not load_check:
                    widened = widen_weights(model, weights, lambda files: session_options(
                        files, options.threads, alternating, load_check), folder.directory / entry.file)
                files = {**weights.maps, **widened.buffers}
                self._session = self._load(widened.model, session_options(
                    files, options.threads, alternating, load_check, kernels, memory_pattern=place.gpu is not None,
                    fold_quantized=built_for(manifest) != "cuda"), place.providers, folder.directory / entry.file)
        except EngineFormatError:
            raise
        except Exception as e:      # noqa: BLE001 - ONNX Runtime's errors share no base class below Exception
            raise EngineFormatError(f"{folder.directory / entry.file}: ONNX Runtime cannot load it "
                                    f"({first_line(e)})") from None
        weights.release_pages()
        release_freed_heap()
        self._weights, self._widened = weights, widened.buffers
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self._output_names = [o.name for o in entry.outputs]
        self._graph = folder.directory / entry.file
        gpu = place.gpu if place.gpu is not None and place.gpu[0] in self._session.get_providers() else None
        device_pools = options.device_pools       # asked for a GPU this ONNX Runtime has not: it runs on the CPU
        if device_pools is None or place.cuda_graphs:
            device_pools = gpu is not None or place.cuda_graphs
        self._bind_outputs: str | None = None       # device type where new rows stay (None: the host)
        if device_pools:
            self._pools_on_device(gpu)
        self._eager = ort.RunOptions()
        if self._recording:
            self._eager.add_run_config_entry(GRAPH_ID, "-1")
        self._shrink: ort.RunOptions | None = None  # on the CPU: a call that gives back what the arena grew
        self._grown = False                          # a call longer than ARENA_KEPT_ROWS ran since the last shrink
        if place.gpu is None and not load_check:
            self._shrink = ort.RunOptions()
            self._shrink.add_run_config_entry(SHRINK_ARENA, "cpu:0")
        self._captured: StaticCalls | None = None
        buckets = captured_buckets(manifest.compiled.profiles[graph], manifest.compiled.cuda_graphs, self.inputs) \
            if place.cuda_graphs else []
        if buckets:                             # (a graph without a recorded profile runs as any other)
            self._captured = StaticCalls(self._torch, self.pool_device, buckets, self.inputs, self.outputs,
                                         manifest.layout_of(graph), self._capture, self.on_device)

    def _pools_on_device(self, gpu: tuple[str, str | None, int] | None) -> None:
        """Keep the pools as torch tensors on the session's GPU (or the CPU), bound in place."""
        try:
            import torch
        except ImportError:
            raise EngineFormatError(f"{self._graph}: caches on the device need torch (a build for this GPU) "
                                    "beside ONNX Runtime; install it, or pass the option device_pools=False") from None
        self._torch = torch
        self.pool_device = "cpu" if gpu is None else f"cuda:{gpu[2]}"     # torch names ROCm devices cuda too
        self._bind_outputs = gpu and gpu[1]
        self._device_id = 0 if gpu is None else gpu[2]

    def _load(self, model: bytes, options: ort.SessionOptions, providers: list[Provider], graph: Path
              ) -> ort.InferenceSession:
        """The session; with the CUDA provider recording graphs when asked, which ONNX Runtime allows only if every
        compute node runs on CUDA: if not, the session is made without, the calls then run unrecorded (a warning
        says so)."""
        if not self._recording:
            return ort.InferenceSession(model, options, providers=providers)
        try:
            return ort.InferenceSession(model, options, providers=_with_option(
                providers, {"CUDAExecutionProvider"}, "enable_cuda_graph", "1"))
        except Exception as e:      # noqa: BLE001 - ONNX Runtime's errors share no base class below Exception
            warnings.warn(f"{graph}: ONNX Runtime's CUDA provider cannot record it as CUDA graphs "
                          f"({first_line(e)}); its calls run unrecorded")
            self._recording = False
            return ort.InferenceSession(model, options, providers=providers)

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        self._weights.check_intact()         # ONNX Runtime reads weights in place: a cut file would be SIGBUS
        bucket = self._captured and self._captured.bucket_for(feeds)
        options = self._run_options(feeds)
        try:
            if bucket:
                outputs = self._captured.run(feeds, bucket)
            elif self.pool_device is None:
                outputs = dict(zip(self._output_names, self._session.run(self._output_names, feeds, options)))
            else:
                outputs = self._run_bound(feeds, options)
        except Exception as e:      # noqa: BLE001 - ONNX Runtime's errors share no base class below Exception
            raise EngineRunError(f"{self._graph}: ONNX Runtime failed to run it ({first_line(e)})") from None
        if options is self._shrink:
            release_freed_heap()        # what the arena gave back, glibc gives to the system
        return checked_outputs(self, feeds, outputs, self._graph)

    def _run_options(self, feeds: dict[str, Any]) -> ort.RunOptions:
        """A call's run options. ONNX Runtime's CPU arena keeps the most any call needed (a prompt's chunk: most of
        what the slice held after a generation, RESULTS.md), so the first call of at most ARENA_KEPT_ROWS token rows
        after longer ones frees at its end the regions they grew: a prompt's chunks reuse theirs (given back after
        each, tiny-v4's 4,000-token first token took 8% longer), the decodes after it keep their own."""
        ids = feeds.get("input_ids")
        if ids is not None and math.prod(ids.shape) > ARENA_KEPT_ROWS:
            self._grown = True
        elif self._grown and self._shrink is not None:
            self._grown = False
            return self._shrink
        return self._eager

    def _run_bound(self, feeds: dict[str, Any], options: ort.RunOptions) -> dict[str, Any]:
        """One call through an IOBinding: torch tensors (the pools) bound where they are by DLPack, host arrays
        copied to the device by ONNX Runtime; new rows left on the device where the provider allows."""
        binding = self._session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                binding.bind_ortvalue_input(name, _host_value(value))
            else:
                binding.bind_ortvalue_input(name, ort.OrtValue.from_dlpack(value.contiguous()))
        for name in self._output_names:
            if self._bind_outputs and self.on_device(name):
                binding.bind_output(name, self._bind_outputs, self._device_id)
            else:
                binding.bind_output(name)
        self._session.run_with_iobinding(binding, options)
        binding.synchronize_outputs()   # new rows are read on torch's stream next: ONNX Runtime's must be done
        outputs = {}
        for name, value in zip(self._output_names, binding.get_outputs()):
            if self._bind_outputs and self.on_device(name):
                outputs[name] = self._torch.from_dlpack(value)
            elif value.data_type() == "tensor(bfloat16)":       # numpy has no bfloat16: through torch's DLPack
                outputs[name] = to_numpy(self._torch.from_dlpack(value))
            else:
                outputs[name] = value.numpy()
        return outputs

    def _capture(self, bucket: Bucket, number: int, inputs: dict[str, Any], outputs: dict[str, Any]) -> Any:
        """A bucket's call bound once to its static buffers; on the CUDA provider under graph id `number`, which
        ONNX Runtime records after a warm-up run and replays after that."""
        binding = self._session.io_binding()
        for name, tensor in inputs.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.from_dlpack(tensor))
        for name, tensor in outputs.items():
            binding.bind_ortvalue_output(name, ort.OrtValue.from_dlpack(tensor))
        options = ort.RunOptions()
        if self._recording:
            options.add_run_config_entry(GRAPH_ID, str(number))

        def replay() -> None:
            if self._recording:         # the inputs were copied on torch's stream, which ONNX Runtime's does not
                self._torch.cuda.current_stream(self.pool_device).synchronize()         # wait for
            self._session.run_with_iobinding(binding, options)
            binding.synchronize_outputs()

        return replay


def _records_graph_ids() -> bool:
    """Whether this ONNX Runtime records several CUDA graphs per session, one per `gpu_graph_id` (1.18 on;
    before, one graph would be replayed for every bucket)."""
    major, minor = (int(part) for part in ort.__version__.split(".")[:2])
    if (major, minor) >= (1, 18):
        return True
    warnings.warn(f"onnxruntime {ort.__version__} records one CUDA graph per session; the calls run unrecorded "
                  "(1.18 or later records one per bucket)")
    return False


def _host_value(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue of a host array; bf16 (ml_dtypes) through its bits, which ONNX Runtime's numpy bridge lacks."""
    if array.dtype == BFLOAT16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), ELEMENT_TYPES["bfloat16"])
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))

