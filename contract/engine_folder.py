"""An engine directory as a trust boundary: what the runtime reads from one, and how.

Engine folders come from elsewhere (a colleague's build, a download, a shared disk), so the runtime reads only
- files that engine.json names, by normalised relative paths that stay inside the folder once every link is
  resolved;
- the checkpoint files a build linked to: `weights/` holds symlinks into the checkpoint when the engine was built
  onto another filesystem. Such a link must point exactly where engine.json says the build pointed it, at a file
  that looks like a checkpoint file before a byte of it is read (*.safetensors or a Hugging Face cache blob, of the
  recorded size), whose safetensors header is the one the build saw (its SHA-256, recorded at build time);
- inside an ONNX graph, external data only in the main graph's initializers (where ONNX Runtime takes the bytes
  from the memory maps given to it; elsewhere, in subgraphs or sparse tensors, it would open the location
  itself), only in those weight files, at offsets inside them (past the safetensors header of a checkpoint file).
Each file is opened here once, checked as the file it is (a regular file, whose real path is read back from the
open descriptor) and handed on as bytes or a read-only memory map, so that ONNX Runtime and TensorRT never open a
path themselves (MIGraphX's loader takes only a path: its programs are checked here first, then opened by it).
Anything else is refused in one line (EngineFormatError).
"""
from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import V4EngineError
from .untrusted import HeaderError, in_blob_store, open_regular, read_header, shown

if TYPE_CHECKING:
    from .engine import GraphEntry

MANIFEST = "engine.json"
# The largest file of each kind the runtime reads whole (graphs are read whole; weights are only mapped)
MAX_BYTES = {"manifest": 64 << 20, "graph": 2 << 30, "tokenizer": 256 << 20, "compiled": 64 << 30}
MAX_WEIGHT_FILES = 4097          # each is mapped (a file descriptor): a checkpoint's shards and converted.bin


class EngineFormatError(V4EngineError):
    """engine.json is missing, unreadable, of another format version, or disagrees with the directory."""


@dataclass(frozen=True)
class WeightFile:
    """A file the graphs' external data points into. `link`: hardlink or symlink to `source`, or converted.

    `header_sha256` fingerprints a linked checkpoint file (its safetensors header), so that the runtime reads
    only the file the build linked."""

    file: str
    bytes: int
    link: str
    source: str | None = None
    header_sha256: str | None = None


@dataclass(frozen=True)
class OpenedFile:
    """Which file a weight file of engine.json was when the checks opened it: where (resolved) and its identity, so
    that a reader opening it again (the embedding's rows: runtime/sessions/stored_weights.py) can tell it is still
    the same file."""

    path: Path
    device: int
    inode: int
    bytes: int


@dataclass(frozen=True)
class MappedWeights:
    """The weight files a graph may reference: location -> read-only map (bytes), and the first byte a graph may
    read there (past a safetensors header); and each file as it was opened."""

    maps: dict[str, np.ndarray]
    data_start: dict[str, int]
    _mmaps: dict[Path, mmap.mmap]             # by the file's path as the engine names it
    opened: dict[str, OpenedFile] = field(default_factory=dict)

    def release_pages(self) -> None:
        """Drop the resident pages of the maps (after a backend copied or prepacked what it needs): they are
        clean file pages, read again from the file if a backend still uses them in place."""
        for m in self._mmaps.values():
            m.madvise(mmap.MADV_DONTNEED)

    def check_intact(self) -> None:
        """EngineFormatError if a weight file is now shorter than its map: a page past the file's new end cannot be
        read, and the kernel would end the process with SIGBUS at the engine's next read of it. (A file cut
        during a call is beyond any check: docs/security.md.)"""
        for path, m in self._mmaps.items():
            if m.size() < len(m):
                raise EngineFormatError(f"{path}: now {m.size()} bytes, less than the {len(m)} mapped when the "
                                        "engine opened: truncated under the running engine; open it again")


class EngineFolder:
    """One engine directory, and every way the runtime may read from it (see the module doc)."""

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
        """A relative path in its one normal spelling (no `..`, `.`, `//`): two spellings never name one file."""
        if not isinstance(relative, str) or not relative or "\0" in relative or "\\" in relative:
            raise EngineFormatError(f"{self.manifest_path}: field {field} must be a relative path inside the engine "
                                    f"folder (got {shown(relative)})")
        pure = PurePosixPath(relative)
        if pure.is_absolute() or ".." in pure.parts or str(pure) != relative:
            raise EngineFormatError(f"{self.manifest_path}: field {field} names {shown(relative)}, which is not a "
                                    "normal path inside the engine folder; refused")
        return pure

    def exists(self, relative: str) -> bool:
        """Whether the folder holds `relative` (a fixed name of ours, e.g. tokenizer.json), wherever it leads."""
        return os.path.lexists(self.root / relative)

    def weight_path(self, w: WeightFile, field: str) -> Path:
        """Where a weight file of engine.json resolves: inside the folder, or exactly to the checkpoint file its
        symlink recorded at build time, which must look like one before a byte of it is read (a regular file of
        the recorded size, named *.safetensors or a blob of a Hugging Face cache); its header is checked when it
        is opened (map_weights)."""
        pure = self._relative(w.file, f"{field}.file")
        resolved = (self.root / pure).resolve()
        if resolved.is_relative_to(self.root):
            return resolved
        if not (w.link == "symlink" and isinstance(w.source, str) and resolved == Path(w.source)):
            raise EngineFormatError(f"{self.directory / pure}: leads outside the engine folder (to {resolved}), "
                                    "not to the checkpoint file the build linked; refused")
        named = resolved.suffix == ".safetensors" or in_blob_store(resolved)
        if not named or not resolved.is_file() or resolved.stat().st_size != w.bytes:
            raise EngineFormatError(f"{self.directory / pure}: links to {resolved}, which is not a checkpoint file "
                                    f"of {w.bytes} bytes (*.safetensors); refused")
        return resolved

    # ------------------------------------------------------------------ reading
    def read_bytes(self, relative: object, field: str, kind: str) -> bytes:
        """The whole file named at `field`, at most MAX_BYTES[kind] long."""
        path = self.path(relative, field)
        fd = self._open_bounded(path, kind)
        try:
            with open(fd, "rb", closefd=False) as f:
                return f.read(os.fstat(fd).st_size)             # bounded by _open_bounded
        finally:
            os.close(fd)

    def checked_path(self, relative: object, field: str, kind: str) -> Path:
        """The path of the file named at `field`, checked as read_bytes checks it, for a backend whose loader takes
        only a path (MIGraphX): the file could still be swapped between this check and that loader's open."""
        path = self.path(relative, field)
        os.close(self._open_bounded(path, kind))
        return path

    def _open_bounded(self, path: Path, kind: str) -> int:
        fd = self._open(path, path)
        size = os.fstat(fd).st_size
        if size > MAX_BYTES[kind]:
            os.close(fd)
            raise EngineFormatError(f"{path}: {size} bytes, more than a {kind} file may have ({MAX_BYTES[kind]}); "
                                    "refused")
        return fd

    def map_weights(self, weights: list[WeightFile]) -> MappedWeights:
        """Every weight file of engine.json as a read-only memory map, after the checks of the module doc."""
        if len(weights) > MAX_WEIGHT_FILES:
            raise EngineFormatError(f"{self.manifest_path}: lists {len(weights)} weight files, more than "
                                    f"{MAX_WEIGHT_FILES}; refused")
        maps, starts, mmaps, opened = {}, {}, {}, {}
        for i, w in enumerate(weights):
            path = self.weight_path(w, f"weights.files[{i}]")
            fd = self._open(path, self.directory / w.file)
            try:
                starts[w.file] = self._check_weight(fd, w, self.directory / w.file)
                status = os.fstat(fd)
                opened[w.file] = OpenedFile(path, status.st_dev, status.st_ino, status.st_size)
                mmaps[self.directory / w.file] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                maps[w.file] = np.frombuffer(mmaps[self.directory / w.file], dtype=np.uint8)
            except OSError as e:
                raise EngineFormatError(f"{self.directory / w.file}: cannot be mapped ({e.strerror})") from None
            finally:
                os.close(fd)
        return MappedWeights(maps, starts, mmaps, opened)

    def _check_weight(self, fd: int, w: WeightFile, display: Path) -> int:
        """Size and, for a checkpoint file, its safetensors header fingerprint; returns where its data start."""
        size = os.fstat(fd).st_size
        if size != w.bytes or size == 0:
            raise EngineFormatError(f"{display}: has {size} bytes, engine.json says {w.bytes} (the checkpoint changed "
                                    "after the build?)")
        if w.link == "converted":
            return 0
        try:
            header = read_header(fd)
        except HeaderError as e:
            raise EngineFormatError(f"{display}: {e}; refused") from None
        if header.sha256 != w.header_sha256:
            raise EngineFormatError(f"{display}: its safetensors header is not the one the build linked (SHA-256 "
                                    "differs from engine.json); the checkpoint changed after the build?")
        return header.data_start

    def _open(self, path: Path, display: Path) -> int:
        """A descriptor of `path`: a regular file, and (where /proc tells) the very file the checks resolved."""
        fd = open_regular(path, EngineFormatError, display)
        opened = _opened_path(fd)
        if opened is not None and opened != path:
            os.close(fd)
            raise EngineFormatError(f"{display}: changed while it was opened (now {opened}); refused")
        return fd


def _opened_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


# ---------------------------------------------------------------------- graphs
def external_tensors(proto: Any) -> Iterator[tuple[Any, bool]]:
    """(tensor, whether it is an initializer of the main graph) for every TensorProto of an ONNX model whose bytes
    live outside it: a walk over every message field (subgraphs, functions, sparse tensors, attributes), so no
    place is forgotten."""
    from onnx import GraphProto, ModelProto, TensorProto

    stack = [(proto, False)]                    # (message, whether it is the model's own graph)
    while stack:
        message, main_graph = stack.pop()
        for descriptor, value in message.ListFields():
            if descriptor.type != descriptor.TYPE_MESSAGE:
                continue
            for item in value if descriptor.is_repeated else (value,):
                if isinstance(item, TensorProto):
                    if item.data_location == TensorProto.EXTERNAL:
                        yield item, main_graph and descriptor.name == "initializer"
                else:
                    stack.append((item, isinstance(message, ModelProto) and isinstance(item, GraphProto)))


def check_external_data(proto: Any, weights: MappedWeights, graph: Path) -> None:
    """Every external tensor of `proto` is a main-graph initializer reading inside one of the engine's weight files,
    past its header."""
    from onnx.external_data_helper import ExternalDataInfo

    for tensor, in_main_graph in external_tensors(proto):
        where = f"{graph}: tensor {shown(tensor.name)}"
        if not in_main_graph:
            raise EngineFormatError(f"{where} has external data outside the main graph's initializers (a subgraph, "
                                    "a sparse tensor or an attribute), which v4build never writes; refused")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")             # unknown keys: ONNX Runtime reads only these three
                info = ExternalDataInfo(tensor)
        except ValueError:
            info = None
        if info is None or info.length is None:
            raise EngineFormatError(f"{where} has no valid offset and length for its external data")
        location, offset, length = info.location, info.offset or 0, info.length
        if location not in weights.maps:
            raise EngineFormatError(f"{where} reads from {shown(location)}, which is not a weight file of "
                                    "engine.json; refused")
        size = weights.maps[location].nbytes
        if offset < weights.data_start[location] or length < 0 or offset + length > size:
            raise EngineFormatError(f"{where} reads bytes [{offset}, {offset + length}) of {location}, outside its "
                                    f"data [{weights.data_start[location]}, {size}); refused")


ELEMENT_TYPES = {"float32": 1, "int64": 7, "float16": 10, "bfloat16": 16}     # onnx.TensorProto's numbers


def read_graph(folder: EngineFolder, entry: GraphEntry, weights: MappedWeights) -> bytes:
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
        want = [(s.name, ELEMENT_TYPES.get(s.dtype), tuple(d if isinstance(d, int) else None for d in s.shape))
                for s in expected]
        if got != want:
            first = next((g[0] for g, w in zip(got, want) if g != w), f"{len(got)} {kind}s, not {len(want)}")
            raise EngineFormatError(f"{path}: its {kind}s are not those engine.json gives (first difference: "
                                    f"{shown(first)}); refused")
    return data
