"""Build time and peak memory of `v4build` as the checkpoint grows.

Makes bf16 checkpoints of the tiny `mixed` layout widened to about 0.1, 0.5 and 2 GB of weights (same
layers, same graph; wider matrices), builds each with `v4build --mtp 1` in a fresh process, and reports wall
time and the build process's peak RSS. Goal: peak RSS roughly flat in checkpoint size.

    .venv/bin/python benchmarks/bench_build.py [--sizes 0.1 0.5 2] [--work DIR]
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

from v4engine.builder.tiny import TINY_CONFIGS, _shard_groups
from v4engine.runtime.config import V4Config


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
    """Random bf16 tensors streamed shard by shard (never the whole model in memory)."""
    from v4engine.builder.model import Transformer

    out.mkdir(parents=True)
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in Transformer(V4Config.from_dict(raw), mtp=True).state_dict().items()}
    groups = _shard_groups(list(shapes), 8)
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for k in group:
            shape, dtype = shapes[k]
            if dtype == torch.int64:
                tensors[k] = torch.randint(0, raw["n_routed_experts"], shape)
            elif k.endswith(("hc_attn_fn", "hc_ffn_fn", "hc_head_fn", "attn_sink", ".ape", "hc_attn_base",
                             "hc_ffn_base", "hc_head_base", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale",
                             "gate.bias")):
                tensors[k] = torch.randn(shape) * 0.02
            else:
                tensors[k] = (torch.randn(shape) * 0.02).to(torch.bfloat16)
            weight_map[k] = name
        save_file(tensors, str(out / name))
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(raw))


def timed_build(checkpoint: Path, output: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one `v4build` process (its own rusage, from wait4)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint),
                             "--output", str(output), "--mtp", "1", "--quiet"], stdout=subprocess.DEVNULL)
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
        wall, peak = timed_build(checkpoint, work / f"engine-{size}")
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
