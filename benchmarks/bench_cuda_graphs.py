"""What `v4build --cuda-graphs` costs where no CUDA graph is recorded: the CPU, batch 1, MTP 3.

Four systems on the trained tiny V4 (examples/tiny-v4), interleaved per held-out prompt in one run:
  - plain: the engine as built by default (Sinkhorn as one Loop, the draft's conditionals);
  - plain, device pools: the same with its pools as torch tensors bound through an IOBinding (`device_pools`), the
    path the static buffers take, so that the last row's cost is the buffers' alone;
  - graphs, eager: the engine built with --cuda-graphs (no control flow) run as any engine;
  - graphs, static buffers: the same with `cuda_graphs=True`, every verify and draft cycle padded into the
    buffers of its bucket and run through its binding, as the CUDA provider replays them (nothing recorded here).
Reports tokens/s, the median verify and draft-cycle call, and that every system generated the same tokens.
A checkpoint without a tokenizer (the slice: `v4build make-tiny --config slice`) gets random prompts: its weights
are random, so only the call costs mean anything there.

    .venv/bin/python -m benchmarks.bench_cuda_graphs [--work /tmp/bench-cuda-graphs] [--temperature 1]
    .venv/bin/python -m benchmarks.bench_cuda_graphs --checkpoint /work/scratch/slice --work /tmp/bench-cg-slice \
        --prompts 4 --prompt-tokens 200 --new-tokens 32
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks import built_engine
from benchmarks.bench_generate import CallClock, Tally, held_out_prompts, prompt_arguments, run_v4engine
from v4engine.contract.engine import EngineManifest
from v4engine.runtime.generator import Generator

SYSTEMS = ("plain", "plain, device pools", "graphs, eager", "graphs, static buffers")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_arguments(p)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-cuda-graphs"), help="the two engines")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above: drafts sampled")
    args = p.parse_args()
    plain = built_engine(args.checkpoint, args.work)
    graphs = built_engine(args.checkpoint, args.work, 3, "--cuda-graphs", name="engine-cuda-graphs")
    if (args.checkpoint / "tokenizer.json").is_file():
        prompts = held_out_prompts(args.checkpoint / "tokenizer.json", args.prompts, args.prompt_tokens,
                                   args.new_tokens, seed=0)
    else:
        vocab = EngineManifest.read(plain).model.vocab_size
        prompts = np.random.default_rng(0).integers(0, vocab, (args.prompts, args.prompt_tokens)).tolist()
    generators = {SYSTEMS[0]: Generator.from_engine_dir(plain, own_process=True),
                  SYSTEMS[1]: Generator.from_engine_dir(plain, own_process=True,
                                                        backend_options={"device_pools": True}),
                  SYSTEMS[2]: Generator.from_engine_dir(graphs, own_process=True),
                  SYSTEMS[3]: Generator.from_engine_dir(graphs, own_process=True,
                                                        backend_options={"cuda_graphs": True})}
    tallies = {name: Tally() for name in SYSTEMS}
    clocks = {name: CallClock(3) for name in SYSTEMS}
    for name, generator in generators.items():
        generator.scheduler.calls.on_call = clocks[name]
        run_v4engine(generator, prompts[0], 4, Tally(), args.temperature)        # warm up, not counted
        clocks[name].seconds.clear()
    for i, prompt in enumerate(prompts):
        for name, generator in generators.items():
            run_v4engine(generator, prompt, args.new_tokens, tallies[name], args.temperature, seed=i)
    same = all(tallies[name].outputs == tallies[SYSTEMS[0]].outputs for name in SYSTEMS)
    print(f"### --cuda-graphs on the CPU: batch 1, MTP 3, {len(prompts)} held-out prompts x {args.new_tokens} tokens, "
          f"temperature {args.temperature}\n")
    print("| system | tokens/s | vs plain | verify ms | draft cycle ms | mean acc. length |")
    print("|---|---|---|---|---|---|")
    base = tallies[SYSTEMS[0]].tokens / tallies[SYSTEMS[0]].seconds
    for name in SYSTEMS:
        rate = tallies[name].tokens / tallies[name].seconds
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {1000 * clocks[name].median('verify'):.2f} | "
              f"{1000 * clocks[name].median('draft'):.2f} | "
              f"{tallies[name].metrics.mean_acceptance_length:.2f} |")
    print(f"\ntokens identical across the systems: {same}")
    if not same:
        raise SystemExit("the systems generated different tokens")


if __name__ == "__main__":
    main()
