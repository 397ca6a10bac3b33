"""The text the shipped tiny V4 was trained on, and the text held out from it: Python's standard library.

examples/train_tiny.py trains on one part; benchmarks/bench_generate.py and the acceptance tests prompt with the
other, which the model never saw. The split is by a hash of each file's path, so it is the same everywhere.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, deterministic: one file in 16 is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held = [p for p in files if hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest().endswith("0")]
    return [p for p in files if p not in set(held)], held
