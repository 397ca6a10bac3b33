"""Every catalog launch plan compiles ahead of time for sm90 and sm100 with exactly the arguments TensorRT passes,
and for gfx942 (MI300).

The aot CLI runs once, in a child process without TRITON_INTERPRET (which conftest.py sets without a GPU): in a
process that imported Triton under the interpreter, tl.max & co are wrapped for it and the compiler rejects them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from v4engine.plugins.kernels import aot, catalog  # noqa: E402

TARGETS = ["sm90", "sm100"]


def test_every_plan_compiles_with_exactly_the_arguments_tensorrt_passes():
    """Compiles (so needs no scratch memory: compile_plan refuses that), and the PTX `.entry` takes the plan's
    inputs, int32 scalars and outputs, plus Triton's two unused scratch pointers."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "v4engine.plugins.kernels.aot", "--targets", *TARGETS, "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.stdout, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert [row for row in rows if "error" in row] == []
    expected = {(size, op, plan.kernel.__name__, target): len(plan.inputs) + len(plan.scalars) + len(plan.outputs) + 2
                for size in catalog.SIZES for op, plans in catalog.plans(size).items() for plan in plans
                for target in TARGETS}
    assert {(row["size"], row["op"], row["kernel"], row["target"]): row["params"] for row in rows} == expected


def test_refuses_to_compile_under_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit):
        aot.main(["--targets", "sm90"])
    assert "unset it" in capsys.readouterr().err


def test_every_plan_compiles_for_mi300():
    """gfx942 (issue 8: a build check for MIGraphX custom ops to come): every catalog kernel gives an AMD code
    object, needing no scratch memory."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "v4engine.plugins.kernels.aot", "--targets", "gfx942", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.stdout, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert len(rows) == sum(len(plans) for size in catalog.SIZES for plans in catalog.plans(size).values())
    assert all(row["ok"] and row["hsaco"] > 0 for row in rows), [row for row in rows if not row["ok"]]
