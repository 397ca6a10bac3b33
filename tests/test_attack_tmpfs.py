"""Engines on another filesystem than their checkpoint, and a disk that fills up during a build, on a real tmpfs
(mounted in a private mount namespace, so nothing outside the test sees it).

Across filesystems the build cannot hard-link the checkpoint's files, so weights/ holds symlinks to them (the
documented fallback); such an engine must load and generate exactly like one with hard links, also when it has a
converted.bin (every FP8 checkpoint). A full disk fails the build in one line and leaves nothing behind."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hostile import assert_one_line

PROMPT = "3,4,5,6,7,8"


def in_tmpfs(mount: Path, size: str, *commands: list[str]) -> subprocess.CompletedProcess:
    """Run `commands` (argument lists, one after another) with a fresh tmpfs of `size` at `mount`."""
    mount.mkdir(exist_ok=True)
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    script = " && ".join([f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount))}"]
                         + [shlex.join(c) for c in commands])
    done = subprocess.run(namespace + ["sh", "-c", script], capture_output=True, text=True, timeout=600)
    if "unshare failed" in done.stderr or "mount: " in done.stderr:
        pytest.fail(f"this machine cannot mount a private tmpfs: {done.stderr.strip()}")
    return done


def v4build(*args) -> list[str]:
    return [sys.executable, "-m", "v4engine.builder.cli", *map(str, args), "--quiet"]


def v4generate(*args) -> list[str]:
    return [sys.executable, "-m", "v4engine.runtime.cli", *map(str, args)]


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_an_engine_on_a_tmpfs_links_its_weights_and_generates_the_same_tokens(tiny_checkpoint, tmp_path, quantize):
    checkpoint = tiny_checkpoint("flash_like", quantize=quantize)
    here = tmp_path / "engine"
    assert subprocess.run(v4build("--checkpoint", checkpoint, "--mtp", "3", "--output", here)).returncode == 0
    expected = subprocess.run(v4generate(here, "--prompt-ids", PROMPT, "--ignore-eos", "--json"),
                              capture_output=True, text=True, check=True).stdout
    mount = tmp_path / "tmpfs"
    engine = mount / "engine"
    done = in_tmpfs(mount, "64m",
                    v4build("--checkpoint", checkpoint, "--mtp", "3", "--output", engine),
                    [sys.executable, "-c", "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['weights']))",
                     str(engine / "engine.json")],
                    v4generate(engine, "--prompt-ids", PROMPT, "--ignore-eos", "--json"))
    assert done.returncode == 0, done.stderr
    weights_line, generated = done.stdout.strip().splitlines()[-2:]
    links = {w["file"]: w["link"] for w in json.loads(weights_line)["files"]}
    assert "weights/converted.bin" in links and set(links.values()) == {"symlink", "converted"}, links
    assert json.loads(generated)["token_ids"] == json.loads(expected)["token_ids"]


def test_a_full_disk_fails_the_build_in_one_line_and_leaves_nothing(tiny_checkpoint, tmp_path):
    mount = tmp_path / "tmpfs"
    build = shlex.join(v4build("--checkpoint", tiny_checkpoint("flash_like", quantize="fp8"), "--mtp", "3",
                               "--output", mount / "engine"))
    done = in_tmpfs(mount, "1m", ["sh", "-c", f"{build}; echo exit=$?; ls -A {shlex.quote(str(mount))}"])
    assert done.returncode == 0, done.stderr
    status, *left = done.stdout.strip().splitlines()
    assert status == "exit=1"
    assert_one_line(subprocess.CompletedProcess([], 1, "", done.stderr), "No space left on device")
    assert left == [], f"left on the full disk: {left}"
