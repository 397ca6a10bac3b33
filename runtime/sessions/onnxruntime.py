"""ONNX Runtime session over one graph of an engine directory (CPU by default, CUDA when asked and present).

ONNX Runtime never opens a file of the engine itself: the graph arrives as bytes, and every weight file as a
read-only memory map, each checked first (engine_folder.py). That keeps reads inside the engine folder (ONNX
Runtime's own refusal of external data outside the model folder does not apply to memory maps), and it makes
engines whose weights are symlinks load like any other (ONNX Runtime takes in-memory weight files for all of a
graph's locations or for none).

Routed experts stored as MXFP4 run in ONNX Runtime's QMoE as int8 codes, exact only on its fp32 path: the kernel
reads ORT_QMOE_CPU_QNBIT_GEMM when a session is made, and by default quantizes activations to int8 (1e-2 off).
So every session is made with it set to fp32, for the whole process (a later session of anyone's would read it
too; it only makes QMoE exact).

Threads. By default each session has its own intra-op pool, and a session that takes turns with another (target
and MTP draft) lets its idle threads sleep rather than spin: two spinning pools on two cores made MTP 3 slower
than no drafting. `share_thread_pool()` gives every later session one process-wide pool instead, spinning, so the
draft and the verify after it run on threads already awake. ONNX Runtime makes that switch for the whole process
and for good: after it, it refuses any session made with a pool of its own (anyone's), so only a program's entry
point asks for it (`Generator.from_engine_dir(..., share_threads=True)`: v4generate, the demo, the benchmarks),
never the library on its own.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..engine import EngineManifest
from ..engine_folder import EngineFolder, EngineFormatError, read_graph
from ..untrusted import first_line
from . import EngineRunError, EngineSession, checked_outputs

QMOE_GEMM = "ORT_QMOE_CPU_QNBIT_GEMM"
_shared_pool = False             # share_thread_pool() ran: every session of this process uses one pool


def share_thread_pool(threads: int | None = None) -> None:
    """From now on, every ONNX Runtime session of this process runs on one intra-op pool of `threads` (default:
    ONNX Runtime's, one per physical core), ours and anyone's; a session asking for its own pool is refused by
    ONNX Runtime (see the module doc). Later calls change nothing."""
    global _shared_pool
    if not _shared_pool:
        ort.set_global_thread_pool_sizes(threads or 0, 1)
        _shared_pool = True


def release_freed_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere). ONNX Runtime
    folds constant subgraphs at load, the int8 experts' widening among them, and glibc keeps the freed
    intermediates: without this a loaded engine holds about 1.6 times its weights."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


class OnnxRuntimeSession(EngineSession):
    def __init__(self, engine_dir: str | Path, manifest: EngineManifest, graph: str, providers: list[str] | None = None,
                 threads: int | None = None, load_check: bool = False, alternating: bool = False):
        """`load_check`: only prove that ONNX Runtime loads and resolves the graph, with every weight left in
        its memory-mapped file (no graph optimization, no prepacking): memory stays flat in the model size.
        `alternating`: this session takes turns with another (target and MTP draft). Then, on a pool of its own,
        its idle threads must not spin: two spinning pools on the same cores made MTP = 3 slower than no drafting
        (0.73x). `threads` and `alternating` mean nothing once the process shares one pool (share_thread_pool)."""
        folder = EngineFolder(engine_dir)
        entry = manifest.graphs[graph]
        weights = folder.map_weights(manifest.weights)
        model = read_graph(folder, entry, weights)
        options = ort.SessionOptions()
        options.log_severity_level = 3          # errors only: what goes wrong reaches the caller as one line
        if _shared_pool:
            options.use_per_session_threads = False
        elif threads:
            options.intra_op_num_threads = threads
        if alternating and not _shared_pool:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if load_check:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.add_session_config_entry("session.disable_prepacking", "1")
        else:   # fold DequantizeLinear of FP8/FP4 weights once at load instead of dequantizing them every call
            options.add_session_config_entry("session.disable_quant_qdq", "1")
        if weights.maps:        # used in place, not copied: the maps live as long as the session (self._weights)
            options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
            options.add_external_initializers_from_files_in_memory(
                list(weights.maps), list(weights.maps.values()), [m.nbytes for m in weights.maps.values()])
        os.environ[QMOE_GEMM] = "fp32"
        try:
            self._session = ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])
        except Exception as e:      # noqa: BLE001 - ONNX Runtime's errors share no base class below Exception
            raise EngineFormatError(f"{folder.directory / entry.file}: ONNX Runtime cannot load it "
                                    f"({first_line(e)})") from None
        weights.release_pages()
        release_freed_heap()
        self._weights = weights
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self._output_names = [o.name for o in entry.outputs]
        self._graph = folder.directory / entry.file

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self._session.run(self._output_names, feeds)
        except Exception as e:      # noqa: BLE001 - ONNX Runtime's errors share no base class below Exception
            raise EngineRunError(f"{self._graph}: ONNX Runtime failed to run it ({first_line(e)})") from None
        return checked_outputs(self, feeds, dict(zip(self._output_names, values)), self._graph)
