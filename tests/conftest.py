"""Shared fixtures: tiny checkpoints are made once per test session (per xdist worker) and reused."""
from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run interpreted, which must be chosen before triton is first imported
# (import torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from v4engine.builder.tiny import TINY_CONFIGS, make_tiny

TINY = sorted(TINY_CONFIGS)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(config, **options) -> folder; each distinct request is written once."""
    made: dict[tuple, Path] = {}

    def make(config: str = "mixed", **options) -> Path:
        key = (config, tuple(sorted(options.items())))
        if key not in made:
            name = "-".join([config] + [f"{k}={v}" for k, v in sorted(options.items())])
            made[key] = make_tiny(tmp_path_factory.mktemp("ckpt") / name, config=config, **options)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint, tmp_path_factory):
    """tiny_engine(config, mtp=3, **checkpoint options) -> (checkpoint folder, engine folder), built once.

    Checkpoints use transformers' names so that the same folder also feeds the transformers oracle."""
    from v4engine.builder.build import BuildOptions, build

    made: dict[tuple, tuple[Path, Path]] = {}

    def make(config: str = "mixed", mtp: int = 3, **options) -> tuple[Path, Path]:
        key = (config, mtp, tuple(sorted(options.items())))
        if key not in made:
            checkpoint = tiny_checkpoint(config, names="hf", **options)
            out = tmp_path_factory.mktemp("engine") / config
            build(BuildOptions(checkpoint=checkpoint, output=out, mtp=mtp, progress=False))
            made[key] = (checkpoint, out)
        return made[key]

    return make


TRAINED = Path(__file__).resolve().parent.parent / "examples" / "tiny-v4"


@pytest.fixture(scope="session")
def trained_engine(tmp_path_factory) -> Path:
    """The shipped trained tiny V4 (examples/tiny-v4) built with --mtp 3, once per session (per xdist worker)."""
    from v4engine.builder.build import BuildOptions, build

    out = tmp_path_factory.mktemp("trained") / "engine"
    build(BuildOptions(checkpoint=TRAINED, output=out, mtp=3, progress=False))
    return out


@pytest.fixture
def engine_copy(tiny_engine, tmp_path) -> Path:
    """A copy of a good tiny engine (config mixed, --mtp 3) for a test to damage or attack."""
    import shutil

    return Path(shutil.copytree(tiny_engine("mixed")[1], tmp_path / "engine", symlinks=True))


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside the folders under attack, whose bytes no output may show (hostile.SECRET)."""
    from hostile import canary

    return canary(tmp_path / "outside")
