"""What the attack tests (test_attack_*.py) share: running a command line, the one-line-error verdict, a record of
every file a block of code opens, and snapshots of folders that must not change."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from v4engine.builder.export_cache import FOLDER as EXPORT_CACHE

SECRET = b"v4engine-canary: nobody may read this\n" * 4


def cli(module: str, *args, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args...`, its output captured."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def v4build(*args, **kw) -> subprocess.CompletedProcess:
    return cli("v4engine.builder.cli", *args, **kw)


def v4generate(*args, **kw) -> subprocess.CompletedProcess:
    return cli("v4engine.runtime.cli", *args, **kw)


def assert_one_line(result: subprocess.CompletedProcess, *needles: str, status: int = 1) -> str:
    """The command failed with `status` and said why in exactly one line on stderr, holding every needle."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status, (result.returncode, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def env_without_export_cache() -> dict[str, str]:
    """This process's environment, less the export cache (tests/conftest.py): a build then exports again, tens of
    seconds in which a signal surely finds it inside its export."""
    return {k: v for k, v in os.environ.items() if k != EXPORT_CACHE}


def without_tokenizer(engine: Path, folder: Path) -> Path:
    """A copy of `engine` at `folder` without its tokenizer, as built from a checkpoint that ships none."""
    copy = Path(shutil.copytree(engine, folder, symlinks=True))
    manifest = json.loads((copy / "engine.json").read_text())
    for name in manifest["tokenizer"]:
        (copy / name).unlink()
    (copy / "engine.json").write_text(json.dumps({**manifest, "tokenizer": []}))
    return copy


def canary(folder: Path, name: str = "secret.txt") -> Path:
    """A file outside the folders under attack, holding bytes no output may show."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(SECRET)
    return path


def assert_never_shown(result: subprocess.CompletedProcess) -> None:
    text = result.stdout + result.stderr
    assert SECRET[:24].decode() not in text
    assert str(int.from_bytes(SECRET[:8], "little")) not in text, "the canary's first 8 bytes, read as a length"


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under `folder` with its size and modification time (links not followed)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            st = os.lstat(Path(root) / name)
            out[str(Path(root, name).relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


_opened: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextmanager
def files_opened() -> Iterator[list[str]]:
    """Every path Python opens in the block (open(), os.open(), memory maps of files), as given to the call."""
    record: list[str] = []
    _opened.append(record)
    try:
        yield record
    finally:
        _opened.remove(record)
