"""The draft module a checkpoint ships is told from its config and tensors, and anything that is not exactly one of
the two V4 drafters is refused in one line, before any work: V4's MTP layer (`mtp.0.e_proj` ...) or the releases'
DSpark (`dspark_*` keys and `mtp.0.main_proj`). Other engines half-load 0731's drafter as MTP; a V4.1 checkpoint
is another architecture. `--mtp 0` builds the target of any of them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hostile import assert_one_line, v4build, v4generate

INDEX = "model.safetensors.index.json"


def edited(source: Path, out: Path, config: dict | None = None, drop: tuple[str, ...] = (),
           rename: dict[str, str] | None = None) -> Path:
    """A copy of the checkpoint `source` with config.json fields changed (None: removed), tensors whose names
    contain one of `drop` removed and tensors renamed."""
    shutil.copytree(source, out)
    index = json.loads((out / INDEX).read_text())
    rename = rename or {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / file)
        kept = {rename.get(k, k): v for k, v in tensors.items() if not any(d in k for d in drop)}
        save_file(kept, out / file)
    index["weight_map"] = {rename.get(k, k): f for k, f in index["weight_map"].items() if not any(d in k for d in drop)}
    (out / INDEX).write_text(json.dumps(index))
    raw = json.loads((out / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="module")
def dspark(tiny_checkpoint) -> Path:
    return tiny_checkpoint("mixed", drafter="dspark")


def test_check_names_the_dspark_drafter_and_what_it_reads(dspark):
    checked = v4build("check", "--checkpoint", dspark, "--mtp")
    assert checked.returncode == 0, checked.stderr
    assert "draft module: dspark" in checked.stdout
    assert "3 stages reading target layers [1, 2, 3], block size 5" in checked.stdout


DSPARK_KEYS = {"dspark_block_size": None, "dspark_noise_token_id": None, "dspark_target_layer_ids": None,
               "dspark_markov_rank": None}


@pytest.mark.parametrize("case, says", [
    ("tensors of neither drafter", "neither V4's MTP layer"),
    ("dspark tensors, no dspark_* fields", "has no dspark_* fields"),
    ("dspark_* fields, MTP tensors", "has dspark_* fields"),
    ("DeepSeek-V4.1", "deepseek_v41"),
])
def test_a_draft_module_that_is_not_exactly_mtp_or_dspark_is_refused_in_one_line(dspark, tiny_checkpoint, tmp_path,
                                                                                 case, says):
    folder = tmp_path / "ckpt"
    if case == "tensors of neither drafter":        # the names an early DSpark fixture guessed, not the release's
        edited(dspark, folder, rename={"mtp.2.markov_head.markov_w1.weight": "mtp.2.markov_head.weight"})
    elif case == "dspark tensors, no dspark_* fields":          # and compress_ratios as for one MTP layer
        raw = json.loads((dspark / "config.json").read_text())
        edited(dspark, folder, config=DSPARK_KEYS | {"compress_ratios": raw["compress_ratios"][:-2]})
    elif case == "dspark_* fields, MTP tensors":
        mtp = tiny_checkpoint("mixed")
        raw = json.loads((dspark / "config.json").read_text())
        edited(mtp, folder, config={k: raw[k] for k in DSPARK_KEYS} | {"compress_ratios": raw["compress_ratios"]})
    else:
        edited(dspark, folder, config={"model_type": "deepseek_v41"})
    result = v4build("--checkpoint", folder, "--mtp", "3", "--output", tmp_path / "engine", "--quiet")
    assert_one_line(result, says)
    assert not (tmp_path / "engine").exists()
    assert_one_line(v4build("check", "--checkpoint", folder, "--mtp", "3"), says)


def test_mtp_0_builds_the_target_alone_which_generates_what_the_drafting_engine_does(tiny_engine):
    _, drafting = tiny_engine("mixed", mtp=7, drafter="dspark", agree=0.1)
    _, alone = tiny_engine("mixed", mtp=0, drafter="dspark", agree=0.1)
    manifest = json.loads((alone / "engine.json").read_text())
    assert manifest["drafter"] is None and set(manifest["graphs"]) == {"target"}
    assert manifest["model"]["dspark_block_size"] == 5, "the config is kept whole"
    tokens = {name: json.loads(v4generate(e, "--prompt-ids", "3,4,5,6", "--ignore-eos", "--json",
                                          "--max-new-tokens", "24").stdout)["token_ids"]
              for name, e in (("drafting", drafting), ("alone", alone))}
    assert tokens["drafting"] == tokens["alone"]
