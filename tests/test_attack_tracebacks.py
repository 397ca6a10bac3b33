"""Damaged or hostile input is one line and a non-zero exit, never a Python traceback: a truncated or garbage graph,
JSON nested too deeply (in a safetensors header, config.json, engine.json), config fields of the wrong type, and a
closed stdout. (Disk full: test_attack_tmpfs.py; Ctrl-C and signals: test_attack_signals.py; v4generate's own
cases: test_attack_generate_cli.py; Triton requests: test_triton_server.py.)"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from hostile import assert_one_line, v4build, v4generate

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def engine(engine_copy) -> Path:
    return engine_copy


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint("mixed"), tmp_path / "ckpt"))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_graph_is_one_line(engine, damage):
    graph = engine / "target.onnx"
    data = graph.read_bytes()
    graph.write_bytes({"truncated": data[: len(data) // 3], "garbage": bytes(range(256)) * 64, "empty": b""}[damage])
    assert_one_line(v4generate(engine, "--prompt-ids", "3,4,5"), "target.onnx")


def test_a_graph_that_loads_but_answers_in_other_shapes_is_one_line(engine):
    """A Reshape slipped before the logits: the graph loads (its declared outputs are unchanged), then its answer
    is refused by shape rather than indexed."""
    graph = onnx.load(engine / "target.onnx", load_external_data=False)
    producer = next(n for n in graph.graph.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "logits.raw"
    shape = onnx.helper.make_tensor("logits.shape", onnx.TensorProto.INT64, [2], [-1, 7])
    graph.graph.node.extend([onnx.helper.make_node("Constant", [], ["logits.shape"], value=shape),
                             onnx.helper.make_node("Reshape", ["logits.raw", "logits.shape"], ["logits"])])
    onnx.save(graph, engine / "target.onnx")
    assert_one_line(v4generate(engine, "--prompt-ids", "3,4,5,6,7,8,9"), "target.onnx", "logits")


def test_deep_json_in_engine_json_is_one_line(engine):
    (engine / "engine.json").write_text(DEEP)
    assert_one_line(v4generate(engine, "--prompt-ids", "3,4,5"), "engine.json", "nested too deeply")


def test_deep_json_in_config_json_is_one_line(checkpoint):
    (checkpoint / "config.json").write_text(DEEP)
    assert_one_line(v4build("check", "--checkpoint", checkpoint), "config.json", "nested too deeply")


def test_deep_json_in_a_safetensors_header_is_one_line(checkpoint):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    shard.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP.encode())
    assert_one_line(v4build("check", "--checkpoint", checkpoint), shard.name, "not valid JSON")


def test_deep_json_in_the_index_is_one_line(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(DEEP)
    assert_one_line(v4build("check", "--checkpoint", checkpoint), "model.safetensors.index.json", "nested too deeply")


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "64"),
    ("hidden_size", 64.0),
    ("hidden_size", True),
    ("compress_ratios", 5),
    ("compress_ratios", ["0"]),
    ("layer_types", "sliding_attention"),
    ("rope_scaling", "yarn"),
    ("rope_scaling", {"type": "yarn", "factor": "16", "original_max_position_embeddings": 64}),
    ("rope_parameters", [1, 2]),
    ("quantization_config", []),
    ("eos_token_id", "1"),
    ("eos_token_id", [1, "2"]),
    ("norm_topk_prob", "yes"),
    ("num_nextn_predict_layers", "1"),
    ("model_type", ["deepseek_v4"]),
    ("swiglu_limit", "inf"),
    ("swiglu_limit", float("nan")),
    ("num_hash_layers", 1.5),
    ("rope_theta", 10**400),
])
def test_a_config_field_of_the_wrong_type_is_named(checkpoint, field, value):
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_one_line(v4build("check", "--checkpoint", checkpoint), "config.json", field.split(".")[0])


def test_a_config_that_is_not_an_object_is_one_line(checkpoint):
    (checkpoint / "config.json").write_text("[1, 2, 3]")
    assert_one_line(v4build("check", "--checkpoint", checkpoint), "config.json", "must be a JSON object")


def test_a_closed_stdout_is_at_most_one_line(checkpoint):
    pipe = subprocess.Popen([sys.executable, "-m", "v4engine.builder.cli", "check", "--checkpoint", str(checkpoint)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pipe.stdout.close()                                     # as `| head -c 0` does
    err = pipe.stderr.read()
    assert pipe.wait(timeout=120) in (0, 1)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err


@pytest.mark.parametrize("args, needle", [
    (["make-tiny", "--shards", "0"], "shards must be an integer from 1"),
    (["make-tiny", "--shards", "-1"], "shards must be an integer from 1"),
    (["make-release", "--shards", "0"], "shards must be an integer from 1"),
    (["make-tiny", "--agree", "nan"], "agree must be a number above 0"),
    (["make-tiny", "--agree", "inf"], "agree must be a number above 0"),
    (["make-tiny", "--agree", "0"], "agree must be a number above 0"),
])
def test_a_checkpoint_writer_refuses_counts_and_scales_that_would_mean_something_else(tmp_path, args, needle):
    """`--shards 0` wrote one shard and `--agree nan` NaN weights, each with exit 0."""
    out = tmp_path / "out"
    assert_one_line(v4build(args[0], out, *args[1:]), needle)
    assert not out.exists()
