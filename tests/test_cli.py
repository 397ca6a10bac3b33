"""`v4build` on bad input: one clear line naming the file, tensor or field at fault, and a non-zero exit."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from v4engine.builder.tiny import make_tiny


def v4build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4engine.builder.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    """A fresh, writable copy of the tiny checkpoint, to break."""
    return Path(shutil.copytree(tiny_checkpoint("mixed"), tmp_path / "ckpt"))


def shard(folder: Path, i: int = 0) -> Path:
    return sorted(folder.glob("*.safetensors"))[i]


def test_a_good_checkpoint_checks_out(checkpoint):
    result = v4build("check", "--checkpoint", checkpoint, "--mtp", "3")
    assert result.returncode == 0, result.stderr
    assert "draft module: mtp" in result.stdout


def test_missing_shard(checkpoint):
    missing = shard(checkpoint, 1)
    missing.unlink()
    assert_one_line_error(v4build("check", "--checkpoint", checkpoint), missing.name)


def test_truncated_safetensors_file(checkpoint):
    path = shard(checkpoint, 0)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    assert_one_line_error(v4build("check", "--checkpoint", checkpoint), path.name)


def test_tensor_shape_that_disagrees_with_config(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["q_lora_rank"] += 8
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_one_line_error(v4build("check", "--checkpoint", checkpoint), "wq_a", "config.json")


def test_unknown_dtype(checkpoint):
    path = shard(checkpoint, 0)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    victim = next(k for k in header if k != "__metadata__")
    header[victim]["dtype"] = "F9"
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    path.write_bytes(data[:8] + text + data[8 + n:])
    assert_one_line_error(v4build("check", "--checkpoint", checkpoint), victim, "F9")


def test_missing_mtp_weights_when_mtp_is_requested(tmp_path):
    folder = make_tiny(tmp_path / "no-mtp", mtp=False)
    assert_one_line_error(v4build("check", "--checkpoint", folder, "--mtp", "2"), "mtp.0")
    assert v4build("check", "--checkpoint", folder, "--mtp", "0").returncode == 0


@pytest.mark.parametrize("field, value", [("sliding_window", 0), ("num_experts_per_tok", 99),
                                          ("o_groups", 7), ("rms_norm_eps", -1.0)])
def test_config_field_out_of_range(checkpoint, field, value):
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_one_line_error(v4build("check", "--checkpoint", checkpoint), "config.json", field)


def test_help_explains_every_flag():
    for args, flags in ((["--help"], ["--checkpoint", "--output", "--mtp", "--backend", "--dtype", "--max-batch",
                                      "--max-seq-len", "--force"]),
                        (["make-tiny", "--help"], ["--quantize", "--names", "--config"]),
                        (["check", "--help"], ["--checkpoint", "--mtp"])):
        result = v4build(*args)
        assert result.returncode == 0 and "usage" in result.stdout
        assert all(flag in result.stdout for flag in flags)


def test_every_flag_of_every_command_and_script_says_what_it_does():
    """Read from the source, so a benchmark or example script no test runs is held to it too: each
    `add_argument` names a help text (argparse prints a flag without one as its bare name)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    sources = [p for p in root.rglob("*.py")
               if not any(part.startswith(".") or part == "tests" for part in p.relative_to(root).parts)]
    silent = [f"{path.relative_to(root)}:{node.lineno}"
              for path in sources for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
              and "help" not in {k.arg for k in node.keywords}]
    assert len(sources) > 100 and not silent, silent


@pytest.mark.parametrize("config", ["mixed", "flash_like", "slice"])
def test_make_tinys_tokenizer_holds_every_id_the_model_can_write(config):
    """Ids past the characters are reserved special tokens: the engine's postprocessing and every decoder take
    any id the model writes (the README's Triton chain on a make-tiny engine failed on id 210 of 256)."""
    from tokenizers import Tokenizer

    from v4engine.builder.tiny import CONFIGS, character_tokenizer

    vocab = CONFIGS[config]["vocab_size"]
    tokenizer = Tokenizer.from_str(character_tokenizer(vocab))
    assert tokenizer.get_vocab_size() == vocab
    assert tokenizer.decode([tokenizer.token_to_id("a"), vocab - 1, tokenizer.token_to_id("b")]) == "ab"
    assert tokenizer.encode("def f(x):\n", add_special_tokens=False).tokens == list("def f(x):\n")
