"""Build time and peak memory of `v4build` as the checkpoint grows.

Makes bf16 checkpoints of the tiny `mixed` layout widened to about 0.1, 0.5 and 2 GB of weights (same
layers, same graph; wider matrices), builds each with `v4build --mtp 1` in a fresh process, and reports wall
time and the build process's peak RSS. Goal: peak RSS roughly flat in checkpoint size.

    .venv/bin/python -m benchmarks.bench_build [--sizes 0.1 0.5 2] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from v4engine.builder.tiny import TINY_CONFIGS, write_checkpoint_folder
from v4engine.contract.config import V4Config


def widened(target_bytes: float) -> dict:
    """The `mixed` config with hidden and expert widths scaled so bf16 weights take about target_bytes."""
    base = dict(TINY_CONFIGS["mixed"], torch_dtype="bfloat16")
    best = base
    for width in range(64, 8192, 64):
        raw = dict(base, hidden_size=width, moe_intermediate_size=width, q_lora_rank=width // 2,
                   o_lora_rank=width // 4, vocab_size=4096)
        if param_bytes(raw) > target_bytes:
            break
        best = raw
    return best


def param_bytes(raw: dict) -> int:
    from v4engine.builder.model import Transformer

    with torch.device("meta"):
        model = Transformer(V4Config.from_dict(raw), mtp=True)
    return sum(t.numel() * 2 for t in model.state_dict().values())


def write_checkpoint(raw: dict, out: Path) -> None:
    """Random bf16 tensors (fp32 where the checkpoint keeps them fp32) written shard by shard, never the whole
    model in memory."""
    from v4engine.builder.model import Transformer
    from v4engine.builder.model.v4 import FP32_PARAMETERS

    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in Transformer(V4Config.from_dict(raw), mtp=True).state_dict().items()}

    def random(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        if dtype == torch.int64:
            return torch.randint(0, raw["n_routed_experts"], shape)
        values = torch.randn(shape) * 0.02
        return values if FP32_PARAMETERS.search(name) else values.to(torch.bfloat16)

    def write_shard(path: Path, names: list[str]) -> int:
        tensors = {k: random(k) for k in names}
        save_file(tensors, str(path))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    write_checkpoint_folder(out, raw, list(shapes), 8, write_shard)


def timed_build(checkpoint: Path, output: Path, *flags: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one `v4build` process with `flags` (its own rusage, from wait4)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint),
                             "--output", str(output), *flags, "--quiet"], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"v4build failed on {checkpoint}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.5, 2.0], help="checkpoint sizes in GB")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--write", nargs=2, metavar=("CONFIG_JSON", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write:
        write_checkpoint(json.loads(args.write[0]), Path(args.write[1]))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-build-"))
    rows = []
    for size in sorted(args.sizes):
        raw = widened(size * 1e9)
        checkpoint = work / f"ckpt-{size}"
        if checkpoint.exists():
            shutil.rmtree(checkpoint)
        # Written by a child process: a parent grown by writing gigabytes would inflate the build's measured
        # peak (the child's rusage counts the memory it shares with the parent until exec).
        subprocess.run([sys.executable, __file__, "--write", json.dumps(raw), str(checkpoint)], check=True)
        total = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        wall, peak = timed_build(checkpoint, work / f"engine-{size}", "--mtp", "1")
        rows.append((total / 1e9, raw["hidden_size"], wall, peak))
        shutil.rmtree(checkpoint)
        shutil.rmtree(work / f"engine-{size}")
        print(f"  {total / 1e9:.2f} GB checkpoint: {wall:.1f} s, peak RSS {peak:.0f} MiB", flush=True)
    print("\n| checkpoint (bf16) | hidden = expert width | v4build wall | v4build peak RSS |")
    print("|---|---|---|---|")
    for gb, width, wall, peak in rows:
        print(f"| {gb:.2f} GB | {width} | {wall:.1f} s | {peak:.0f} MiB |")


if __name__ == "__main__":
    main()
