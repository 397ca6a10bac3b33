"""scripts/gpu_check.py works before a GPU sees it: its dry run passes through gpu_check.sh's import shim, its AOT
plumbing (plans, partials buffer, TensorRT's argument packing) agrees with the catalog and the PTX, and its
judgements fail wrong results.

The GPU machine is lent for minutes at a time, so whatever can go wrong on the CPU is caught here: the dry run
executes part (a) at the tiny size in Triton's interpreter; (b) runs with a JIT launch standing in for cupy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from v4engine.plugins.kernels import catalog  # noqa: E402
from v4engine.plugins.kernels.launch import launch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = catalog.SIZES["tiny"]


def tiny_inputs(op: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs at the catalog's own tiny B and S, as check_aot builds them."""
    draw = gpu_check.Draw(DEVICE, seed)
    return gpu_check.make_inputs(op, TINY, gpu_check.query_positions(TINY, TINY.B, TINY.S, draw), draw)


def test_dry_run_through_the_shell_script_imports_v4engine_from_the_shim(tmp_path):
    """gpu_check.sh links the checkout's parts under a temporary v4engine/ (no install), and the dry run of (a)
    passes for every op, with and without key splits (--quick: decode only; the AOT test below runs the
    catalog's 3-query chunks)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"} | dict(
        PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-dry-run", "--quick"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    details = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    plugins = details["environment"]["v4engine_plugins"]
    assert plugins.endswith("/v4engine/plugins") and not plugins.startswith(str(ROOT))
    rows = details["rows"]
    assert rows and all(row["ok"] for row in rows)
    splits = [f"{op}_split{TINY.splits}" for op in gpu_check.ATTENTION]
    assert {row["op"] for row in rows} == set(gpu_check.OPS) | set(splits)
    assert {row["case"] for row in rows} == {"decode B=3 S=1", "decode B=3 S=1 exact"}
    assert "checks passed" in done.stdout and "| max err |" in (tmp_path / "out" / "gpu_check.md").read_text()


@pytest.mark.parametrize("name", list(catalog.plans("tiny")))
def test_aot_check_with_a_jit_launch_standing_in_for_cupy(name):
    """aot_row builds the catalog's very plans from its inputs, allocates the split partials as the launcher does,
    and the result matches the reference (here both launches are JIT, so they agree bitwise)."""
    op, _, splits = name.partition("_split")
    row = gpu_check.Row("aot", name, "tiny", "catalog")
    gpu_check.aot_row(row, op, TINY, tiny_inputs(op), int(splits or 1), catalog.plans("tiny")[name],
                      SimpleNamespace(launch=launch))
    assert row.ok, row
    assert "bitwise equal" in row.note


def test_kernel_arguments_are_tensorrts_then_poisoned_scratch():
    plan = catalog.plans("tiny")["hca_attention"][0]
    inputs = tiny_inputs("hca_attention")
    args = [inputs[name] for name in plan.inputs]
    out = torch.empty_like(inputs["q"])
    values = gpu_check.kernel_arguments(plan, args, [out])
    assert [int(v[0]) for v in values] == ([t.data_ptr() for t in args] + [int(v) for v in plan.scalars.values()]
                                           + [out.data_ptr()] + [gpu_check.SCRATCH_POISON] * gpu_check.HIDDEN_PARAMS)
    assert gpu_check.argument_types(values) == ["u64"] * 7 + ["u32"] * 4 + ["u64"] * 3


def test_argument_packing_matches_every_catalog_ptx_entry():
    """Compiled for sm90 (in a process without the interpreter, which cannot compile), every tiny catalog kernel's
    `.entry` takes exactly the types kernel_arguments packs, in the same order (the types depend on the plan
    function only, not on the size)."""
    script = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / "scripts")!r})
import gpu_check as gc
from v4engine.plugins.kernels import catalog
from v4engine.plugins.kernels.launch import compile_plan
t = torch.zeros(16)
for name, plans in catalog.plans("tiny").items():
    for plan in plans:
        values = gc.kernel_arguments(plan, [t] * len(plan.inputs), [t] * len(plan.outputs))
        ptx = compile_plan(plan, "sm90").asm["ptx"]
        assert gc.entry_types(ptx) == gc.argument_types(values), (name, gc.entry_types(ptx))
print("ok")
"""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_bandwidth_floor_counts_only_the_picked_csa_rows():
    inputs = tiny_inputs("csa_attention")
    out = torch.empty_like(inputs["q"])
    everything = sum(t.numel() * t.element_size() for t in (*inputs.values(), out))
    B, R, d = inputs["rows"].shape
    picked = min(TINY.S * TINY.topk, R)
    assert gpu_check.floor_bytes("csa_attention", inputs, out) == everything - (R - picked) * B * d * 4
    hca = tiny_inputs("hca_attention")
    assert gpu_check.floor_bytes("hca_attention", hca, out) == sum(
        t.numel() * t.element_size() for t in (*hca.values(), out))


def test_wrong_results_fail():
    """An attention output off by more than the tolerance, and an indexer pick swapped for a worse row, fail."""
    inputs = tiny_inputs("sliding_attention")
    attrs = gpu_check.op_attrs("sliding_attention", TINY)
    want = gpu_check.attention_ref.sliding_attention(*inputs.values(), **attrs)
    row = gpu_check.Row("numerics", "sliding_attention", "tiny", "-")
    gpu_check.judge("sliding_attention", row, want + 1e-3, want, inputs, attrs)
    assert row.ok is False and row.error == pytest.approx(1e-3, rel=1e-3)

    inputs = tiny_inputs("indexer_topk", seed=1)
    attrs = gpu_check.op_attrs("indexer_topk", TINY)
    want = gpu_check.indexer_ref.indexer_topk(*inputs.values(), **attrs)
    row = gpu_check.Row("numerics", "indexer_topk", "tiny", "-")
    gpu_check.judge("indexer_topk", row, want, want, inputs, attrs)
    assert row.ok and row.error == 0
    b, s = (want[..., 1] >= 0).nonzero()[0].tolist()          # a query with at least two picks
    worse = want.clone()
    worse[b, s, 0] = want[b, s, 1]                            # the second best twice, and the best lost
    gpu_check.judge("indexer_topk", row, worse, want, inputs, attrs)
    assert row.ok is False and "picked twice" in row.note


def test_exit_status(tmp_path):
    report = gpu_check.Report(tmp_path, deadline=float("inf"))
    report.run(gpu_check.Row("time", "op", "size", "case"), lambda row: None)
    assert report.exit_status(interrupted=False) == 0 and report.exit_status(interrupted=True) == 2
    report.run(gpu_check.Row("numerics", "op", "size", "case"), lambda row: 1 / 0)
    assert report.exit_status(interrupted=False) == 1 and "ZeroDivisionError" in report.rows[-1].note
    late = gpu_check.Report(tmp_path, deadline=0.0)
    late.run(gpu_check.Row("numerics", "op", "size", "case"), lambda row: None)
    assert late.rows == [] and late.skipped and late.exit_status(interrupted=False) == 2
