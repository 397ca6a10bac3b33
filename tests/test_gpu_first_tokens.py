"""The GPU's first-tokens script (scripts/gpu_first_tokens.py), run dry on the CPU: the same steps a CPU can take,
on the session's engines (tiny-v4 MTP 3 and tiny-v4-dspark DSpark 5, CPU fp32 and CUDA bf16): the placement model
finds nothing to refuse, greedy tokens decided by the device sampler (torch, device_pools: the GPU session's path)
equal those decided on the host, and the report is written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import TRAINED, TRAINED_DSPARK

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_first_tokens.py"


def test_the_first_tokens_script_runs_dry_on_the_cpu(trained_engine, trained_dspark_engine, cuda_engine, tmp_path):
    engines = {"tiny-v4-cpu": trained_engine, "tiny-v4-dspark-cpu": trained_dspark_engine[1],
               "tiny-v4-cuda": cuda_engine(TRAINED, 3), "tiny-v4-dspark-cuda": cuda_engine(TRAINED_DSPARK, 5)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--new-tokens", "6", "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work"), "--engines", *(f"{k}={v}" for k, v in engines.items())],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "first_tokens.json").read_text())
    assert not list((tmp_path / "work").glob("*")), "nothing built: every engine was given"
    for key, graphs in report["placement"].items():
        assert set(graphs) == {"target", "draft"}
        assert all(row["offenders"] == [] and row["host_shape_nodes"] > 0 for row in graphs.values()), key
    assert set(report["greedy"]) == {"MTP 0", "MTP 3", "DSpark 5"}
    for case, same in report["greedy"].items():
        assert same["equal"] == same["of"] == 8 and same["mean_common_prefix"] == 6, case
    assert all(speed["batch 1"] > 0 for speed in report["speed"].values()) and "torch eager" in report["speed"]
    assert "| MTP 3 | 8/8 | 6.0/6 |" in (tmp_path / "out" / "first_tokens.md").read_text()
