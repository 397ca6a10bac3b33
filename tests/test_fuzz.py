"""Bounded fuzzing of the three untrusted formats: safetensors headers, config.json and engine.json.

Each example is either read or refused with the reader's own one-line error (CheckpointError, ConfigError,
EngineFormatError); anything else (a traceback) fails the test, and so does any example that allocates more than
1 GB (Python and numpy allocations, traced). The example budget is fixed and the search derandomized, so a run
is repeatable in CI."""
from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from v4engine.builder.checkpoint import SAFETENSORS_DTYPES, Checkpoint, CheckpointError
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.contract.config import V4Config
from v4engine.contract.drafting import MTP
from v4engine.contract.engine import EngineFormatError, EngineManifest
from v4engine.contract.errors import ConfigError
from v4engine.contract.layout import CacheLayout

LIMIT = 1 << 30
BUDGET = settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# JSON values of every kind, with sizes and numbers at the edges
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**9, 10**12]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)


def bounded(read, *args) -> Any:
    """Run `read`; fail on more than LIMIT bytes allocated; return what it returned or the error it raised."""
    tracemalloc.start()
    try:
        return read(*args)
    except (CheckpointError, ConfigError, EngineFormatError) as refused:
        assert "\n" not in str(refused), str(refused)
        return refused
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < LIMIT, f"{peak / 2**30:.1f} GiB allocated"


def mutate(document: Any, path: list, value: Any) -> Any:
    """`document` with the value at `path` (indices into nested dicts and lists, taken modulo) replaced."""
    if not path or not isinstance(document, (dict, list)) or not document:
        return value
    keys = list(document) if isinstance(document, dict) else list(range(len(document)))
    key = keys[path[0] % len(keys)]
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[key] = mutate(document[key], path[1:], value)
    return copy


# ---------------------------------------------------------------------- safetensors headers
entries = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(sorted(SAFETENSORS_DTYPES)), json_values),
    "shape": st.one_of(st.lists(st.integers(min_value=-2, max_value=2**40), max_size=4), json_values),
    "data_offsets": st.one_of(st.lists(st.integers(min_value=-2, max_value=2**40), min_size=2, max_size=2),
                              json_values)})
headers = st.dictionaries(st.sampled_from(["embed.weight", "head.weight", "norm.weight", "__metadata__",
                                           "layers.0.attn.wq_a.weight", "mtp.0.e_proj.weight", "x" * 300]),
                          st.one_of(entries, json_values), max_size=5)


@BUDGET
@given(header=st.one_of(headers, json_values), declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
       data=st.binary(max_size=256))
def test_safetensors_headers(tmp_path, header, declared, data):
    folder = tmp_path / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text) if declared is None else declared)
                                               + text + data)
    bounded(Checkpoint.open, folder)


# ---------------------------------------------------------------------- config.json
@BUDGET
@given(config=st.sampled_from(sorted(TINY_CONFIGS)), path=st.lists(st.integers(0, 2**16), min_size=1, max_size=3),
       value=json_values)
def test_config_json(config, path, value):
    raw = mutate(TINY_CONFIGS[config], path, value)
    cfg = bounded(V4Config.from_dict, raw)
    if isinstance(cfg, V4Config):
        bounded(CacheLayout.target, cfg, 3)
        bounded(MTP.layout, cfg, 3)


# ---------------------------------------------------------------------- engine.json
@pytest.fixture(scope="module")
def engine(tiny_engine, tmp_path_factory) -> Path:
    return Path(shutil.copytree(tiny_engine("mixed")[1], tmp_path_factory.mktemp("fuzz") / "engine", symlinks=True))


@BUDGET
@given(path=st.lists(st.integers(0, 2**16), min_size=1, max_size=6), value=json_values)
def test_engine_json(engine, path, value):
    original = (engine / "engine.json").read_text()
    try:
        (engine / "engine.json").write_text(json.dumps(mutate(json.loads(original), path, value)))
        bounded(EngineManifest.read, engine)
    finally:
        (engine / "engine.json").write_text(original)
