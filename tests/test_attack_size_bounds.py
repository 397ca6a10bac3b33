"""Sizes are bounded before anything is allocated: a 1 KB config.json (or engine.json) that claims a huge model is
refused in one line, at once and in little memory, by its bounds (V4Config's SIZE_BOUNDS) or by the checkpoint's
own headers, which are compared with the config before any model is built."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hostile import assert_one_line
from v4engine.contract.config import SIZE_BOUNDS
from v4engine.contract.engine import EngineFormatError, EngineManifest

MAX_RSS_MIB = 1024
# The CLI, then its own peak (VmHWM: this process image's high-water mark) into the file argv[1]. The rusage of a
# child is no measure: at exec Linux carries the forking process's high-water mark into it, so a child of a large
# pytest worker reports the worker's size.
CHECK_WITH_PEAK = """
import runpy, sys
peak_file = sys.argv.pop(1)
try:
    runpy.run_module("v4engine.builder.cli", run_name="__main__", alter_sys=True)
finally:
    with open(peak_file, "w") as f:
        f.write(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
"""


def check(checkpoint: Path) -> tuple[subprocess.CompletedProcess, float]:
    """`v4build check` on the folder: its result and the peak RSS of that process alone, in MiB."""
    peak_file = checkpoint.parent / f"{checkpoint.name}.peak"
    process = subprocess.Popen([sys.executable, "-c", CHECK_WITH_PEAK, str(peak_file), "check", "--checkpoint",
                                str(checkpoint)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=120)   # a hang guard, not a timing verdict
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return result, int(peak_file.read_text()) / 1024


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint("mixed"), tmp_path / "ckpt"))


def set_config(checkpoint: Path, **fields) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(fields)
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert (checkpoint / "config.json").stat().st_size < 4096


@pytest.mark.parametrize("field, value", [
    ("n_routed_experts", 10_000_000),
    ("num_hidden_layers", 1_000_000),
    ("hc_sinkhorn_iters", 10**9),
    ("sliding_window", 10**9),
    ("vocab_size", 10**12),
    ("index_topk", 2**63),
    ("max_position_embeddings", 10**15),
])
def test_a_size_beyond_its_bound_is_refused_at_once(checkpoint, field, value):
    set_config(checkpoint, **{field: value})
    result, peak = check(checkpoint)
    assert_one_line(result, f"field '{field}'", "must be an integer from")
    assert peak < MAX_RSS_MIB, f"{peak:.0f} MiB"


def test_layers_times_experts_is_bounded_too(checkpoint):
    set_config(checkpoint, num_hidden_layers=SIZE_BOUNDS["num_hidden_layers"],
               n_routed_experts=SIZE_BOUNDS["n_routed_experts"], num_hash_layers=0,
               compress_ratios=[0] * (SIZE_BOUNDS["num_hidden_layers"] + 1))
    result, peak = check(checkpoint)
    assert_one_line(result, "field 'n_routed_experts'", "times num_hidden_layers")
    assert peak < MAX_RSS_MIB, f"{peak:.0f} MiB"


def test_every_layer_must_hold_every_expert_before_a_model_is_built(checkpoint):
    """Layer 0 complete is not enough: a model's modules grow with layers x experts."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    last = max(int(k.split(".")[1]) for k in index["weight_map"] if k.startswith("layers."))
    gone = {k for k in index["weight_map"] if k.startswith(f"layers.{last}.ffn.experts.")}
    for shard in sorted(set(index["weight_map"][k] for k in gone)):
        tensors = load_file(checkpoint / shard)
        save_file({k: v for k, v in tensors.items() if k not in gone and k.removesuffix("scale") + "weight" not in gone},
                  checkpoint / shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in gone}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    result, _ = check(checkpoint)
    assert_one_line(result, "field 'n_routed_experts'", f"layer {last} of the checkpoint holds 0 experts")


@pytest.mark.parametrize("field, value, needle", [
    ("num_hidden_layers", SIZE_BOUNDS["num_hidden_layers"], "but the checkpoint holds 4 layers"),
    ("n_routed_experts", SIZE_BOUNDS["n_routed_experts"], "of the checkpoint holds 4 experts"),
    ("vocab_size", 500_000, "but embed.weight has shape"),
])
def test_a_size_within_bounds_that_the_headers_contradict_is_refused_before_any_model(checkpoint, field, value,
                                                                                      needle):
    extra = {"compress_ratios": [0] * (value + 1), "num_hash_layers": 0} if field == "num_hidden_layers" else {}
    set_config(checkpoint, **{field: value}, **extra)
    result, peak = check(checkpoint)
    assert_one_line(result, f"field '{field}'", needle)
    assert peak < MAX_RSS_MIB, f"{peak:.0f} MiB"


@pytest.mark.parametrize("where, value, needle", [
    (("model", "sliding_window"), 10**9, "field 'sliding_window' must be an integer from"),
    (("model", "sliding_window"), 64, "does not describe the target graph"),
    (("caches", "groups", "target", 0, "rows_fixed"), 10**9, "caches.groups' is not what the model config implies"),
    (("model", "vocab_size"), 4096, "does not describe the target graph"),
    (("build", "max_seq_len"), 10**9, "max_seq_len must be an integer from 2 to"),
    (("build", "max_batch"), 10**9, "max_batch must be an integer from 1 to"),
    (("mtp",), 10**6, "field 'mtp' must be an integer from 0 to"),
])
def test_engine_json_sizes_are_bounded_and_must_agree_with_each_other(engine_copy, where, value, needle):
    engine = engine_copy
    data = json.loads((engine / "engine.json").read_text())
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    (engine / "engine.json").write_text(json.dumps(data))
    with pytest.raises(EngineFormatError, match=needle) as refused:
        EngineManifest.read(engine)
    assert "\n" not in str(refused.value)


def test_the_host_memory_a_budget_takes_half_of_is_what_ulimit_v_leaves():
    """The default cache budget is half the host memory: under `ulimit -v` that is the address space left, not the
    machine's RAM (which made numpy's allocation fail with a traceback)."""
    script = ("import resource; from v4engine.runtime.pool_arrays import host_memory; "
              "limit = 6 << 30; resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); print(host_memory())")
    free = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert 0 < free < 6 << 30
