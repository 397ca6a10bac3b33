"""A checkpoint folder cannot make the builder read outside itself, nor make an error message show a file's bytes.

Index entries that are absolute or climb out with `..`, shard, config or tokenizer links that leave the folder,
and headers whose tensors overlap are refused in one line. The one exception is a Hugging Face cache snapshot,
whose files are links into its repository's blobs/: that layout builds."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from hostile import assert_never_shown, assert_one_line, files_opened, snapshot, v4build
from v4engine.builder.checkpoint import Checkpoint, CheckpointError

INDEX = "model.safetensors.index.json"


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint("mixed"), tmp_path / "ckpt"))


def shards(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def index_points_to(checkpoint: Path, file: str) -> None:
    data = json.loads((checkpoint / INDEX).read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = file
    (checkpoint / INDEX).write_text(json.dumps(data))


def index_names_an_absolute_path(checkpoint, secret):
    index_points_to(checkpoint, str(secret))


def index_climbs_out(checkpoint, secret):
    index_points_to(checkpoint, f"../outside/{secret.name}")


def shard_links_out(checkpoint, secret):
    shard = shards(checkpoint)[0]
    moved = secret.parent / shard.name
    shutil.move(shard, moved)
    shard.symlink_to(moved)


def single_file_links_out(checkpoint, secret):
    for shard in shards(checkpoint):
        shard.unlink()
    (checkpoint / INDEX).unlink()
    (checkpoint / "model.safetensors").symlink_to(secret)


def config_links_out(checkpoint, secret):
    shutil.move(checkpoint / "config.json", secret.parent / "config.json")
    (checkpoint / "config.json").symlink_to(secret.parent / "config.json")


def a_text_file_as_a_shard(checkpoint, secret):
    shutil.copy(secret, checkpoint / "notes.safetensors")
    index_points_to(checkpoint, "notes.safetensors")


def tensors_overlap(checkpoint, secret):
    """The second tensor's bytes start where the first's do (data offsets are relative to the header's end)."""
    shard = shards(checkpoint)[0]
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    first, second = [k for k in header if k != "__metadata__" and header[k]["data_offsets"][1]
                     > header[k]["data_offsets"][0]][:2]
    begin = header[first]["data_offsets"][0]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    header[second]["data_offsets"] = [begin, begin + size]
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


ATTACKS = {
    index_names_an_absolute_path: "not a file inside",
    index_climbs_out: "not a file inside",
    shard_links_out: "leads outside the checkpoint folder",
    single_file_links_out: "leads outside the checkpoint folder",
    config_links_out: "leads outside the checkpoint folder",
    a_text_file_as_a_shard: "not a safetensors file",
    tensors_overlap: "overlap",
}


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__)
def test_check_refuses_in_one_line_and_shows_nothing_of_the_file(checkpoint, secret, attack):
    attack(checkpoint, secret)
    outside = snapshot(secret.parent)
    result = v4build("check", "--checkpoint", checkpoint)
    assert_one_line(result, ATTACKS[attack])
    assert_never_shown(result)
    assert snapshot(secret.parent) == outside


@pytest.mark.parametrize("attack", [index_names_an_absolute_path, index_climbs_out, shard_links_out,
                                    single_file_links_out], ids=lambda f: f.__name__)
def test_the_file_outside_is_never_opened(checkpoint, secret, attack):
    attack(checkpoint, secret)
    with files_opened() as opened, pytest.raises(CheckpointError, match=ATTACKS[attack]):
        Checkpoint.open(checkpoint)
    assert not [p for p in opened if Path(p).resolve().is_relative_to(secret.parent.resolve())], opened


def test_a_tokenizer_linking_out_is_not_copied_into_the_engine(checkpoint, secret, tmp_path):
    (checkpoint / "tokenizer.json").unlink()
    (checkpoint / "tokenizer.json").symlink_to(secret)
    result = v4build("--checkpoint", checkpoint, "--output", tmp_path / "engine", "--mtp", "0", "--quiet")
    assert_one_line(result, "tokenizer.json", "leads outside the checkpoint folder")
    assert not (tmp_path / "engine").exists()
    assert_never_shown(result)


def test_a_hugging_face_cache_snapshot_is_not_an_escape(checkpoint, tmp_path):
    """models--org--name/snapshots/REV/* are links into models--org--name/blobs/: that layout is allowed."""
    repo = tmp_path / "hub" / "models--deepseek-ai--tiny"
    snapshot_dir, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot_dir.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(checkpoint.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot_dir / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot_dir))
    result = v4build("check", "--checkpoint", snapshot_dir)
    assert result.returncode == 0, result.stderr
    assert "draft module: mtp" in result.stdout
