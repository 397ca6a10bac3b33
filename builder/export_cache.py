"""Exports kept by what they depend on, so that building one model again skips the export.

An export depends only on the model config, the graph (a target stage, or the draft graph of a drafting method),
dtype, k and whether the graph must be free of control flow: never on the weights. It costs tens of seconds
per graph even for a tiny model (95% of a tiny build), so a process that builds one model again (another weight
format or backend; the tests) takes it from this process's memory, and any process takes it from the folder named
by V4ENGINE_EXPORT_CACHE when that is set (the test suite sets it for its workers and the CLIs they run). A cached
export is keyed also by the exporter's own source and the versions of torch and onnx, so a changed exporter never
reads an old export. The folder is trusted like the code: keep it one of your own.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

from filelock import FileLock

FOLDER = "V4ENGINE_EXPORT_CACHE"
KEPT = 8                                      # exports kept in this process's memory
SOURCES = ("contract", "builder", "plugins")  # the packages whose code decides what an export holds
TOOLS = ("torch", "onnx", "onnxscript", "onnx-ir")

_memory: dict[str, bytes] = {}


def cached_export(key: tuple, export: Callable[[], bytes]) -> bytes:
    """The serialized export `key` names: from memory, from the folder, or made now by export() (and kept)."""
    name = hashlib.sha256(repr((key, _fingerprint())).encode()).hexdigest()
    if name not in _memory:
        folder = os.environ.get(FOLDER)
        data = _from_folder(Path(folder), name, export) if folder else export()
        while len(_memory) >= KEPT:
            _memory.pop(next(iter(_memory)))
        _memory[name] = data
    return _memory[name]


def _from_folder(folder: Path, name: str, export: Callable[[], bytes]) -> bytes:
    """The export in `folder`, made by the first process that asks for it while the others wait."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.onnx"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            data = export()
            with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
                f.write(data)
            os.replace(f.name, path)                      # whole or not at all
        return path.read_bytes()


@cache
def _fingerprint() -> str:
    """The exporter's source (every module of SOURCES) and the export tools' versions."""
    digest = hashlib.sha256()
    for package in SOURCES:
        directory = Path(importlib.import_module(f"v4engine.{package}").__file__).parent
        for path in sorted(directory.rglob("*.py")):
            digest.update(path.relative_to(directory).as_posix().encode() + path.read_bytes())
    for tool in TOOLS:
        digest.update(importlib.metadata.version(tool).encode())
    return digest.hexdigest()


__all__ = ["FOLDER", "cached_export"]
