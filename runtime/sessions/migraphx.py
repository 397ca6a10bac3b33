"""MIGraphX session over one graph of an engine directory, on an AMD GPU under ROCm.

Two ways to run a MIGraphX engine, chosen by what is installed:
- the `migraphx` Python module: the programs the build (or compile_migraphx.sh) compiled, one per optimization
  profile (`{graph}.{profile}.mxr`, listed in engine.json); each call runs the tightest profile's program;
- ONNX Runtime's MIGraphX execution provider (onnxruntime-migraphx): the MIGraphX variant graph, which ONNX
  Runtime hands to MIGraphX (nodes MIGraphX cannot take fall back to the CPU).
The programs take host numpy pools, which their offload_copy copies to the GPU every call (keep their budget
small); through ONNX Runtime the pools are torch tensors on the GPU, bound in place (sessions/onnxruntime.py).
Written to MIGraphX's documented Python API; not yet run on ROCm (README, backends).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..backends import MIGraphXCompiled
from ..engine import EngineManifest
from ..engine_folder import EngineFolder
from ..errors import V4EngineError
from ..profiles import choose_profile
from . import EngineSession

PROVIDER = "MIGraphXExecutionProvider"


class MIGraphXUnavailable(V4EngineError):
    """Neither the migraphx module nor ONNX Runtime's MIGraphX execution provider is installed here."""


def _migraphx() -> Any | None:
    try:
        import migraphx
    except ImportError:
        return None
    return migraphx


class MIGraphXSession(EngineSession):
    def __init__(self, engine_dir: str | Path, manifest: EngineManifest, graph: str, device: int | None = None):
        """`device`: the GPU, through ONNX Runtime's MIGraphX provider (its device_id); MIGraphX's own programs run
        on the process's first GPU only (their Python API chooses none)."""
        folder = EngineFolder(engine_dir)
        entry = manifest.graphs[graph]
        self.inputs, self.outputs = entry.inputs, entry.outputs
        compiled = manifest.compiled
        assert isinstance(compiled, MIGraphXCompiled)       # EngineManifest.read reads it by the backend's record
        migraphx = _migraphx()
        self._programs: list[Any] = []
        self._onnxruntime = None
        if migraphx is not None and compiled.programs is not None:
            if device not in (None, 0):
                raise MIGraphXUnavailable(f"{folder.directory}: MIGraphX's own programs run on the first GPU only; "
                                          f"for device {device} use onnxruntime-migraphx (without the migraphx "
                                          "module), or one process per GPU with HIP_VISIBLE_DEVICES")
            self._migraphx = migraphx
            self._profiles = compiled.profiles[graph]      # program i was compiled for profile i (checked on reading)
            self._programs = [migraphx.load(str(folder.checked_path(
                program.file, f"build.compile.programs.{graph}[{i}].file", "compiled")))
                for i, program in enumerate(compiled.programs[graph])]
            return
        import onnxruntime as ort

        if PROVIDER not in ort.get_available_providers():
            raise MIGraphXUnavailable(
                f"{folder.directory} is a MIGraphX engine: install MIGraphX's Python module (and run compile_migraphx.sh "
                f"there) or onnxruntime-migraphx, on a ROCm machine")
        from .onnxruntime import OnnxRuntimeSession

        self._onnxruntime = OnnxRuntimeSession(engine_dir, manifest, graph, device=device,
                                               providers=[PROVIDER, "CPUExecutionProvider"])
        self.pool_device = self._onnxruntime.pool_device      # its pools on the GPU, bound through an IOBinding

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._onnxruntime is not None:
            return self._onnxruntime.run(feeds)
        program = self._programs[choose_profile(self._profiles, {n: tuple(a.shape) for n, a in feeds.items()})]
        arguments = {name: self._migraphx.argument(np.ascontiguousarray(array)) for name, array in feeds.items()}
        results = program.run(arguments)
        return {spec.name: np.array(result) for spec, result in zip(self.outputs, results)}
