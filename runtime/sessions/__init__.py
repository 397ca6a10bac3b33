"""Engine sessions: one small interface, one module per backend (onnxruntime, tensorrt, migraphx)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..engine import TensorSpec


class EngineSession(ABC):
    """One compiled graph of an engine directory: named numpy arrays in, named numpy arrays out."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every input by name) and return every output by name."""


def open_session(engine_dir, manifest, graph: str, **options) -> EngineSession:
    """The session for `graph` ('target' or 'draft') of the engine's backend.

    options are ONNX Runtime's (providers, threads, ...); TensorRT and MIGraphX engines run on the current GPU."""
    if manifest.backend == "onnxruntime":
        from .onnxruntime import OnnxRuntimeSession

        return OnnxRuntimeSession(engine_dir, manifest, graph, **options)
    if manifest.backend == "tensorrt":
        from .tensorrt import TensorRTSession

        return TensorRTSession(engine_dir, manifest, graph)
    if manifest.backend == "migraphx":
        from .migraphx import MIGraphXSession

        return MIGraphXSession(engine_dir, manifest, graph)
    from ..engine import EngineFormatError

    raise EngineFormatError(f"{engine_dir}: backend '{manifest.backend}' has no session in this runtime yet")
