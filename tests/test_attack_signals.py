"""A build stopped by Ctrl-C, SIGTERM or SIGHUP, in any stage, exits in one line (130, or 128 + the signal) and
leaves nothing behind: no OUT, no staging folder, no lock. One stopped by SIGKILL cannot clean up; the next build
into the same OUT recognises its staging folder (its owner is dead) and removes it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostile import env_without_export_cache
from v4engine.builder import build as build_module
from v4engine.builder.cli import main as v4build_main
from v4engine.contract import staging


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("split_groups")


def start_build(checkpoint: Path, out: Path) -> subprocess.Popen:
    """A build that exports (no export cache): tens of seconds, inside which the tests stop it."""
    return subprocess.Popen([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint),
                             "--output", str(out), "--mtp", "1", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env_without_export_cache())


def wait_for_staging(out: Path, process: subprocess.Popen) -> Path:
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        found = list(out.parent.glob(f".{out.name}.building-*"))
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("the build never made its staging folder")


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") or p == out)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_build_cleans_up(checkpoint, tmp_path, signum):
    out = tmp_path / "out"
    build = start_build(checkpoint, out)
    wait_for_staging(out, build)                                 # its export follows at once
    build.send_signal(signum)
    _, err = build.communicate(timeout=120)
    assert build.returncode == 128 + signum
    assert err.strip().splitlines() == [f"v4build: interrupted ({signal.Signals(signum).name})"], err
    assert leftovers(out) == []


STAGES = ["open_checkpoint", "exported_graph", "attach_weights", "prepare_graph", "check_graph", "compile_engine"]


@pytest.mark.parametrize("stage", STAGES)
def test_ctrl_c_in_any_stage_exits_130_and_leaves_nothing(checkpoint, tmp_path, monkeypatch, capsys, stage):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, stage, interrupted)
    out = tmp_path / "out"
    assert v4build_main(["--checkpoint", str(checkpoint), "--output", str(out), "--mtp", "3", "--quiet"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["v4build: interrupted"]
    assert leftovers(out) == []


def test_a_second_build_into_the_same_output_refuses_while_the_first_runs(checkpoint, tmp_path):
    out = tmp_path / "out"
    first = start_build(checkpoint, out)
    wait_for_staging(out, first)
    second = subprocess.run([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint),
                             "--output", str(out), "--mtp", "0", "--quiet", "--force"], capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [f"v4build: error: {out}: another process is writing it now "
                                                  f"(it holds {tmp_path / '.out.lock'}); refused"]
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert json.loads((out / "engine.json").read_text())["mtp"] == 1, "the first build's engine, untouched"
    assert leftovers(out) == ["out"]


def test_a_staging_folder_left_by_sigkill_is_removed_by_the_next_build(checkpoint, tmp_path):
    out = tmp_path / "out"
    killed = start_build(checkpoint, out)
    stale = wait_for_staging(out, killed)
    killed.kill()
    killed.wait()
    assert stale.exists()
    alive = tmp_path / ".out.building-alive"          # a staging folder whose owner (this test) still runs
    alive.mkdir()
    (alive / staging.OWNER).write_text(json.dumps(staging._me()))
    result = subprocess.run([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint),
                             "--output", str(out), "--mtp", "0", "--quiet"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert not stale.exists()
    assert alive.exists(), "a live owner's staging folder is not ours to remove"
    assert leftovers(out) == [".out.building-alive", "out"]


def test_a_pid_reused_by_another_process_does_not_keep_a_dead_staging_folder(tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / ".out.building-reused"
    stale.mkdir()
    owner = staging._me() | {"start": "0"}             # this pid, but not this process's start time
    (stale / staging.OWNER).write_text(json.dumps(owner))
    assert staging.remove_dead_staging(out) == [stale]
    assert os.getpid() == owner["pid"]


def test_an_engine_set_aside_by_a_writer_killed_between_its_renames_is_put_back(tmp_path):
    """A replacing writer renames the old OUT aside, then the new one in; killed in between, it leaves OUT missing
    and the old one aside: the next writer puts that back before deciding anything."""
    out = tmp_path / "out"
    aside = tmp_path / ".out.replaced-dead"
    (aside / "old").mkdir(parents=True)
    (aside / "old" / "engine.json").write_text("{}")
    (aside / staging.OWNER).write_text(json.dumps(staging._me() | {"start": "0"}))      # its owner is gone
    assert staging.remove_dead_staging(out) == [aside]
    assert (out / "engine.json").read_text() == "{}" and not aside.exists()


def test_a_complete_output_whose_writer_died_before_unmarking_it_is_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "engine.json").write_text("{}")
    (out / staging.OWNER).write_text(json.dumps(staging._me() | {"start": "0"}))
    assert staging.remove_dead_staging(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["engine.json"]


# ------------------------------------------------------------------ the lock and the replace, attacked
ENGINE = staging.Ours("an engine", "engine.json", lambda entry: str(entry) in ("engine.json", "graph.onnx"))


def an_engine(folder: Path, content: str) -> Path:
    folder.mkdir()
    for name in ("engine.json", "graph.onnx"):
        (folder / name).write_text(content)
    return folder


@pytest.mark.parametrize("kind", ["hard link", "fifo"])
def test_a_lock_path_that_is_not_a_lock_file_of_ours_is_refused_and_left_as_it_is(tmp_path, kind):
    """A hard link would have the build truncate and write the file it links to; a FIFO is not a lock at all."""
    out, lock = tmp_path / "out", tmp_path / ".out.lock"
    victim = tmp_path / "victim"
    if kind == "hard link":
        victim.write_text("precious")
        os.link(victim, lock)
    else:
        os.mkfifo(lock)
    with pytest.raises(staging.StagingError) as refusal:
        with staging.staged_folder(out, "building"):
            pass
    assert str(lock) in str(refusal.value) and "not a lock file of ours" in str(refusal.value)
    assert "\n" not in str(refusal.value) and not out.exists()
    if kind == "hard link":
        assert victim.read_text() == "precious"


def test_a_file_added_to_the_old_engine_during_a_force_rebuild_keeps_it(tmp_path):
    out = an_engine(tmp_path / "out", "old")
    with pytest.raises(staging.StagingError, match="holds notes.txt.*left alone"):
        with staging.staged_folder(out, "building", force=True, ours=ENGINE) as tmp:
            an_engine(tmp / "x", "new")
            for name in ("engine.json", "graph.onnx"):
                (tmp / "x" / name).rename(tmp / name)
            (tmp / "x").rmdir()
            (out / "notes.txt").write_text("mine")           # a user's file, while the new one is written
    assert (out / "notes.txt").read_text() == "mine" and (out / "engine.json").read_text() == "old"
    assert leftovers(out) == ["out"]


def test_a_writer_killed_while_deleting_the_old_engine_leaves_a_folder_the_next_one_removes(tmp_path, monkeypatch):
    """The set-aside folder's owner record is deleted last: killed during the deletion (here: while deleting the
    old engine), it still names its dead owner, and the next writer removes it."""
    out = an_engine(tmp_path / "out", "old")
    remove = shutil.rmtree

    def killed(path, *args, **kwargs):
        if Path(path).name == "old":
            raise KeyboardInterrupt                      # nothing after this point runs, as under SIGKILL
        remove(path, *args, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        with staging.staged_folder(out, "building", force=True, ours=ENGINE) as tmp:
            for name in ("engine.json", "graph.onnx"):
                (tmp / name).write_text("new")
    monkeypatch.setattr(staging.shutil, "rmtree", remove)
    [aside] = tmp_path.glob(".out.replaced-*")
    assert (aside / staging.OWNER).is_file()
    (aside / staging.OWNER).write_text(json.dumps(staging._me() | {"start": "0"}))     # its writer is gone
    assert staging.remove_dead_staging(out) == [aside]
    assert (out / "engine.json").read_text() == "new" and leftovers(out) == ["out"]
