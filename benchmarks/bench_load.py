"""Opening an engine and decoding from it, two runtimes side by side: memory and speed of the load path.

Why: since the engine folder became a trust boundary (contract/engine_folder.py), ONNX Runtime no longer opens
weight files itself; every weight file reaches it as a read-only memory map and the graph as checked bytes. This
measures what that costs against another runtime (e.g. the previous commit's), on the same checkpoint, each
engine built by its own runtime's v4build (the engine formats differ):

    git worktree add /tmp/base HEAD~1 && mkdir -p /tmp/basepkg/v4engine && touch /tmp/basepkg/v4engine/__init__.py
    for d in builder runtime plugins triton_repo; do ln -s /tmp/base/$d /tmp/basepkg/v4engine/$d; done
    .venv/bin/python -m benchmarks.bench_load --work /tmp/bench-load --baseline /tmp/basepkg

Each round runs every variant in a fresh process, interleaved: RSS after Generator.from_engine_dir, peak RSS,
load seconds, and greedy decode tokens/s (MTP 0, after a warm-up). The model is wider than the tiny ones
(hidden 1024, 16 experts), fp32 weights referenced in place, so copies of weights would show.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WIDE = {"vocab_size": 4096, "hidden_size": 1024, "moe_intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 8, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 512, "o_groups": 4,
        "o_lora_rank": 256, "sliding_window": 64, "compress_ratios": [0, 4, 32, 0], "compress_rate_csa": 4,
        "compress_rate_hca": 32, "num_hash_layers": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16}

CHILD = r"""
import json, resource, sys, time
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

def rss():
    # (anonymous, file-backed) resident MiB: mapped weight pages belong to the page cache (shared, reclaimable)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return tuple(int(status[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))

before = rss()
started = time.perf_counter()
gen = Generator.from_engine_dir(sys.argv[1], mtp=0, backend_options={"threads": 2})
loaded = time.perf_counter() - started
after = rss()
params = SamplingParams(max_new_tokens=32, ignore_eos=True)
gen.generate([list(range(3, 67))], params)
started = time.perf_counter()
[result] = gen.generate([list(range(5, 69))], params)
seconds = time.perf_counter() - started
print(json.dumps({"load_s": loaded, "anon_mib": after[0] - before[0], "file_mib": after[1] - before[1],
                  "peak_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "tok_s": len(result.token_ids) / seconds, "tokens": result.token_ids}))
"""


def build(checkpoint: Path, out: Path, pythonpath: str | None) -> None:
    if (out / "engine.json").is_file():
        return
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    subprocess.run([sys.executable, "-m", "v4engine.builder.cli", "--checkpoint", str(checkpoint), "--mtp", "1",
                    "--output", str(out), "--quiet", "--force"], check=True, env=env)


def measure(engine: Path, pythonpath: str | None) -> dict:
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    done = subprocess.run([sys.executable, "-c", CHILD, str(engine)], capture_output=True, text=True, env=env,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the checkpoint and the engines")
    p.add_argument("--baseline", default=None, help="PYTHONPATH holding the other runtime's v4engine package")
    p.add_argument("--rounds", type=int, default=3, help="loads of each engine, the runtimes taking turns (default 3)")
    args = p.parse_args()
    from v4engine.builder.tiny import random_model, save_checkpoint
    from v4engine.builder.tiny import TINY_CONFIGS
    from v4engine.contract.config import V4Config

    raw = {**TINY_CONFIGS["mixed"], **WIDE}
    raw.pop("rope_scaling", None)
    checkpoint = args.work / "wide"
    if not (checkpoint / "config.json").is_file():
        save_checkpoint(random_model(V4Config.from_dict(raw), seed=0), raw, checkpoint)
    variants = {"this runtime": None} | ({"baseline": args.baseline} if args.baseline else {})
    engines = {name: args.work / f"engine-{i}" for i, name in enumerate(variants)}
    for name, path in variants.items():
        build(checkpoint, engines[name], path)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, path in variants.items():
            runs[name].append(measure(engines[name], path))
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 2**20
    print(f"checkpoint: {size:.0f} MiB of fp32 safetensors; median of {args.rounds} rounds, interleaved")
    print("| runtime | RSS after load: anonymous | file-backed (mapped weights) | peak RSS | load | decode tokens/s "
          "| same tokens |")
    print("|---|---|---|---|---|---|---|")
    first = next(iter(runs.values()))[0]["tokens"]
    for name, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("anon_mib", "file_mib", "peak_mib", "load_s", "tok_s")}
        same = all(r["tokens"] == first for r in rows)
        print(f"| {name} | {med['anon_mib']:.0f} MiB | {med['file_mib']:.0f} MiB | {med['peak_mib']:.0f} MiB | "
              f"{med['load_s']:.2f} s | "
              f"{med['tok_s']:.1f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
