"""Drafters side by side on held-out prompts: no drafting, the engine's MTP layer, and prompt lookup.

On the trained tiny V4 (examples/tiny-v4, built --mtp 3) and held-out prompts from the standard library (files the
model never saw: code, which repeats its own context), every system runs each group of prompts in turn
(interleaved, so machine noise hits all alike): MTP 0, MTP 3, and prompt lookup at k = 3 and 5. Reports tokens/s,
time to first token, acceptance and per-position acceptance for each, at each batch size, greedy or sampled, and
checks that every system's greedy tokens equal MTP 0's.

    .venv/bin/python -m benchmarks.bench_drafters [--work /tmp/bench-generate] [--temperature 1] [--batch-sizes 1 8]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import built_engine
from benchmarks.bench_generate import Tally, held_out_prompts, prompt_arguments, run_v4engine, table
from v4engine.runtime import Generator, Limits
from v4engine.runtime.metrics import RequestMetrics

SYSTEMS = {"MTP 0": {"mtp": 0}, "MTP 3": {"mtp": 3}, "prompt lookup 3": {"drafter": "prompt_lookup", "mtp": 3},
           "prompt lookup 5": {"drafter": "prompt_lookup", "mtp": 5}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_arguments(p)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-generate"), help="engine folder")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="batch sizes measured (default 1 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0 sampled")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled requests (default 0)")
    args = p.parse_args()
    engine = built_engine(args.checkpoint, args.work)
    prompts = held_out_prompts(args.checkpoint / "tokenizer.json", args.prompts, args.prompt_tokens,
                               args.new_tokens, args.seed)
    # the prefix cache off: repeated prompts would skip their prefills in later rounds
    generators = {name: Generator.from_engine_dir(engine, own_process=True, prefix_cache=False,
                                                  limits=Limits(max_batch=max(args.batch_sizes)), **options)
                  for name, options in SYSTEMS.items()}
    for g in generators.values():                            # warm up every system once, untimed
        run_v4engine(g, prompts[:1], 8, Tally())
    for batch in args.batch_sizes:
        tallies = {name: Tally() for name in generators}
        for name, g in generators.items():
            g.totals = RequestMetrics(mtp=g.scheduler.mtp)
        groups = [[prompts[(i + j) % len(prompts)] for j in range(batch)] for i in range(0, len(prompts), batch)]
        for group in groups:
            for name, g in generators.items():
                run_v4engine(g, group, args.new_tokens, tallies[name], args.temperature, args.seed)
        print(table(f"batch {batch} ({len(groups)} x {batch} held-out prompts of {args.prompt_tokens} tokens, "
                    f"{args.new_tokens} new tokens each, temperature {args.temperature:g})",
                    {name: t.row() for name, t in tallies.items()}))
        base = tallies["MTP 0"]
        for name, t in tallies.items():
            ratio = (t.tokens / t.seconds) / (base.tokens / base.seconds)
            same = "" if args.temperature else \
                f"; tokens {'equal' if t.outputs == base.outputs else 'DIFFER from'} MTP 0's"
            print(f"  {name}: {ratio:.2f}x MTP 0{same}")
        print()


if __name__ == "__main__":
    main()
