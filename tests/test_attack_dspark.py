"""A checkpoint whose draft module is not V4's MTP layer: V4-Flash-0731 ships a three-block DSpark drafter under
mtp.0..2 (no e_proj, h_proj, enorm, hnorm; config keys dspark_*), which other engines half-load as MTP.
`--mtp K` refuses it in one line naming DSpark; `--mtp 0` builds its target, which generates exactly what the same
target weights generate without the drafter."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hostile import assert_one_line, v4build, v4generate

INDEX = "model.safetensors.index.json"
MTP_INPUTS = ("e_proj", "h_proj", "enorm", "hnorm")


def dspark_checkpoint(source: Path, out: Path) -> Path:
    """`source` with its mtp.0 layer turned into a DSpark-shaped drafter: three blocks, main_proj/main_norm,
    markov and confidence heads, dspark_* config keys, 3 draft layers in compress_ratios."""
    shutil.copytree(source, out)
    index = json.loads((out / INDEX).read_text())
    draft_file = index["weight_map"]["mtp.0.e_proj.weight"]
    tensors = load_file(out / draft_file)
    draft = {k: v for k, v in tensors.items() if not any(k.startswith(f"mtp.0.{p}.") for p in MTP_INPUTS)}
    block = {k[len("mtp.0."):]: v for k, v in draft.items() if k.startswith("mtp.0.")}
    for b in (1, 2):
        draft.update({f"mtp.{b}.{k}": v.clone() for k, v in block.items()})
    hidden = tensors["mtp.0.enorm.weight"].shape[0]
    draft |= {"mtp.0.main_proj.weight": torch.randn(hidden, 3 * hidden), "mtp.0.main_norm.weight": torch.ones(hidden),
              "mtp.2.markov_head.weight": torch.randn(16, hidden), "mtp.2.confidence_head.weight": torch.randn(1, hidden)}
    draft |= {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    save_file(draft, out / draft_file)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    index["weight_map"].update(dict.fromkeys((k for k in draft if k.startswith("mtp.")), draft_file))
    (out / INDEX).write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config.update(num_nextn_predict_layers=3, compress_ratios=config["compress_ratios"] + [0, 0],
                  dspark_block_size=5, dspark_noise_token_id=7, dspark_target_layer_ids=[1, 2, 3],
                  dspark_markov_rank=16)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    original = tiny_checkpoint("mixed")
    return original, dspark_checkpoint(original, tmp_path_factory.mktemp("dspark") / "ckpt")


@pytest.mark.parametrize("mtp", ["1", "3"])
def test_mtp_refuses_a_dspark_drafter_in_one_line(checkpoints, tmp_path, mtp):
    _, dspark = checkpoints
    result = v4build("--checkpoint", dspark, "--mtp", mtp, "--output", tmp_path / "engine", "--quiet")
    assert_one_line(result, "DSpark", "--mtp 0")
    assert not (tmp_path / "engine").exists()
    assert_one_line(v4build("check", "--checkpoint", dspark, "--mtp", mtp), "DSpark")


def test_mtp_0_builds_the_target_and_generates_what_the_same_target_does(checkpoints, tmp_path):
    original, dspark = checkpoints
    engines = {}
    for name, checkpoint in (("original", original), ("dspark", dspark)):
        engines[name] = tmp_path / name
        result = v4build("--checkpoint", checkpoint, "--mtp", "0", "--output", engines[name], "--quiet")
        assert result.returncode == 0, result.stderr
    checked = v4build("check", "--checkpoint", dspark, "--mtp", "0")
    assert checked.returncode == 0 and "draft module: other" in checked.stdout, checked.stderr
    tokens = {name: json.loads(v4generate(e, "--prompt-ids", "3,4,5,6", "--ignore-eos", "--json").stdout)["token_ids"]
              for name, e in engines.items()}
    assert tokens["dspark"] == tokens["original"]
    assert json.loads((engines["dspark"] / "engine.json").read_text())["model"]["dspark_block_size"] == 5
