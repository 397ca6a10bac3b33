"""Folders that appear whole or not at all: engines, model repositories, checkpoints.

Everything is written into a temporary sibling of the destination, which is renamed into place only
when the block succeeds. An error or Ctrl-C in the middle leaves no half-written output.
"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(out: Path, tag: str) -> Iterator[Path]:
    """Yield `.{out.name}.{tag}-XXXX` beside `out`; on success it replaces `out` (world-readable)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)                                  # mkdtemp made it private
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
