"""Shared fixtures: tiny checkpoints are made once per test session (per xdist worker) and reused."""
from __future__ import annotations

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
