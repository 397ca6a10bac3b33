"""Generation speed and acceptance on held-out text: transformers eager vs v4engine with MTP = 0, 1, 2, 3.

On the trained tiny V4 (examples/tiny-v4) and held-out prompts from the standard library (files the model
never saw; v4engine.testkit.corpus's split), greedy unless --temperature, one run:
  - batch 1, interleaved: for each prompt, transformers `generate()` (the same target weights, dequantized to
    fp32 as the engine uses them) and v4engine MTP = 0..3 run back to back, so machine noise hits all alike;
  - batch 4 and 16 (v4engine only), the prompts cycled, each system in turn per round.
Reports tokens/s, time to first token, acceptance rate, mean acceptance length, per-position acceptance and
host overhead (time outside engine calls, as a share of step time), the per-call costs of the first batch size
(decode, verify and draft cycle in decode units, and the MTP = 3 speedup they bound), then the ratios.

    .venv/bin/python -m benchmarks.bench_generate [--checkpoint examples/tiny-v4] [--work /tmp/bench-generate] \
        [--pools shared|own]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks import built_engine
from v4engine.contract.calls import Call
from v4engine.runtime.budget import Limits
from v4engine.runtime.generator import Generator
from v4engine.runtime.metrics import RequestMetrics
from v4engine.runtime.sampling import SamplingParams
from v4engine.testkit import oracle
from v4engine.testkit.corpus import stdlib_split

ROOT = Path(__file__).resolve().parent.parent


def held_out_prompts(tokenizer_path: Path, count: int, length: int, need: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, one per held-out file long enough for prompt + generation."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    rng = np.random.default_rng(seed)
    prompts = []
    for path in stdlib_split()[1]:
        ids = tokenizer.encode(path.read_text(errors="replace")).ids
        if len(ids) >= length + need:
            start = int(rng.integers(0, len(ids) - length - need + 1))
            prompts.append(ids[start:start + length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"only {len(prompts)} held-out files have {length + need} tokens")


# --------------------------------------------------------------------------- the systems
class FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (put #2; #1 is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Tally:
    """What one system did over the run."""
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    verifies: list[tuple[int, int]] = field(default_factory=list)   # per request: (verify steps, drafts accepted)

    def row(self) -> dict:
        m = self.metrics
        out = {"tokens/s": self.tokens / self.seconds, "TTFT ms": 1000 * statistics.median(self.ttft)}
        if m is not None and m.mtp:
            out.update({"acceptance rate": m.acceptance_rate, "mean acc. length": m.mean_acceptance_length,
                        "per position": " / ".join(f"{a:.2f}" for a in m.per_position_acceptance)})
        if m is not None:
            out["host overhead"] = max(0.0, m.seconds - m.engine_seconds) / m.seconds
        return out


def run_transformers(model, prompt: list[int], new_tokens: int, tally: Tally) -> None:
    clock = FirstTokenClock()
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    with torch.no_grad(), oracle.lowest_index_ties():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=clock)
    tally.seconds += time.perf_counter() - started
    tally.ttft.append(clock.first - started)
    tally.outputs.append(out[0, len(prompt):].tolist())
    tally.tokens += len(tally.outputs[-1])


def run_v4engine(generator: Generator, prompts: list[list[int]], new_tokens: int | list[int], tally: Tally,
                 temperature: float = 0.0, seed: int = 0) -> None:
    """Generate for the prompts as one batch (new_tokens: for all, or one per prompt); acceptance and engine time
    accumulate in `generator.totals`."""
    lengths = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature, seed=seed) for n in lengths]
    started = time.perf_counter()
    results = generator.generate(prompts, params)
    tally.seconds += time.perf_counter() - started
    for result in results:
        tally.ttft.append(result.metrics["time_to_first_token"])
        tally.outputs.append(result.token_ids)
        tally.tokens += len(result.token_ids)
        accepted = result.metrics.get("accepted_per_step", [])
        tally.verifies.append((len(accepted), sum(accepted)))
    tally.metrics = generator.totals


class CallClock:
    """Every engine call's seconds by kind (EngineCalls.on_call): `decode` (target, one token per row), `verify`
    (target, 2..k+1), `draft` (one whole draft cycle over 1..k+1 committed positions); prompts are `prefill` and
    `extend`."""

    NAMES = {Call.PREFILL: "prefill", Call.EXTEND: "extend", Call.CYCLE: "draft"}

    def __init__(self, mtp: int, rows: int | None = None) -> None:
        self.mtp, self.rows = mtp, rows           # rows: only calls of this many rows are kept (None: all)
        self.seconds: dict[str, list[float]] = {}

    def __call__(self, call: Call, shape: tuple[int, ...], seconds: float) -> None:
        if self.rows is not None and shape[0] != self.rows:
            return
        kind = self.NAMES.get(call) or ("decode" if shape[1] == 1 else "verify")
        self.seconds.setdefault(kind, []).append(seconds)

    def median(self, kind: str) -> float:
        return statistics.median(self.seconds[kind])


def call_costs(decode: CallClock, drafting: CallClock, mean_acceptance_length: float, measured: float) -> str:
    """Median call costs in decode units, and the speedup they allow at the measured acceptance length: tokens
    per cycle / (verify + draft), engine time only (host time and the decodes' own wake-ups aside)."""
    unit = decode.median("decode")
    verify, draft = drafting.median("verify") / unit, drafting.median("draft") / unit
    bound = mean_acceptance_length / (verify + draft)
    return "\n".join([
        f"### per-call costs (batch 1, medians; MTP = {drafting.mtp} calls from the MTP = {drafting.mtp} generator)",
        "", "| call | calls | median | in decodes |", "|---|---|---|---|",
        f"| decode (MTP = 0, q = 1) | {len(decode.seconds['decode'])} | {1000 * unit:.2f} ms | 1.00 |",
        f"| verify (q = 2..{drafting.mtp + 1}) | {len(drafting.seconds['verify'])} | "
        f"{1000 * drafting.median('verify'):.2f} ms | {verify:.2f} |",
        f"| draft cycle ({drafting.mtp} drafts, one call) | {len(drafting.seconds['draft'])} | "
        f"{1000 * drafting.median('draft'):.2f} ms | {draft:.2f} |",
        "", f"bound at mean acceptance length {mean_acceptance_length:.2f}: {mean_acceptance_length:.2f} / "
        f"({verify:.2f} + {draft:.2f}) = {bound:.2f}x; measured {measured:.2f}x = {measured / bound:.0%} of it"])


# --------------------------------------------------------------------------- the run
def prepare(checkpoint: Path, work: Path) -> tuple[Path, Path]:
    """The v4engine engine (--mtp 3) and an fp32 transformers copy of the same (dequantized) target weights."""
    engine, hf = built_engine(checkpoint, work), work / "hf"
    if not (hf / "config.json").exists():
        oracle.transformers_copy(checkpoint, hf)
    return engine, hf


def table(title: str, rows: dict[str, dict]) -> str:
    columns = ["tokens/s", "TTFT ms", "acceptance rate", "mean acc. length", "per position", "host overhead"]
    lines = [f"### {title}", "", "| system | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        cells = []
        for c in columns:
            v = row.get(c, "-")
            cells.append(f"{v:.0%}" if c == "host overhead" and v != "-" else f"{v:.2f}" if isinstance(v, float)
                         else str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prompt_arguments(p: argparse.ArgumentParser) -> None:
    """The checkpoint and the held-out prompts: what every generation benchmark takes."""
    p.add_argument("--checkpoint", type=Path, default=ROOT / "examples" / "tiny-v4",
                   help="the checkpoint built and measured; its held-out files give the prompts "
                        "(default examples/tiny-v4)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens of each prompt (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens of each request (default 64)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_arguments(p)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-generate"), help="engine and transformers copy")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16],
                   help="batch sizes measured (default 1 4 16)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for both ONNX Runtime and torch")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled requests (default 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="v4engine's sampling temperature (default 0: greedy); above 0 drafts are sampled and "
                        "verified by rejection sampling, and transformers does not run")
    p.add_argument("--pools", choices=["shared", "own"], default="shared",
                   help="ONNX Runtime threads: one pool for every session (share_thread_pool, what v4generate "
                        "does; default) or a pool per session, the draft's and target's sleeping between turns")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine, hf = prepare(args.checkpoint, args.work)
    prompts = held_out_prompts(args.checkpoint / "tokenizer.json", args.prompts, args.prompt_tokens,
                               args.new_tokens, args.seed)

    model = oracle.load_transformers(hf)
    model.generation_config.eos_token_id = None              # fixed length, like ignore_eos below
    max_batch = max(args.batch_sizes)
    # the prefix cache off: the warm-up's prompt and the batch rounds' repeated prompts would skip their prefills
    generators = {k: Generator.from_engine_dir(engine, mtp=k, own_process=args.pools == "shared", prefix_cache=False,
                                               limits=Limits(max_batch=max_batch),
                                               backend_options={"threads": args.threads})
                  for k in range(4)}
    for k, g in generators.items():                          # warm up every system once, untimed
        run_v4engine(g, prompts[:1], 8, Tally())
    clocks = {k: CallClock(k) for k in (0, 3)}              # batch 1 only (the first batch size)
    for k, clock in clocks.items():
        generators[k].scheduler.calls.on_call = clock
    run_transformers(model, prompts[0], 8, Tally())

    sections = []
    rows: dict[str, dict] = {}
    for batch in args.batch_sizes:
        tallies = {k: Tally() for k in generators}
        for k, g in generators.items():
            g.totals = RequestMetrics(mtp=k)
        hf_tally = Tally() if batch == 1 and args.temperature == 0 else None
        groups = [[prompts[(i + j) % len(prompts)] for j in range(batch)] for i in range(0, len(prompts), batch)] \
            if batch <= len(prompts) else [[prompts[j % len(prompts)] for j in range(batch)]]
        for group in groups:                                 # interleaved: every system on this group in turn
            if hf_tally is not None:
                run_transformers(model, group[0], args.new_tokens, hf_tally)
            for k, g in generators.items():
                run_v4engine(g, group, args.new_tokens, tallies[k], args.temperature, args.seed)
        batch_rows = {}
        if hf_tally is not None:
            batch_rows["transformers eager"] = hf_tally.row()
            same = sum(a == b for a, b in zip(hf_tally.outputs, tallies[0].outputs))
            print(f"greedy tokens equal to transformers: {same}/{len(hf_tally.outputs)} prompts (MTP = 0)")
        for k, t in tallies.items():
            batch_rows[f"v4engine MTP = {k}"] = t.row()
            if args.temperature == 0:       # sampled tokens differ by draft length; tests/ check their law
                lossless = all(a == b for a, b in zip(t.outputs, tallies[0].outputs))
                print(f"batch {batch} MTP = {k}: tokens {'equal' if lossless else 'DIFFER from'} MTP = 0")
        rows[batch] = batch_rows
        for k in clocks:
            generators[k].scheduler.calls.on_call = None
        sections.append(table(f"batch {batch} ({len(groups)} x {batch} prompts, {args.new_tokens} new tokens each, "
                              f"temperature {args.temperature:g})",
                              batch_rows))
    print("\n\n".join(sections))
    one = rows[args.batch_sizes[0]]
    speedup = one['v4engine MTP = 3']['tokens/s'] / one['v4engine MTP = 0']['tokens/s']
    print("\n" + call_costs(clocks[0], clocks[3], one["v4engine MTP = 3"]["mean acc. length"], speedup))
    print(f"\nratios (tokens/s, batch {args.batch_sizes[0]}):")
    print(f"  v4engine MTP = 3 / MTP = 0:      {speedup:.2f}x")
    if "transformers eager" in one:
        print(f"  v4engine MTP = 0 / transformers: "
              f"{one['v4engine MTP = 0']['tokens/s'] / one['transformers eager']['tokens/s']:.2f}x")


if __name__ == "__main__":
    main()
