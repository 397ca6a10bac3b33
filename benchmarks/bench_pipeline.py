"""Pipeline stages on the CPU: what cutting the target into stages costs, and whether micro-batches in flight on
different stages pay on one machine.

examples/tiny-v4 (6 layers) built with --mtp 3 as one graph and as 2 pipeline stages. Four requests at once
(batch 4), each a random prompt of 64 tokens, greedy, 48 new tokens, MTP 3. Each system generates the same
requests, the systems taking turns, `--repeats` rounds; reported: the best tokens/s of each, the median verify call
(the target on 4 rows of k + 1 tokens) and draft call (ms), the engine's share of the wall time, and whether its
tokens equal the one-graph engine's. Systems:
- one graph, 2 threads (the default) and 1 thread;
- two stages called one after the other (what a pipeline does with one batch in flight), 2 threads per stage;
- two stages with a call's rows cut in 2 micro-batches in flight at once (one worker thread per stage), with
  2 threads per stage (both stages on both cores) and with 1 thread per stage (each stage a core of its own: the
  closest this machine comes to a GPU per stage).

    .venv/bin/python -m benchmarks.bench_pipeline --work /tmp/bench-pipeline
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import built_engine
from v4engine.contract.calls import Call
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

TINY_V4 = Path(__file__).resolve().parent.parent / "examples" / "tiny-v4"
SYSTEMS = {                      # name -> (stages, Generator options)
    "one graph, 2 threads": (1, {"threads": 2}),
    "one graph, 1 thread": (1, {"threads": 1}),
    "2 stages in turn, 2 threads each": (2, {"threads": 2, "microbatches": 1}),
    "2 stages, 2 micro-batches in flight, 2 threads each": (2, {"threads": 2, "microbatches": 2}),
    "2 stages, 2 micro-batches in flight, 1 thread each": (2, {"threads": 1, "microbatches": 2}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the engines")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the systems (default 3)")
    args = parser.parse_args()
    engines = {n: built_engine(TINY_V4, args.work, 3, "--pipeline-stages", str(n), name=f"stages-{n}")
               for n in (1, 2)}
    generators, calls = {}, {}
    for name, (stages, options) in SYSTEMS.items():
        generators[name] = Generator.from_engine_dir(engines[stages], **options)
        calls[name] = []
        generators[name].scheduler.calls.on_call = \
            lambda call, shape, seconds, name=name: calls[name].append((call, shape[1], seconds))
    vocab = generators["one graph, 2 threads"].manifest.model.vocab_size
    prompts = np.random.default_rng(0).integers(0, vocab, (4, 64)).tolist()
    sampling = SamplingParams(max_new_tokens=48, ignore_eos=True)
    best: dict[str, float] = {}
    engine_share: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, generator in generators.items():
            calls[name].clear()
            started = time.perf_counter()
            results = generator.generate(prompts, sampling)
            seconds = time.perf_counter() - started
            tokens[name] = [r.token_ids for r in results]
            best[name] = max(best.get(name, 0.0), sum(map(len, tokens[name])) / seconds)
            engine_share[name].append(sum(c[2] for c in calls[name]) / seconds)
    reference, base = tokens["one graph, 2 threads"], best["one graph, 2 threads"]
    print("| system | tokens/s (best) | vs one graph, 2 threads | verify call (median) | draft call (median) | "
          "engine share of wall | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in SYSTEMS:
        verify = statistics.median(c[2] for c in calls[name] if c[0] == Call.VERIFY and c[1] == 4) * 1e3
        draft = statistics.median(c[2] for c in calls[name] if c[0] == Call.CYCLE and c[1] <= 4) * 1e3
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.2f}x | {verify:.2f} ms | {draft:.2f} ms | "
              f"{statistics.median(engine_share[name]):.0%} | {tokens[name] == reference} |")


if __name__ == "__main__":
    main()
