"""scripts/gpu_check.sh and its driver work before a GPU sees them.

The GPU machine is lent for minutes at a time, so whatever can go wrong on the CPU is caught here: the install there
(a copy of the working tree, a Python with v4engine's dependencies but not v4engine, no network), the gpu tests
collected from that install, the driver's AOT plumbing up to the launch (the catalog's plans from model-shaped
inputs, TensorRT's arguments against the PTX compiled for sm90), its bandwidth floor, and its table of the tests'
verdicts. The tests themselves (tests/test_gpu_kernels.py, tests/test_gpu_tensorrt.py) run here too where they can.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
pytest.importorskip("triton")

from v4engine.plugins.kernels import catalog  # noqa: E402
from v4engine.testkit.numerics import OPS, Draw, make_inputs, query_positions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "scripts" / "gpu_check.py"
TINY = catalog.SIZES["tiny"]
# the GPU check compiles kernels: never under the interpreter that conftest.py sets without a GPU
ENV = {name: value for name, value in os.environ.items() if name not in ("TRITON_INTERPRET", "PYTHONPATH")}


def working_tree_copy(to: Path) -> Path:
    """What the GPU machine receives: tracked files and untracked ones git does not ignore."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)
    return to


def python_without_v4engine(env: Path) -> Path:
    """A fresh venv that sees this environment's packages (torch, triton, pip, setuptools) through a .pth line but
    not v4engine, whose editable install hook is itself a .pth file, not run from there: like the GPU machine."""
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run([python, "-c", "import v4engine.plugins"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'v4engine" in probe.stderr, probe.stderr
    return python


def test_dry_run_installs_v4engine_offline_collects_the_gpu_tests_and_checks_up_to_the_launch(tmp_path):
    repo = working_tree_copy(tmp_path / "repo")
    python = python_without_v4engine(tmp_path / "env")
    done = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=tmp_path,
                          env=ENV | dict(PYTHON=str(python), OUT=str(tmp_path / "out")),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for test in ("test_gpu_kernels.py::test_kernel_matches_its_reference[v4-flash-prefill-B2-S64-csa_attention-split8]",
                 "test_gpu_tensorrt.py::test_tensorrt_engines_compute_what_onnxruntime_computes[mxfp4]"):
        assert test in done.stdout, "collected from the install"
    details = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    plugins = details["environment"]["v4engine_plugins"]
    assert plugins.endswith("/v4engine/plugins") and not plugins.startswith((str(repo), str(ROOT))), "installed"

    rows = details["rows"]
    aot = {row["case"]: row for row in rows if row["check"] == "aot"}
    assert set(aot) == {f"tiny {name} B={TINY.B} S={TINY.S}" for name in catalog.plans("tiny")}
    assert all(row["ok"] and "not launched" in row["note"] for row in aot.values()), aot
    floor = {row["case"].split()[1]: row["bytes"] for row in rows if row["check"] == "time"}
    assert set(floor) == set(OPS)
    draw = Draw("cpu")
    inputs = make_inputs("csa_attention", TINY, query_positions(TINY, TINY.B, 1, draw), draw)
    q, rows = inputs["q"], inputs["rows"]
    everything = sum(t.numel() * t.element_size() for t in inputs.values()) + q.numel() * q.element_size()  # + out
    B, R, d = rows.shape
    assert floor["csa_attention"] == everything - (R - min(TINY.topk, R)) * B * d * rows.element_size(), \
        "of CSA's rows, only the picked ones count"
    table = make_inputs("csa_attention_paged", TINY, query_positions(TINY, TINY.B, 1, draw), draw)["block_table"]
    assert floor["csa_attention_paged"] == floor["csa_attention"] + table.numel() * 8, "paged: the same, and the table"
    [pools] = [row for row in details["rows"] if row["check"] == "pools"]
    assert pools["ok"] and "bit-for-bit equal" in pools["note"], pools


def test_the_table_carries_the_tests_verdicts_and_a_failed_test_fails_the_check(tmp_path):
    """pytest's JUnit XML as gpu_check.sh asks for it: a pass with its error and limit, a failure, a skip."""
    (tmp_path / "test_gpu_sample.py").write_text(
        "import pytest\n\n"
        "def test_close(record_property):\n"
        "    record_property('error', 2e-5)\n"
        "    record_property('limit', 1e-4)\n\n"
        "@pytest.mark.parametrize('case', ['far-off'])\n"
        "def test_kernel(case):\n"
        "    assert False, 'error 5.0e-01 (limit 1e-04)'\n\n"
        "def test_needs_tensorrt():\n"
        "    pytest.skip('TensorRT is not importable')\n")
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    "--junitxml", "tests.xml", "test_gpu_sample.py"], cwd=tmp_path, env=ENV, capture_output=True)
    done = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--tests", str(tmp_path / "tests.xml"), "--out",
                           str(tmp_path / "out")], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
            if row["check"] == "sample"}
    close = rows["test_close"]
    assert (close["ok"], close["error"], close["limit"]) == (True, 2e-5, 1e-4)
    assert rows["far-off"]["ok"] is False and "error 5.0e-01" in rows["far-off"]["note"]
    assert rows["test_needs_tensorrt"]["ok"] is None and "TensorRT" in rows["test_needs_tensorrt"]["note"]
    assert "FAIL" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_checks_not_started_before_the_time_limit_leave_the_run_incomplete(tmp_path):
    done = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--time-limit", "0", "--out", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "incomplete" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    details = json.loads((tmp_path / "gpu_check.json").read_text())
    pools = ["pools tiny commit = host commit, 2 x 256"]         # (e): the device pools' commit
    assert details["rows"] == [] and len(details["skipped"]) == len(catalog.plans("tiny")) + len(OPS) + len(pools)
    assert details["skipped"][-1] == pools[0]

