"""own_process=True (share_thread_pool()): target and draft run on one process-wide ONNX Runtime pool (what
v4generate, the demo and the benchmarks ask for), and generate exactly what sessions with pools of their own do.

ONNX Runtime makes the switch for the whole process and for good, so each case runs in a child process of its own:
the pytest worker keeps making sessions with their own pools."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from v4engine.contract.errors import V4EngineError
from v4engine.runtime.sessions.onnxruntime import default_threads

CHILD = r"""
import json, os, sys
import onnxruntime as ort
from v4engine.runtime import Generator, SamplingParams

def threads() -> int:
    return len(os.listdir("/proc/self/task"))

shared = sys.argv[2] == "shared"
before = threads()
options = {"threads": int(sys.argv[4])} if sys.argv[4] else {}
generator = Generator.from_engine_dir(sys.argv[1], mtp=2, own_process=shared, backend_options=options)
[result] = generator.generate([[3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=12, ignore_eos=True))
refused = None
if shared:       # what ONNX Runtime does to a later session that asks for a pool of its own
    try:
        ort.InferenceSession(str(sys.argv[3]), providers=["CPUExecutionProvider"])
    except Exception as e:
        refused = str(e).splitlines()[-1]
print(json.dumps({"tokens": result.token_ids, "pool_threads": threads() - before, "refused": refused}))
"""


def child(engine, mode: str, model: str = "", threads: int | None = 2, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(engine), mode, model, str(threads or "")],
                          capture_output=True, text=True, timeout=300, env=os.environ | env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_target_and_draft_share_one_pool_and_generate_the_same_tokens(tiny_engine, tmp_path):
    _, engine = tiny_engine("mixed")
    relu = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 17)]),
        str(relu))
    own, shared = child(engine, "own"), child(engine, "shared", str(relu))
    assert shared["tokens"] == own["tokens"]
    assert own["pool_threads"] == 2, "a pool of its own each: one thread besides the caller, per session"
    assert shared["pool_threads"] == 1, "one pool for both: one thread besides the caller"
    assert "use_per_session_threads must be false" in shared["refused"]


def test_sessions_not_told_their_threads_take_omp_num_threads(tiny_engine):
    _, engine = tiny_engine("mixed")
    assert child(engine, "own", threads=None, OMP_NUM_THREADS="3")["pool_threads"] == 4, \
        "target and draft, three threads each: two besides the caller, per session"


def test_an_omp_num_threads_that_is_no_count_is_refused_in_one_line(monkeypatch):
    for value in ("many", "0", "-2"):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        with pytest.raises(V4EngineError, match="^OMP_NUM_THREADS must be a positive number of threads"):
            default_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")            # nested levels: the first is the sessions'
    assert default_threads() == 4
