"""The engine directory format: `engine.json`, its schema, a validating reader and the writer.

The runtime owns what it loads (DESIGN.md), so the format lives here and the builder writes through it.
An engine directory holds engine.json, one ONNX graph per part (`target`, and `draft` when mtp > 0), the
weight files those graphs reference (`weights/`: links to the checkpoint's own files, plus one file of
converted tensors when some had to be converted) and the tokenizer files, if the checkpoint had them.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import CacheGroup, V4Config, read_json
from .errors import ConfigError, V4EngineError

FORMAT = "v4engine"
FORMAT_VERSION = 1
MANIFEST = "engine.json"
# Serving limits a build records in engine.json (build.*), and what they are when an engine does not say.
BUILT_LIMIT_DEFAULTS = {"max_batch": 8, "max_seq_len": 4096, "max_prefill_chunk": 512}
BACKENDS = ("onnxruntime", "tensorrt", "migraphx")


class EngineFormatError(V4EngineError):
    """engine.json is missing, unreadable, of another format version, or disagrees with the directory."""


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, element type and shape (ints, or names of dynamic dimensions)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorSpec":
        return cls(d["name"], d["dtype"], tuple(d["shape"]))


@dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphEntry":
        return cls(d["file"], tuple(TensorSpec.from_dict(x) for x in d["inputs"]),
                   tuple(TensorSpec.from_dict(x) for x in d["outputs"]))


@dataclass(frozen=True)
class WeightFile:
    """A file the graphs' external data points into. `link`: hardlink or symlink to `source`, or converted."""

    file: str
    bytes: int
    link: str
    source: str | None = None


def cache_group_dict(group: CacheGroup, kind: str) -> dict[str, Any]:
    """One cache group as engine.json lists it: the layer's kind, the row shape, and its bytes."""
    return {**asdict(group), "kind": kind, "fixed_bytes": group.fixed_bytes, "bytes_per_token": group.bytes_per_token}


@dataclass
class EngineManifest:
    """Everything engine.json says. `caches` holds, for target and draft, every cache group with its bytes."""

    model: V4Config
    backend: str
    mtp: int
    dtype: str
    graphs: dict[str, GraphEntry]
    caches: dict[str, list[dict[str, Any]]]
    weights: list[WeightFile]
    experts: str
    tokenizer: list[str] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)

    @property
    def limits(self) -> dict[str, int]:
        """The serving limits the engine was built for (engine.json build; an engine without them, the defaults)."""
        return {name: int(self.build.get(name, default)) for name, default in BUILT_LIMIT_DEFAULTS.items()}

    # ------------------------------------------------------------------ cache accounting
    def cache_groups(self, part: str) -> list[CacheGroup]:
        keys = ("layer", "name", "width", "value_bytes", "rows_fixed", "ratio")     # the rest is derived
        return [CacheGroup(**{k: g[k] for k in keys}) for g in self.caches[part]]

    # ------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        totals = {part: {"bytes_per_token": sum(g["bytes_per_token"] for g in groups),
                         "fixed_bytes_per_sequence": sum(g["fixed_bytes"] for g in groups)}
                  for part, groups in self.caches.items()}
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": self.model.to_dict(), "backend": self.backend, "mtp": self.mtp, "dtype": self.dtype,
            "graphs": {name: {"file": g.file, "inputs": [asdict(s) for s in g.inputs],
                              "outputs": [asdict(s) for s in g.outputs]} for name, g in self.graphs.items()},
            "caches": {"groups": self.caches, "totals": totals},
            "weights": {"files": [asdict(w) for w in self.weights], "experts": self.experts},
            "tokenizer": self.tokenizer, "checkpoint": self.checkpoint, "tools": self.tools, "build": self.build,
        }

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    # ------------------------------------------------------------------ reading
    @classmethod
    def read(cls, directory: str | Path) -> "EngineManifest":
        """Read and validate DIR/engine.json; every failure names the file and what is wrong."""
        directory = Path(directory)
        path = directory / MANIFEST
        raw = read_json(path, EngineFormatError, f"not found (is {directory} an engine directory built by v4build?)")
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise EngineFormatError(f"{path}: not a v4engine manifest (field 'format' must be '{FORMAT}')")
        if raw.get("format_version") != FORMAT_VERSION:
            raise EngineFormatError(f"{path}: format_version {raw.get('format_version')!r} is not supported by this "
                                    f"runtime (it reads version {FORMAT_VERSION}); rebuild the engine with v4build")
        try:
            model = V4Config.from_dict(raw["model"], source=f"{path} (model)")
            manifest = cls(
                model=model, backend=raw["backend"], mtp=int(raw["mtp"]), dtype=raw["dtype"],
                graphs={name: GraphEntry.from_dict(g) for name, g in raw["graphs"].items()},
                caches=raw["caches"]["groups"],
                weights=[WeightFile(**w) for w in raw["weights"]["files"]], experts=raw["weights"]["experts"],
                tokenizer=list(raw.get("tokenizer", [])), checkpoint=raw.get("checkpoint", {}),
                tools=raw.get("tools", {}), build=raw.get("build", {}))
        except ConfigError as e:
            raise EngineFormatError(str(e)) from None
        except (KeyError, TypeError, ValueError) as e:
            raise EngineFormatError(f"{path}: field {e} is missing or malformed") from None
        manifest._check_directory(directory, path)
        return manifest

    def _check_directory(self, directory: Path, path: Path) -> None:
        if self.backend not in BACKENDS:
            raise EngineFormatError(f"{path}: field 'backend' must be one of {BACKENDS} (got {self.backend!r})")
        if "target" not in self.graphs or (self.mtp > 0) != ("draft" in self.graphs):
            raise EngineFormatError(f"{path}: field 'graphs' must hold 'target', and 'draft' exactly when mtp > 0")
        if set(self.caches) != set(self.graphs):
            raise EngineFormatError(f"{path}: field 'caches' must have one entry per graph ({sorted(self.graphs)})")
        for entry in [*self.graphs.values(), *self.weights]:
            file = directory / entry.file
            if not file.exists():
                raise EngineFormatError(f"{path}: {entry.file} is missing from {directory}")
        for w in self.weights:
            size = os.stat(directory / w.file).st_size
            if size != w.bytes:
                raise EngineFormatError(f"{path}: {w.file} has {size} bytes, engine.json says {w.bytes} "
                                        "(the checkpoint changed after the build?)")
