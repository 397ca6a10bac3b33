"""ONNX Runtime session over one graph of an engine directory (CPU by default, CUDA when asked and present)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..engine import EngineManifest
from . import EngineSession


class OnnxRuntimeSession(EngineSession):
    def __init__(self, engine_dir: str | Path, manifest: EngineManifest, graph: str, providers: list[str] | None = None,
                 threads: int | None = None, load_check: bool = False, alternating: bool = False):
        """`load_check`: only prove that ONNX Runtime loads and resolves the graph, with every weight left in
        its memory-mapped file (no graph optimization, no prepacking): memory stays flat in the model size.
        `alternating`: this session takes turns with another (target and MTP draft). Then its idle pool threads
        must not spin: two spinning pools on the same cores made MTP = 3 slower than no drafting (0.73x)."""
        engine_dir = Path(engine_dir)
        entry = manifest.graphs[graph]
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if alternating:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if load_check:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.add_session_config_entry("session.disable_prepacking", "1")
            options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
        else:   # fold DequantizeLinear of FP8/FP4 weights once at load instead of dequantizing them every call
            options.add_session_config_entry("session.disable_quant_qdq", "1")
        # ONNX Runtime refuses external data that resolves outside the model folder, so weight files that are
        # symlinks into the checkpoint are handed over as memory maps (no copy of the file is made).
        mapped = [(w.file, np.memmap(engine_dir / w.file, dtype=np.uint8, mode="r"))
                  for w in manifest.weights if load_check or (engine_dir / w.file).is_symlink()]
        if mapped:
            options.add_external_initializers_from_files_in_memory(
                [name for name, _ in mapped], [m for _, m in mapped], [m.nbytes for _, m in mapped])
        self._session = ort.InferenceSession(str(engine_dir / entry.file), options,
                                             providers=providers or ["CPUExecutionProvider"])
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self._output_names = [o.name for o in entry.outputs]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._output_names, self._session.run(self._output_names, feeds)))
