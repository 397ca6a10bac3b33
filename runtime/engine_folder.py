"""An engine directory as a trust boundary: what the runtime reads from one, and how.

Engine folders come from elsewhere (a colleague's build, a download, a shared disk), so the runtime reads only
- files that engine.json names, by relative paths that stay inside the folder once every link is resolved;
- the checkpoint files a build linked to: `weights/` holds symlinks into the checkpoint when the engine was built
  onto another filesystem. Such a link must point exactly where engine.json says the build pointed it, at a
  safetensors file whose header is the one the build saw (its SHA-256, recorded at build time);
- inside an ONNX graph, external data only in those weight files, at offsets inside them (past the safetensors
  header of a checkpoint file).
Each file is opened here once, checked as the file it is (a regular file, whose real path is read back from the
open descriptor) and handed on as bytes or a read-only memory map, so that no backend opens a path by itself.
Anything else is refused in one line (EngineFormatError) before a byte of it is read.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from .errors import V4EngineError
from .untrusted import HeaderError, open_regular, read_header, shown

MANIFEST = "engine.json"
# The largest file of each kind the runtime reads whole (graphs are read whole; weights are only mapped)
MAX_BYTES = {"manifest": 64 << 20, "graph": 2 << 30, "tokenizer": 256 << 20, "compiled": 64 << 30}


class EngineFormatError(V4EngineError):
    """engine.json is missing, unreadable, of another format version, or disagrees with the directory."""


@dataclass(frozen=True)
class MappedWeights:
    """The weight files a graph may reference: location -> read-only map (bytes), and the first byte a graph may
    read there (past a safetensors header)."""

    maps: dict[str, np.ndarray]
    data_start: dict[str, int]
    _mmaps: list[mmap.mmap]

    def release_pages(self) -> None:
        """Drop the resident pages of the maps (after a backend copied or prepacked what it needs): they are
        clean file pages, read again from the file if a backend still uses them in place."""
        for m in self._mmaps:
            m.madvise(mmap.MADV_DONTNEED)


class EngineFolder:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        try:
            self.root = self.directory.resolve(strict=True)
        except OSError:
            raise EngineFormatError(f"{self.directory}: no such engine directory") from None
        if not self.root.is_dir():
            raise EngineFormatError(f"{self.directory}: not a folder")
        self.manifest_path = self.directory / MANIFEST

    # ------------------------------------------------------------------ paths
    def path(self, relative: object, field: str) -> Path:
        """The file that engine.json names at `field`, resolved; refused unless it stays inside the folder."""
        pure = self._relative(relative, field)
        resolved = (self.root / pure).resolve()
        if not resolved.is_relative_to(self.root):
            raise EngineFormatError(f"{self.directory / pure}: named by engine.json field {field}, leads outside "
                                    f"the engine folder (to {resolved}); refused")
        return resolved

    def _relative(self, relative: object, field: str) -> PurePosixPath:
        if not isinstance(relative, str) or not relative or "\0" in relative or "\\" in relative:
            raise EngineFormatError(f"{self.manifest_path}: field {field} must be a relative path inside the engine "
                                    f"folder (got {shown(relative)})")
        pure = PurePosixPath(relative)
        if pure.is_absolute() or ".." in pure.parts:
            raise EngineFormatError(f"{self.manifest_path}: field {field} names {shown(relative)}, which is not a "
                                    "path inside the engine folder; refused")
        return pure

    def exists(self, relative: str) -> bool:
        """Whether the folder holds `relative` (a fixed name of ours, e.g. tokenizer.json), wherever it leads."""
        return os.path.lexists(self.root / relative)

    # ------------------------------------------------------------------ reading
    def read_bytes(self, relative: object, field: str, kind: str) -> bytes:
        """The whole file named at `field`, at most MAX_BYTES[kind] long."""
        path = self.path(relative, field)
        fd = self._open(path, path)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_BYTES[kind]:
                raise EngineFormatError(f"{path}: {size} bytes, more than a {kind} file may have "
                                        f"({MAX_BYTES[kind]}); refused")
            with open(fd, "rb", closefd=False) as f:
                return f.read(size + 1)[:size]
        finally:
            os.close(fd)

    def weight_path(self, w, field: str) -> Path:
        """Where a weight file of engine.json resolves: inside the folder, or exactly to the checkpoint file its
        symlink recorded at build time. Such a file must look like one before a byte of it is read (a regular file
        of the recorded size, named *.safetensors or a blob of a Hugging Face cache); its header is checked when
        it is opened."""
        pure = self._relative(w.file, f"{field}.file")
        resolved = (self.root / pure).resolve()
        if resolved.is_relative_to(self.root):
            return resolved
        if not (w.link == "symlink" and isinstance(w.source, str) and resolved == Path(w.source)):
            raise EngineFormatError(f"{self.directory / pure}: leads outside the engine folder (to {resolved}), "
                                    "not to the checkpoint file the build linked; refused")
        named = resolved.suffix == ".safetensors" or (resolved.parent.name == "blobs"
                                                      and resolved.parent.parent.name.startswith("models--"))
        if not named or not resolved.is_file() or resolved.stat().st_size != w.bytes:
            raise EngineFormatError(f"{self.directory / pure}: links to {resolved}, which is not a checkpoint file "
                                    f"of {w.bytes} bytes (*.safetensors); refused")
        return resolved

    def map_weights(self, weights: list) -> MappedWeights:
        """Every weight file of engine.json as a read-only memory map, after the checks of the module doc."""
        maps, starts, mmaps = {}, {}, []
        for i, w in enumerate(weights):
            path = self.weight_path(w, f"weights.files[{i}]")
            fd = self._open(path, self.directory / w.file)
            try:
                starts[w.file] = self._check_weight(fd, w, self.directory / w.file)
                mmaps.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
                maps[w.file] = np.frombuffer(mmaps[-1], dtype=np.uint8)
            finally:
                os.close(fd)
        return MappedWeights(maps, starts, mmaps)

    def _check_weight(self, fd: int, w, shown: Path) -> int:
        """Size and, for a checkpoint file, its safetensors header fingerprint; returns where its data start."""
        size = os.fstat(fd).st_size
        if size != w.bytes or size == 0:
            raise EngineFormatError(f"{shown}: has {size} bytes, engine.json says {w.bytes} (the checkpoint changed "
                                    "after the build?)")
        if w.link == "converted":
            return 0
        try:
            header = read_header(fd)
        except HeaderError as e:
            raise EngineFormatError(f"{shown}: {e}; refused") from None
        if header.sha256 != w.header_sha256:
            raise EngineFormatError(f"{shown}: its safetensors header is not the one the build linked (SHA-256 "
                                    "differs from engine.json); the checkpoint changed after the build?")
        return header.data_start

    def _open(self, path: Path, shown: Path) -> int:
        """A descriptor of `path`: a regular file, and (where /proc tells) the very file the checks resolved."""
        fd = open_regular(path, EngineFormatError, shown)
        opened = _opened_path(fd)
        if opened is not None and opened != path:
            os.close(fd)
            raise EngineFormatError(f"{shown}: changed while it was opened (now {opened}); refused")
        return fd


def _opened_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def external_data(proto) -> Iterator:
    """Every TensorProto of an ONNX model whose bytes live outside it: initializers, sparse ones, node attributes,
    in subgraphs and functions too (a walk over every message field, so no place is forgotten)."""
    from onnx import TensorProto

    stack = [proto]
    while stack:
        message = stack.pop()
        for descriptor, value in message.ListFields():
            if descriptor.type != descriptor.TYPE_MESSAGE:
                continue
            for item in value if descriptor.is_repeated else (value,):
                if isinstance(item, TensorProto):
                    if item.data_location == TensorProto.EXTERNAL:
                        yield item
                else:
                    stack.append(item)


def check_external_data(proto, weights: MappedWeights, graph: Path) -> None:
    """Every external tensor of `proto` reads inside one of the engine's weight files, past its header."""
    for tensor in external_data(proto):
        keys = {e.key: e.value for e in tensor.external_data}
        location = keys.get("location")
        where = f"{graph}: initializer {shown(tensor.name)}"
        if location not in weights.maps:
            raise EngineFormatError(f"{where} reads from {shown(location)}, which is not a weight file of "
                                    "engine.json; refused")
        try:
            offset, length = int(keys.get("offset", "0")), int(keys["length"])
        except (KeyError, ValueError):
            raise EngineFormatError(f"{where} has no valid offset and length for its external data") from None
        size = weights.maps[location].nbytes
        if offset < weights.data_start[location] or length < 0 or offset + length > size:
            raise EngineFormatError(f"{where} reads bytes [{offset}, {offset + length}) of {location}, outside its "
                                    f"data [{weights.data_start[location]}, {size}); refused")


_ELEMENT_TYPES = {"float32": 1, "int64": 7, "float16": 10, "bfloat16": 16}     # onnx.TensorProto's numbers


def read_graph(folder: EngineFolder, entry, weights: MappedWeights) -> bytes:
    """The bytes of an ONNX graph of the engine, once they parse, read only the engine's weight files, and declare
    the inputs and outputs engine.json gives (what the runtime feeds and reads): names, element types, ranks and
    every fixed dimension (dynamic ones are named by the exporter)."""
    from google.protobuf.message import DecodeError
    from onnx import ModelProto

    data = folder.read_bytes(entry.file, "graphs.*.file", "graph")
    path = folder.directory / entry.file
    try:
        proto = ModelProto.FromString(data)
    except (DecodeError, RecursionError):
        raise EngineFormatError(f"{path}: not an ONNX model (truncated or damaged?)") from None
    check_external_data(proto, weights, path)
    for kind, declared, expected in (("input", proto.graph.input, entry.inputs),
                                     ("output", proto.graph.output, entry.outputs)):
        got = [(v.name, v.type.tensor_type.elem_type,
                tuple(d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim))
               for v in declared]
        want = [(s.name, _ELEMENT_TYPES.get(s.dtype), tuple(d if isinstance(d, int) else None for d in s.shape))
                for s in expected]
        if got != want:
            first = next((g[0] for g, w in zip(got, want) if g != w), f"{len(got)} {kind}s, not {len(want)}")
            raise EngineFormatError(f"{path}: its {kind}s are not those engine.json gives (first difference: "
                                    f"{shown(first)}); refused")
    return data
