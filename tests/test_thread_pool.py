"""own_process=True (share_thread_pool()): target and draft run on one process-wide ONNX Runtime pool (what
v4generate, the demo and the benchmarks ask for), and generate exactly what sessions with pools of their own do.

ONNX Runtime makes the switch for the whole process and for good, so each case runs in a child process of its own:
the pytest worker keeps making sessions with their own pools."""
from __future__ import annotations

import json
import subprocess
import sys

import onnx
from onnx import TensorProto, helper

CHILD = r"""
import json, os, sys
import onnxruntime as ort
from v4engine.runtime import Generator, SamplingParams

def threads() -> int:
    return len(os.listdir("/proc/self/task"))

shared = sys.argv[2] == "shared"
before = threads()
generator = Generator.from_engine_dir(sys.argv[1], mtp=2, own_process=shared, backend_options={"threads": 2})
[result] = generator.generate([[3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=12, ignore_eos=True))
refused = None
if shared:       # what ONNX Runtime does to a later session that asks for a pool of its own
    try:
        ort.InferenceSession(str(sys.argv[3]), providers=["CPUExecutionProvider"])
    except Exception as e:
        refused = str(e).splitlines()[-1]
print(json.dumps({"tokens": result.token_ids, "pool_threads": threads() - before, "refused": refused}))
"""


def child(engine, mode: str, model: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(engine), mode, model], capture_output=True, text=True,
                          timeout=300)
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
