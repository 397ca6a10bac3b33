"""Reading files we did not write: checkpoint folders, engine folders, JSON from anywhere. Every failure is one line.

- `open_regular`: a descriptor of a regular file (never a FIFO that would block, a device, a folder).
- `read_header`: the header of a safetensors file, bounded, parsed before anything else of the file is trusted.
  Its SHA-256 is the fingerprint an engine records of each checkpoint file it links. No message quotes the file's
  bytes: the length word of /etc/passwd is eight characters of that file.
- `parse_json`, `read_json`, `JsonFields`: `json.loads` alone raises RecursionError on deep nesting, and code that
  indexes the result raises KeyError, TypeError or AttributeError on a field of the wrong type; these turn each of
  those into the caller's error class with a message naming the file and the field, quoting at most a short piece
  of the value (`shown`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def open_regular(path: Path, error: type[Exception], shown_as: Path | str | None = None) -> int:
    """A read-only descriptor of `path`, which must be a regular file (opened without blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{shown_as or path}: cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{shown_as or path}: not a regular file; refused")
    return fd


def in_blob_store(path: Path) -> bool:
    """Whether `path` (resolved) is a blob of a Hugging Face cache (`.../models--ORG--NAME/blobs/HASH`): the files
    of a cache snapshot, and of a `--local-dir` download made by older huggingface-cli, are links there."""
    return path.parent.name == "blobs" and path.parent.parent.name.startswith("models--")


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of another library's error message (its name when it has none), cut to `limit`."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]


# ---------------------------------------------------------------------- safetensors headers
MAX_HEADER_BYTES = 100_000_000        # the safetensors library's own limit


class HeaderError(ValueError):
    """Not a safetensors file: the message says why, without quoting the file's bytes."""


@dataclass(frozen=True)
class SafetensorsHeader:
    raw: bytes                        # the JSON bytes, as stored
    entries: dict[str, Any]           # the parsed JSON object
    data_start: int                   # absolute offset of the first data byte (8 + len(raw))
    file_bytes: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()


def read_header(fd: int) -> SafetensorsHeader:
    """Parse the header of the open file `fd` (read with pread: the file offset is left alone)."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise HeaderError(f"too short for a safetensors file ({size} bytes)")
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise HeaderError(f"not a safetensors file: its header length does not fit the file's {size} bytes")
    raw = os.pread(fd, length, 8)
    try:
        entries = json.loads(raw)
    except (ValueError, RecursionError):
        raise HeaderError("not a safetensors file: its header is not valid JSON") from None
    if not isinstance(entries, dict):
        raise HeaderError("not a safetensors file: its header is not a JSON object")
    return SafetensorsHeader(raw, entries, 8 + length, size)


# ---------------------------------------------------------------------- JSON
MISSING: Any = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "a JSON object",
               list: "a JSON list", type(None): "null"}


def _described(kinds: tuple[type, ...]) -> str:
    if int in kinds and float in kinds:
        kinds = tuple(k for k in kinds if k is not int)          # an integer is a number
    return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def shown(value: object, limit: int = 80) -> str:
    """A value from an untrusted file, quoted and cut short for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_json(data: bytes | str, path: Path | str, error: type[Exception]) -> Any:
    """JSON from an untrusted file: bad UTF-8, bad JSON or nesting too deep is `error` naming the file."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise error(f"{path}: not valid JSON ({why})") from None


def read_json(path: Path, error: type[Exception], missing: str, limit: int = 64 << 20) -> Any:
    """The parsed JSON file (at most `limit` bytes), or `error` with one line naming the file."""
    if not path.is_file():
        raise error(f"{path}: {missing}")
    size = path.stat().st_size
    if size > limit:
        raise error(f"{path}: {size} bytes, more than the {limit} a JSON file of ours may have")
    return parse_json(path.read_bytes(), path, error)


class JsonFields:
    """Typed access to one JSON object: a field that is missing or of another type is one line naming it.

    Numbers: `number` takes ints and floats (never true/false); `integer` only ints; both check a range."""

    def __init__(self, raw: Any, source: str, error: type[Exception], prefix: str = ""):
        if not isinstance(raw, dict):
            raise error(f"{source}: {'field ' + repr(prefix.rstrip('.')) if prefix else 'the file'} must be a "
                        f"JSON object (got {shown(raw)})")
        self.raw, self.source, self.error, self.prefix = raw, source, error, prefix

    def fail(self, key: str, why: str, value: Any) -> None:
        raise self.error(f"{self.source}: field '{self.prefix}{key}' {why} (got {shown(value)})")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = MISSING) -> Any:
        if key not in self.raw or (self.raw[key] is None and default is not MISSING):
            if default is MISSING:
                raise self.error(f"{self.source}: field '{self.prefix}{key}' is missing")
            return default
        value = self.raw[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            self.fail(key, f"must be {_described(kinds)}", value)
        return value

    def integer(self, key: str, low: int, high: int, default: Any = MISSING) -> int | None:
        value = self.get(key, int, default)
        if value is None:               # absent, and None is the default
            return None
        if not low <= value <= high:
            self.fail(key, f"must be an integer from {low} to {high}", value)
        return value

    def number(self, key: str, low: float = -math.inf, high: float = math.inf, default: Any = MISSING) -> float:
        """A number as a float; an integer too large for one, or one outside [low, high] if that is given (NaN
        included), is refused."""
        value = self.get(key, (int, float), default)
        try:
            value = float(value)
        except OverflowError:
            self.fail(key, "is too large for a number", value)
        if (low, high) != (-math.inf, math.inf) and not low <= value <= high:     # NaN fails the comparison
            self.fail(key, f"must be a number from {low} to {high}", value)
        return value

    def choice(self, key: str, choices: tuple, default: Any = MISSING) -> Any:
        value = self.raw.get(key, default)
        if value is MISSING:
            raise self.error(f"{self.source}: field '{self.prefix}{key}' is missing")
        if isinstance(value, bool) or value not in choices:
            self.fail(key, f"must be one of {choices}", value)
        return value

    def items(self, key: str, kind: type, default: Any = MISSING, most: int = 1 << 20) -> list | None:
        """A JSON list whose every entry is `kind`, at most `most` long."""
        values = self.get(key, list, default)
        if values is None:
            return None
        if len(values) > most:
            self.fail(key, f"must have at most {most} entries", len(values))
        for value in values:
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                self.fail(key, f"entries must each be {_described((kind,))}", value)
        return values

    def nested(self, key: str, default: Any = MISSING) -> "JsonFields":
        return JsonFields(self.get(key, dict, default), self.source, self.error, f"{self.prefix}{key}.")
