"""v4generate and Generator.from_engine_dir on good and bad engine directories."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hostile import without_tokenizer
from v4engine.contract.engine import EngineFormatError
from v4engine.runtime.generator import Generator


def v4generate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4engine.runtime.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("mixed", agree=0.05)[1]


def test_json_output(engine):
    result = v4generate(engine, "--prompt-ids", "3,4,5,6,7", "--max-new-tokens", "10", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) == 10
    assert set(out["metrics"]) >= {"drafted", "accepted", "acceptance_rate", "mean_acceptance_length",
                                   "per_position_acceptance", "verify_steps"}
    assert len(out["metrics"]["per_position_acceptance"]) == 3


def test_text_and_acceptance_table(engine):
    result = v4generate(engine, "--prompt-ids", "3,4,5", "--max-new-tokens", "6", "--mtp", "2")
    assert result.returncode == 0 and "mean acceptance length" in result.stdout


@pytest.mark.parametrize("args, needle", [
    (["--prompt-ids", ""], "empty"),
    (["--prompt-ids", "1,2,99999"], "vocabulary"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "1,2", "--mtp", "7"], "mtp"),
])
def test_bad_requests(engine, args, needle):
    one_line_error(v4generate(engine, *args), needle)


def test_a_text_prompt_needs_the_engines_tokenizer(engine, tmp_path):
    one_line_error(v4generate(without_tokenizer(engine, tmp_path / "e"), "--prompt", "hello"), "tokenizer")


def test_prompt_longer_than_max_seq_len(engine):
    ids = ",".join(["3"] * 5000)
    one_line_error(v4generate(engine, "--prompt-ids", ids), "at most")


@pytest.mark.parametrize("damage, needle", [
    ("missing", "not found"),
    ("corrupt", "not valid JSON"),
    ("version", "format_version"),
    ("graph", "target.onnx"),
])
def test_broken_engine_directories(engine, tmp_path, damage, needle):
    broken = Path(shutil.copytree(engine, tmp_path / "engine", symlinks=True))
    manifest = broken / "engine.json"
    if damage == "missing":
        manifest.unlink()
    elif damage == "corrupt":
        manifest.write_text(manifest.read_text()[:100])
    elif damage == "version":
        data = json.loads(manifest.read_text())
        data["format_version"] = 99
        manifest.write_text(json.dumps(data))
    else:
        (broken / "target.onnx").unlink()
    with pytest.raises(EngineFormatError, match=needle):
        Generator.from_engine_dir(broken)
    one_line_error(v4generate(broken, "--prompt-ids", "1,2"), needle)
