"""Backend compilers: one module per backend, chosen by name (`--backend`)."""
from __future__ import annotations

from pathlib import Path

from v4engine.runtime.engine import EngineManifest


def compile_engine(engine_dir: Path, manifest: EngineManifest) -> dict:
    """Compile (and check) the graphs of engine_dir for manifest.backend; returns what to record in engine.json."""
    if manifest.backend == "onnxruntime":
        from .onnxruntime import compile_engine as compile_onnxruntime

        return compile_onnxruntime(engine_dir, manifest)
    from ..build import BuildError

    raise BuildError(f"--backend {manifest.backend}: not available in this build of v4engine yet")
