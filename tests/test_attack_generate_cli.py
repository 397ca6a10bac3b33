"""Attack: ways to make v4generate print a traceback.

Each ends in at most one line on stderr, never a traceback, with an exit status that says what happened: a bad
value is `v4generate: error: ...` and 1; Ctrl-C during `--stream` is `v4generate: interrupted` and 130 (128 +
SIGINT, as a shell reports it); a reader that closes stdout (`v4generate ... | head -c 1`) gets nothing more,
and the status is 141 (128 + SIGPIPE).

The child writes into a pipe of 4096 bytes that the test stops reading, so it cannot finish before the signal
or the closing comes: nothing here depends on timing.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from hostile import assert_one_line, v4generate, without_tokenizer

GENERATE = ["--prompt-ids", "3,4,5", "--max-new-tokens", "2500", "--ignore-eos"]     # some 10 kB of output


@pytest.fixture(scope="module")
def engine(tiny_engine, tmp_path_factory):
    """Without a tokenizer: the output is token ids, some 10 kB, more than the pipe holds."""
    return without_tokenizer(tiny_engine("mixed", agree=0.05)[1], tmp_path_factory.mktemp("cli") / "engine")


def start(engine, *args: str) -> tuple[subprocess.Popen, int]:
    """v4generate with stdout into a 4096-byte pipe: (the process, the pipe's read end), once it has written."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    # As from a terminal: a run started in the background (nohup, `&`, some CI runners) inherits an ignored SIGINT,
    # and Python then installs no KeyboardInterrupt handler, so the child installs it first. Not with preexec_fn:
    # that forks this worker, and one that has loaded gRPC (the Triton tests) can lose the child before its exec.
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'v4generate'; runpy.run_module('v4engine.runtime.cli', run_name='__main__')")
    child = subprocess.Popen([sys.executable, "-c", start, str(engine), *GENERATE, *args],
                             stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    if not os.read(read_end, 1):
        raise AssertionError(f"it wrote nothing: exit {child.wait(60)}, {child.stderr.read()!r}")
    return child, read_end


def finish(child: subprocess.Popen, read_end: int | None = None) -> str:
    """Drain stdout (if still open) and wait: the child's stderr."""
    while read_end is not None and os.read(read_end, 65536):
        pass
    _, stderr = child.communicate(timeout=120)
    if read_end is not None:
        os.close(read_end)
    return stderr


def test_a_negative_seed(engine):
    assert_one_line(v4generate(engine, "--prompt-ids", "3,4,5", "--seed", "-1"), "seed must be an integer from 0")


def test_ctrl_c_during_stream(engine):
    child, read_end = start(engine, "--stream")
    child.send_signal(signal.SIGINT)
    assert finish(child, read_end) == "v4generate: interrupted\n"
    assert child.returncode == 130


@pytest.mark.parametrize("output", ["--stream", "--json"])
def test_stdout_closed_by_its_reader(engine, output):
    child, read_end = start(engine, output)
    os.close(read_end)
    stderr = finish(child)
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 1, stderr
    assert child.returncode == 141
