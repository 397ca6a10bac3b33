"""Backend compilers: one module per backend of the runtime's registry (contract/backends.py), named after it.

Each module provides the three steps of a build that differ by backend:
- `preflight(options)`: fail before the export when the backend's compiler is needed but missing (one clear line);
  `options`: the backend's own build options (contract/backend_options.py);
- `prepare_graph(model, name, options)`: the backend's rewrite of an exported graph, in memory, before the build
  checks and saves it: (the graph, what to record of it);
- `compile_engine(engine_dir, manifest, build, options, prepared)`: compile (and check) the saved graphs (`build`:
  the whole build's options, `options` the backend's own); returns the backend's compile record, which engine.json
  holds as `build.compile`.
The functions here run the step of the module of the backend asked for."""
from __future__ import annotations

from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from v4engine.contract.backend_options import BackendOptions
from v4engine.contract.backends import BACKENDS, CompileRecord
from v4engine.contract.engine import EngineManifest

if TYPE_CHECKING:
    import onnx

    from ..build import BuildOptions

def builder_module(backend: str) -> ModuleType:
    """The builder module of `backend` (the registry names it)."""
    return import_module(BACKENDS[backend].builder)


def preflight(backend: str, options: BackendOptions) -> None:
    """Fail before the export when the backend's compiler is needed but missing (one clear line)."""
    builder_module(backend).preflight(options)


def prepare_graph(backend: str, model: onnx.ModelProto, name: str, options: BackendOptions
                  ) -> tuple[onnx.ModelProto, Any]:
    """The backend's rewrite of the exported graph `name`, in memory, before the build checks and saves it
    (`options`: the backend's build options): (the graph, what to record of it)."""
    return builder_module(backend).prepare_graph(model, name, options)


def compile_engine(engine_dir: Path, manifest: EngineManifest, build: BuildOptions, options: BackendOptions,
                   prepared: dict[str, Any]) -> CompileRecord:
    """Compile (and check) the graphs of engine_dir for manifest.backend; returns what engine.json records of it.
    prepared: what prepare_graph recorded of each graph."""
    return builder_module(manifest.backend).compile_engine(engine_dir, manifest, build, options, prepared)
