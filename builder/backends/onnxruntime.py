"""ONNX Runtime: the exported graphs are the engine; compiling means loading each one through the same links
and memory maps the runtime uses, so that a graph ONNX Runtime cannot resolve fails the build. The weights stay
in their memory-mapped files during the check, so the build's memory does not grow with the checkpoint.

The CPU execution provider has no bfloat16 kernels: a bf16 engine is checked on the CUDA provider when
onnxruntime-gpu is installed, and otherwise recorded as not loaded here (the graphs still passed onnx.checker
and strict shape inference)."""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from v4engine.runtime.engine import EngineManifest
from v4engine.runtime.sessions import open_session


def compile_engine(engine_dir: Path, manifest: EngineManifest) -> dict:
    available = ort.get_available_providers()
    if manifest.dtype == "bf16":
        if "CUDAExecutionProvider" not in available:
            return {"onnxruntime": ort.__version__, "providers_checked": [],
                    "not_loaded": "the CPU execution provider has no bfloat16 kernels; this engine runs on the CUDA "
                                  "execution provider (onnxruntime-gpu)"}
        providers = ["CUDAExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    for graph in manifest.graphs:
        open_session(engine_dir, manifest, graph, providers=providers, load_check=True)
    return {"onnxruntime": ort.__version__, "providers_checked": providers}
