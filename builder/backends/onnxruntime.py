"""ONNX Runtime: the exported graphs are the engine; compiling means loading each one the way the runtime
will (weights through the same links and memory maps) so that a graph ORT cannot run fails the build."""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from v4engine.runtime.engine import EngineManifest
from v4engine.runtime.sessions import open_session


def compile_engine(engine_dir: Path, manifest: EngineManifest) -> dict:
    for graph in manifest.graphs:
        open_session(engine_dir, manifest, graph)
    return {"onnxruntime": ort.__version__, "providers_checked": ["CPUExecutionProvider"]}
