"""Nothing is deleted that v4build did not make: `--force` replaces only an engine folder (an engine.json of
ours), `make-tiny` and `make-release` replace nothing without `--force` and, with it, only a checkpoint folder they
wrote. Every refusal is one line, and the folder is left exactly as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostile import assert_one_line, snapshot, v4build


def foreign(folder: Path) -> Path:
    """A folder of someone else's, with a file and a subfolder."""
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    (folder / "sub" / "data.csv").write_text("1,2,3")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("split_groups")


@pytest.mark.parametrize("force", [False, True])
def test_build_leaves_a_foreign_folder_alone(checkpoint, tmp_path, force):
    out = foreign(tmp_path / "out")
    before = snapshot(out)
    result = v4build("--checkpoint", checkpoint, "--output", out, "--mtp", "0", "--quiet", *(["--force"] * force))
    assert_one_line(result, str(out), "is not an engine folder" if force else "--force")
    assert snapshot(out) == before


def test_force_leaves_a_folder_whose_engine_json_is_not_ours(checkpoint, tmp_path):
    out = foreign(tmp_path / "out")
    (out / "engine.json").write_text(json.dumps({"format": "someone-else", "precious": True}))
    before = snapshot(out)
    assert_one_line(v4build("--checkpoint", checkpoint, "--output", out, "--mtp", "0", "--quiet", "--force"),
                    "is not an engine folder")
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", ["file", "symlink to a folder"])
def test_force_never_replaces_a_file_or_a_link(checkpoint, tmp_path, kind):
    elsewhere = foreign(tmp_path / "elsewhere")
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("not a folder")
    else:
        out.symlink_to(elsewhere)
    before = snapshot(tmp_path)
    assert_one_line(v4build("--checkpoint", checkpoint, "--output", out, "--mtp", "0", "--quiet", "--force"),
                    "is not a folder")
    assert snapshot(tmp_path) == before


def test_force_replaces_an_engine_of_ours_and_only_as_it_was_built(checkpoint, tmp_path):
    out = tmp_path / "out"
    build = ("--checkpoint", checkpoint, "--output", out, "--mtp", "3", "--quiet")     # test_engine.py's exports
    assert v4build(*build).returncode == 0
    (out / "weights" / "notes.txt").write_text("mine now")          # anything but what a build writes
    before = snapshot(out)
    assert_one_line(v4build(*build, "--max-batch", "4", "--force"),
                    "holds weights/notes.txt, which is not part of an engine folder")
    assert snapshot(out) == before
    (out / "weights" / "notes.txt").unlink()
    result = v4build(*build, "--max-batch", "4", "--force")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "engine.json").read_text())["build"]["max_batch"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no staging folder, lock or old engine left"


@pytest.mark.parametrize("command", [["make-tiny"], ["make-release", "--shards", "2"]])
def test_checkpoint_writers_replace_nothing_without_force(tmp_path, command):
    out = foreign(tmp_path / "out")
    before = snapshot(out)
    assert_one_line(v4build(command[0], out, *command[1:]), str(out), "--force")
    assert snapshot(out) == before
    assert_one_line(v4build(command[0], out, *command[1:], "--force"), "is not a checkpoint folder written by v4build")
    assert snapshot(out) == before


def test_make_tiny_force_replaces_a_checkpoint_it_wrote(tmp_path):
    out = tmp_path / "tiny"
    assert v4build("make-tiny", out, "--config", "split_groups").returncode == 0
    first = (out / "model.safetensors.index.json").read_text()
    assert_one_line(v4build("make-tiny", out, "--config", "split_groups", "--seed", "1"), "--force")
    result = v4build("make-tiny", out, "--config", "split_groups", "--seed", "1", "--force")
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors.index.json").read_text() == first       # same layout,
    assert v4build("check", "--checkpoint", out).returncode == 0              # new weights, still a checkpoint
    (out / "my-notes.md").write_text("mine")
    assert_one_line(v4build("make-tiny", out, "--config", "split_groups", "--force"), "holds my-notes.md")
