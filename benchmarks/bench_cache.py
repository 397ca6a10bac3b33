"""Paged cache pools: host work per step against context, prefix caching's time to first token, pool memory.

Three measurements, each selectable:
- `host` (any engine; the slice by default, `--engine` to measure another, e.g. one an older checkout built, whose
  runtime then runs this same code): one request with a random prompt of each `--contexts` length, MTP 3,
  then `--steps` decode steps. Per step, counted: host seconds (the step's wall time less its engine calls),
  bytes of the engine calls' inputs built on the host (every feed except the `pool.*` arrays, which go by
  reference), and bytes written into the pools (CachePool.bytes_written; 0 where there are none). Medians, and
  the mean host seconds too: the first decode step (the first draft cycle after the prompt) counts there. Each
  context twice: host pools (numpy, as on the CPU provider) and `--device-pools` (torch tensors bound through
  ONNX Runtime's IOBinding, on the CPU here: the device path's host work without a GPU).
- `prefix` (examples/tiny-v4, or the slice with `--on slice`): 16 requests sharing a `--prefix-tokens`
  prefix, each with its own 32-token tail,
  run one after another by a generator with the prefix cache and by one without, interleaved: time to first
  token of requests 2..16 (median) cold and warm, and whether every request's tokens are equal.
- `memory` (examples/tiny-v4, or the slice with `--on slice`): a generator for 8 rows of max_seq_len 65,536 (its pools sized for that) serving 8
  short requests: the bytes its requests hold against a whole max_seq_len each, and the process's RSS.

    .venv/bin/python -m benchmarks.bench_cache --work /tmp/bench-cache
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import built_engine
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

TINY_V4 = Path(__file__).resolve().parent.parent / "examples" / "tiny-v4"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def host_work(engine: Path, context: int, steps: int, device_pools: bool = False, seed: int = 0) -> dict[str, float]:
    """Medians over `steps` decode steps of one request whose prompt has `context` tokens (see the module doc)."""
    gen = Generator.from_engine_dir(engine, mtp=3, limits=Limits(max_batch=1, max_seq_len=context + 4 * steps + 64),
                                    backend_options={"device_pools": True} if device_pools else None)
    scheduler = gen.scheduler
    engine_seconds, fed = [0.0], [0]
    for session in (scheduler.target_session, scheduler.draft_session):
        run = session.run

        def counted(feeds, run=run):
            fed[0] += sum(a.nbytes for name, a in feeds.items() if not name.startswith("pool."))
            return run(feeds)
        session.run = counted
    scheduler.calls.on_call = lambda call, shape, seconds: engine_seconds.__setitem__(0, engine_seconds[0] + seconds)
    pools = list(getattr(scheduler, "pools", {}).values())
    written = lambda: sum(p.bytes_written for p in pools)                              # noqa: E731
    vocab = gen.manifest.model.vocab_size
    prompt = np.random.default_rng(seed).integers(0, vocab, context).tolist()
    request = scheduler.submit(prompt, SamplingParams(max_new_tokens=4 * steps, ignore_eos=True))
    while not request.generated:                                   # the prefill
        scheduler.step()
    rows = []
    for _ in range(steps):
        engine_seconds[0], fed[0], before = 0.0, 0, written()
        started = time.perf_counter()
        scheduler.step()
        rows.append((time.perf_counter() - started - engine_seconds[0], fed[0], written() - before,
                     engine_seconds[0]))
        if not scheduler.busy:
            break
    host, feeds, pool_bytes, engine_s = (statistics.median(column) for column in zip(*rows))
    return {"context": context, "host_ms": host * 1e3, "host_mean_ms": statistics.mean(r[0] for r in rows) * 1e3,
            "fed_bytes": feeds, "written_bytes": pool_bytes,
            "engine_ms": engine_s * 1e3, "steps": len(rows)}


def prefix_ttft(engine: Path, prefix_tokens: int, requests: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    warm, cold = Generator.from_engine_dir(engine), Generator.from_engine_dir(engine, prefix_cache=False)
    vocab = warm.manifest.model.vocab_size
    prefix = rng.integers(0, vocab, prefix_tokens).tolist()
    prompts = [prefix + rng.integers(0, vocab, 32).tolist() for _ in range(requests)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ttft = {"cold": [], "warm": []}
    same = True
    for p in prompts:
        results = {name: gen.generate([p], params)[0] for name, gen in (("cold", cold), ("warm", warm))}
        same &= results["cold"].token_ids == results["warm"].token_ids
        for name, r in results.items():
            ttft[name].append(r.metrics["time_to_first_token"])
    hits = warm.totals.prefix_hit_tokens
    cold_ms, warm_ms = (statistics.median(ttft[n][1:]) * 1e3 for n in ("cold", "warm"))
    return {"first_cold_ms": ttft["cold"][0] * 1e3, "first_warm_ms": ttft["warm"][0] * 1e3, "cold_ms": cold_ms,
            "warm_ms": warm_ms, "speedup": cold_ms / warm_ms, "same_tokens": same, "prefix_hit_tokens": hits}


def pool_memory(engine: Path, max_seq_len: int = 65536, rows: int = 8) -> dict[str, float]:
    gc.collect()                                      # earlier measurements' generators are gone before we start
    before = rss_mib()
    gen = Generator.from_engine_dir(engine, limits=Limits(max_batch=rows, max_seq_len=max_seq_len))
    scheduler = gen.scheduler
    opened = rss_mib()
    rng = np.random.default_rng(1)
    vocab = gen.manifest.model.vocab_size
    requests = [scheduler.submit(rng.integers(0, vocab, 100).tolist(), SamplingParams(max_new_tokens=32,
                                                                                      ignore_eos=True))
                for _ in range(rows)]
    held = 0
    while scheduler.busy:
        scheduler.step()
        held = max(held, scheduler.used_bytes)
    return {"pool_bytes": sum(a.nbytes for p in scheduler.pools.values() for a in p.arrays.values()),
            "held_peak": held, "whole_max_seq_len": rows * scheduler.cache_bytes(max_seq_len),
            "rss_open_mib": opened - before, "rss_after_mib": rss_mib() - before,
            "generated": sum(len(r.generated) for r in requests)}


def slice_engine(checkpoint: Path, work: Path) -> Path:
    """The slice's engine (bench_slice.py's config), its checkpoint made first when missing."""
    from v4engine.builder.tiny import make_tiny

    if not (checkpoint / "config.json").is_file():
        make_tiny(checkpoint, config="slice", quantize="mxfp4", dtype="bfloat16")
    return built_engine(checkpoint, work / "slice-engine")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="*", default=["host", "prefix", "memory"], choices=["host", "prefix", "memory"],
                   help="which measurements to run (default: all)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-cache"), help="engines are built here")
    p.add_argument("--slice", type=Path, default=Path("/tmp/bench-cache/slice"),
                   help="the slice checkpoint (made here when missing)")
    p.add_argument("--engine", type=Path, help="`host` on this engine instead of the slice's")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 8192], help="prompt lengths for `host`")
    p.add_argument("--steps", type=int, default=24, help="decode steps measured per context")
    p.add_argument("--device-pools", action="store_true",
                   help="`host` also with the pools as torch tensors bound through IOBinding (on the CPU here)")
    p.add_argument("--on", choices=["tiny", "slice"], default="tiny",
                   help="`prefix` and `memory` on examples/tiny-v4 or on the slice (built first when missing)")
    p.add_argument("--prefix-tokens", type=int, default=2048,
                   help="`prefix`: tokens of the prompt the requests share (default 2048)")
    p.add_argument("--requests", type=int, default=16,
                   help="`prefix` and `memory`: requests sent, one after another (default 16)")
    args = p.parse_args()
    if "host" in args.what:
        engine = args.engine or slice_engine(args.slice, args.work)
        print("| context | pools | host ms / step | mean | input bytes built / step | bytes written to pools / step | "
              "engine ms / step |\n|---|---|---|---|---|---|---|")
        for context in args.contexts:
            for device_pools in (False, True) if args.device_pools else (False,):
                row = host_work(engine, context, args.steps, device_pools)
                print(f"| {row['context']} | {'torch (IOBinding)' if device_pools else 'numpy'} | "
                      f"{row['host_ms']:.3f} | {row['host_mean_ms']:.3f} | {row['fed_bytes']:,.0f} | "
                      f"{row['written_bytes']:,.0f} | {row['engine_ms']:.1f} |", flush=True)
    on = None
    if {"prefix", "memory"} & set(args.what):
        on = built_engine(TINY_V4, args.work / "tiny-v4") if args.on == "tiny" else slice_engine(args.slice, args.work)
    if "prefix" in args.what:
        print(f"\nprefix caching on {args.on}:")
        row = prefix_ttft(on, args.prefix_tokens, args.requests)
        print(f"\nprefix {args.prefix_tokens} tokens, {args.requests} requests: first request {row['first_cold_ms']:.1f} "
              f"ms cold / {row['first_warm_ms']:.1f} ms warm; requests 2..{args.requests} median time to first "
              f"token {row['cold_ms']:.1f} ms cold, {row['warm_ms']:.1f} ms warm: {row['speedup']:.1f}x; tokens "
              f"equal: {row['same_tokens']}; prefix_hit_tokens {row['prefix_hit_tokens']}")
    if "memory" in args.what:
        row = pool_memory(on)
        print(f"\n8 requests of 100 + 32 tokens, max_seq_len 65536: pools {row['pool_bytes'] / 2**20:.0f} MiB "
              f"allocated (untouched pages), requests held at most {row['held_peak'] / 2**20:.2f} MiB against "
              f"{row['whole_max_seq_len'] / 2**20:.0f} MiB for a whole max_seq_len each; RSS +"
              f"{row['rss_open_mib']:.0f} MiB after opening, +{row['rss_after_mib']:.0f} MiB after serving")


if __name__ == "__main__":
    main()
