"""Backend compilers: one module per backend, chosen by name (`--backend`).

Each takes the engine directory with its exported graphs and engine.json and compiles (and checks) them for its
runtime; what it returns is recorded in engine.json as `build.compile`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from v4engine.runtime.engine import EngineManifest

if TYPE_CHECKING:
    import onnx

# The quantized weight formats each backend keeps quantized in place (behind a blocked DequantizeLinear); weights
# of the other formats are dequantized into the converted file: ONNX Runtime's CPU provider has no FP4 kernel,
# and MIGraphX reads neither FLOAT8E4M3FN nor blocked DequantizeLinear at its opset 19.
QUANTIZED_IN_PLACE = {"onnxruntime": frozenset({"fp8_block"}), "tensorrt": frozenset({"fp8_block", "mxfp4"}),
                      "migraphx": frozenset()}
TENSORRT_OPTIMIZATION_LEVEL = 3              # --builder-optimization-level's default, TensorRT's own


def preflight(backend: str, onnx_only: bool) -> None:
    """Fail before the export when the backend's compiler is needed but missing (one clear line)."""
    if backend == "tensorrt" and not onnx_only:
        from .tensorrt import check_installed

        check_installed()


def prepare_graph(backend: str, model: "onnx.ModelProto", name: str) -> tuple["onnx.ModelProto", Any]:
    """The backend's rewrite of an exported graph, in memory, before the build checks and saves it:
    (the graph, what to record of it in engine.json's build.compile)."""
    if backend == "tensorrt":
        from .tensorrt import mark_aot

        return model, mark_aot(model)
    if backend == "migraphx":
        from .migraphx import make_variant

        return make_variant(model, name)
    return model, None


def compile_engine(engine_dir: Path, manifest: EngineManifest, options: Any, prepared: dict[str, Any]) -> dict:
    """Compile (and check) the graphs of engine_dir for manifest.backend; returns what to record in engine.json.
    prepared: what prepare_graph recorded of each graph."""
    if manifest.backend == "onnxruntime":
        from .onnxruntime import compile_engine as compile_onnxruntime

        return compile_onnxruntime(engine_dir, manifest)
    if manifest.backend == "tensorrt":
        from .tensorrt import compile_engine as compile_tensorrt

        return compile_tensorrt(engine_dir, manifest, prepared, onnx_only=options.onnx_only,
                                optimization_level=options.builder_optimization_level,
                                timing_cache=options.timing_cache, replaced=options.output)
    if manifest.backend == "migraphx":
        from .migraphx import compile_engine as compile_migraphx

        return compile_migraphx(engine_dir, manifest, prepared)
    from ..build import BuildError

    raise BuildError(f"--backend {manifest.backend}: not available in this build of v4engine yet")
