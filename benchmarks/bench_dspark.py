"""DSpark against MTP, side by side: acceptance, speed, call costs, and the confidence head's calibration.

Engines: the trained tiny V4 (examples/tiny-v4) built --mtp 3, whose MTP layer drafts k = 1..3 (MTP 0: no drafting), and
examples/tiny-v4-dspark (the same target with its trained DSpark drafter) built --mtp 3, 5 and 7: DSpark N = 3, 5, 7 (N
is the draft graph's block width, so each N is an engine of its own). On held-out prompts (files the models never saw),
every system runs the prompts in turn: MTP 0..3, DSpark N with every draft verified, and DSpark N with confidence
scheduling (runtime/verify_schedule.py). At batch 1 the systems take turns prompt by prompt (interleaved, so machine
noise hits all alike); at batch B > 1 each runs all the prompts as one saturated batch, a generator of max_batch B with
the rest waiting for a free row (a server's batch under load: a row whose request ends takes the next, so no row idles
while a slower request of its group finishes), `--rounds` times in turn; its tokens/s over the whole run and over its
full steps (B rows in the step: the end of a finite run, where rows empty one by one, left out), the latter as a ratio
to MTP 0's in the same round, with a 95% interval over rounds. For each batch size and temperature: tokens/s and the
ratio to MTP 0, mean acceptance length, per-position acceptance, and whether greedy tokens equal MTP 0's; each drafter's
mean acceptance length with a 95% interval over the prompts and its difference from MTP 3's, the prompts paired
(`--draws`: each prompt sampled several times at batch 1, which a T = 1 comparison needs); then, at the first
temperature, the per-call costs in decodes (verify of N + 1, one draft cycle; at batch B, the calls of B rows) and the
bound they set (mean acceptance length / (verify + draft)); the confidence head's calibration on DSpark 5 (predicted
survival, the running product of the confidences, against observed acceptance, per position and in bins); and a PNG of
acceptance per position and the calibration curve.

`--slice` measures call costs only on the wide slice (make-tiny --config slice, random weights: nothing is accepted),
MTP 3 against DSpark 5, so the cost of three stages with their own MoE is known at width.

    .venv/bin/python -m benchmarks.bench_dspark [--work /tmp/bench-dspark] [--batch-sizes 1 8] [--temperatures 0 1]
    .venv/bin/python -m benchmarks.bench_dspark --prompts 24 --batch-sizes 1 --temperatures 1 --draws 4
    .venv/bin/python -m benchmarks.bench_dspark --slice [--work /tmp/bench-dspark-slice]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import built_engine
from benchmarks.bench_generate import ROOT, CallClock, Tally, held_out_prompts, prompt_arguments, run_v4engine, table
from v4engine.builder.tiny import make_tiny
from v4engine.runtime import Generator, Limits
from v4engine.runtime.metrics import RequestMetrics
from v4engine.runtime.scheduler import Scheduler, StepResult
from v4engine.runtime.verify_schedule import survival

DSPARK = ROOT / "examples" / "tiny-v4-dspark"
WIDTHS = (3, 5, 7)


class CalibrationLog:
    """(predicted survival of draft j, whether it was accepted) for every draft verified while `on`."""

    def __init__(self) -> None:
        self.on, self.pairs = False, []
        record = RequestMetrics.record_verify

        def logged(metrics: RequestMetrics, drafted: int, accepted: int, confidence=None) -> None:
            if self.on and confidence is not None:
                self.pairs += [(float(s), j < accepted) for j, s in enumerate(survival(np.asarray(confidence)))]
            record(metrics, drafted, accepted, confidence)

        RequestMetrics.record_verify = logged

    def by_position(self, n: int) -> list[tuple[float, float]]:
        """Per position: (mean predicted survival, observed acceptance)."""
        rows = [[] for _ in range(n)]
        for i, pair in enumerate(self.pairs):
            rows[i % n].append(pair)
        return [(float(np.mean([s for s, _ in r])), float(np.mean([a for _, a in r]))) for r in rows]

    def binned(self, bins: int = 10) -> list[tuple[float, float, int]]:
        """(mean predicted, observed, count) per bin of predicted survival."""
        s, a = np.array([p for p, _ in self.pairs]), np.array([x for _, x in self.pairs], float)
        which = np.minimum((s * bins).astype(int), bins - 1)
        return [(float(s[which == b].mean()), float(a[which == b].mean()), int((which == b).sum()))
                for b in range(bins) if (which == b).any()]


class SaturatedClock:
    """Tokens and seconds of a scheduler's full steps (max_batch rows took part): a batch under load, without a
    finite run's tail, where rows empty one by one as the last requests end."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.tokens, self.seconds, self.scheduler = 0, 0.0, scheduler
        step = scheduler.step

        def timed() -> StepResult:
            started = time.perf_counter()
            result = step()
            if len(scheduler.active) + len(result.finished) == scheduler.max_batch:
                self.seconds += time.perf_counter() - started
                self.tokens += sum(len(t) for t in result.new_tokens.values())
            return result

        scheduler.step = timed

    def detach(self) -> None:
        del self.scheduler.step                  # the class's own again


def systems(args: argparse.Namespace, max_batch: int) -> dict[str, Generator]:
    """Every system's generator; the prefix cache off (repeated prompts would skip their prefills)."""
    mtp = built_engine(args.checkpoint, args.work, mtp=3, name="mtp")
    dspark = {n: built_engine(args.dspark, args.work, mtp=n, name=f"dspark{n}") for n in WIDTHS}

    def open_(engine: Path, **options) -> Generator:
        return Generator.from_engine_dir(engine, own_process=True, prefix_cache=False,
                                         limits=Limits(max_batch=max_batch), **options)

    out = {f"MTP {k}": open_(mtp, mtp=k) for k in range(4)}
    out |= {f"DSpark {n}": open_(dspark[n], confidence_scheduling=False) for n in WIDTHS}
    out |= {f"DSpark {n} scheduled": open_(dspark[n], confidence_scheduling=True) for n in WIDTHS}
    return out


def compare(generators: dict[str, Generator], prompts: list[list[int]], batch: int, temperature: float,
            new_tokens: int | list[int], seed: int, calibration: CalibrationLog, rounds: int, draws: int
            ) -> tuple[dict[str, Tally], dict[str, list[float]], list[int]]:
    """Every system on the prompts: at batch 1 one prompt at a time, interleaved (sampled: each prompt `draws`
    times, seeded seed, seed + 1, ...); above, all of them as one saturated batch (the generators' max_batch),
    `rounds` times, the systems taking turns. The tallies; above batch 1 each system's tokens/s over its full steps
    (SaturatedClock) in each round; and the prompt of each request, in the order the tallies hold them."""
    tallies = {name: Tally() for name in generators}
    clocks = {name: SaturatedClock(g.scheduler) for name, g in generators.items()} if batch > 1 else {}
    for g in generators.values():
        g.totals = RequestMetrics(mtp=g.scheduler.mtp)
    if batch == 1:
        groups = [([i], seed + d) for i in range(len(prompts)) for d in range(draws if temperature > 0 else 1)]
    else:
        groups = [(list(range(len(prompts))), seed)] * rounds
    per_round: dict[str, list[float]] = {name: [] for name in clocks}
    for group, group_seed in groups:
        for name, g in generators.items():
            calibration.on = name == "DSpark 5"
            before = (clocks[name].tokens, clocks[name].seconds) if clocks else (0, 0.0)
            run_v4engine(g, [prompts[i] for i in group], [new_tokens[i] for i in group], tallies[name],
                         temperature, group_seed)
            if clocks:
                per_round[name].append((clocks[name].tokens - before[0]) / (clocks[name].seconds - before[1]))
    calibration.on = False
    for clock in clocks.values():
        clock.detach()
    owners = [i for group, _ in groups for i in group]
    return tallies, per_round, owners


def speed_intervals(per_round: dict[str, list[float]], baseline: str = "MTP 0", resamples: int = 2000,
                    seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """Each system's full-step tokens/s as a ratio to `baseline`'s in the same round (the systems take turns, so a
    round's machine state is shared), its mean over rounds with a 95% bootstrap interval over rounds: whether a
    system is slower than MTP 0 or only the machine was, in one round. By system: (mean, low, high)."""
    ratios = {name: np.asarray(rates) / np.asarray(per_round[baseline]) for name, rates in per_round.items()}
    rounds = len(per_round[baseline])
    picks = np.random.default_rng(seed).integers(0, rounds, (resamples, rounds))
    return {name: (float(r.mean()), *(float(x) for x in np.percentile(r[picks].mean(axis=1), [2.5, 97.5])))
            for name, r in ratios.items()}


def acceptance_intervals(tallies: dict[str, Tally], owners: list[int], baseline: str = "MTP 3",
                         resamples: int = 2000, seed: int = 0) -> dict[str, tuple[float, float, float, float, float]]:
    """Each drafting system's mean acceptance length with a 95% bootstrap interval over prompts (a prompt's requests
    resampled together), and its difference from `baseline` with the same prompts drawn for both: a prompt's
    difficulty moves every system alike, so the paired difference is tighter than the two intervals suggest.
    By system: (length, low, high, difference, its low, its high)."""
    owners_ = np.asarray(owners)
    count = int(owners_.max()) + 1
    picks = np.random.default_rng(seed).integers(0, count, (resamples, count))     # [resamples, prompts]

    def per_prompt(tally: Tally) -> np.ndarray:                                       # [prompts, 2]
        steps, accepted = np.asarray(tally.verifies, float).T
        return np.stack([np.bincount(owners_, steps, count), np.bincount(owners_, accepted, count)], axis=1)

    def length(sums: np.ndarray) -> np.ndarray:                                       # [..., 2] -> [...]
        return 1 + sums[..., 1] / sums[..., 0]

    sums = {name: per_prompt(t) for name, t in tallies.items() if t.metrics is not None and t.metrics.mtp}
    pooled = {name: float(length(s.sum(axis=0))) for name, s in sums.items()}
    boot = {name: length(s[picks].sum(axis=1)) for name, s in sums.items()}           # [resamples]
    return {name: (pooled[name], *np.percentile(boot[name], [2.5, 97.5]), pooled[name] - pooled[baseline],
                   *np.percentile(boot[name] - boot[baseline], [2.5, 97.5])) for name in sums}


def interval_table(tallies: dict[str, Tally], owners: list[int]) -> None:
    intervals = acceptance_intervals(tallies, owners)
    print(f"mean acceptance length, 95% intervals over the {max(owners) + 1} prompts (bootstrap, "
          f"{len(owners) // (max(owners) + 1)} requests each):\n")
    print("| system | mean acc. length | 95% interval | minus MTP 3 | 95% interval |\n|---|---|---|---|---|")
    for name, (mal, low, high, diff, dlow, dhigh) in intervals.items():
        print(f"| {name} | {mal:.2f} | {low:.2f} - {high:.2f} | {diff:+.2f} | {dlow:+.2f} - {dhigh:+.2f} |")
    print("\n(a scheduled drafter's length counts the steps that verified a draft, not those it decoded plainly: "
          "compare its tokens/s)\n")


def report(tallies: dict[str, Tally], per_round: dict[str, list[float]], batch: int, temperature: float,
           groups: str) -> dict[str, float]:
    """Print the table and the ratios (over the whole run, and over full steps where measured: per round, their
    mean and its interval); tokens/s by system."""
    print(table(f"batch {batch} ({groups}, temperature {temperature:g})", {n: t.row() for n, t in tallies.items()}))
    base = tallies["MTP 0"]
    rates = {n: t.tokens / t.seconds for n, t in tallies.items()}
    intervals = speed_intervals(per_round) if per_round else {}
    for name, t in tallies.items():
        same = "" if temperature else f"; tokens {'equal' if t.outputs == base.outputs else 'DIFFER from'} MTP 0's"
        full = ""
        if intervals:
            mean, low, high = intervals[name]
            spread = f" ({low:.2f}-{high:.2f} over {len(per_round[name])} rounds)" if len(per_round[name]) > 1 else ""
            full = f"; full steps {statistics.mean(per_round[name]):.1f} tokens/s, {mean:.2f}x MTP 0{spread}"
        print(f"  {name}: {rates[name] / rates['MTP 0']:.2f}x MTP 0{full}{same}")
    print()
    return rates


def call_costs(generators: dict[str, Generator], prompts: list[list[int]], batch: int, new_tokens: int | list[int],
               tallies: dict[str, Tally]) -> None:
    """Per-call medians in decodes (calls of `batch` rows: at batch 1, four prompts; above, a saturated run over
    all of them), and the bound each drafter's calls set at its acceptance length."""
    clocks = {}
    for name in ["MTP 0", "MTP 3", *(f"DSpark {n}" for n in WIDTHS)]:
        clocks[name] = CallClock(generators[name].scheduler.mtp, rows=batch)
        generators[name].scheduler.calls.on_call = clocks[name]
        for group in ([p] for p in prompts[:4]) if batch == 1 else [prompts]:
            run_v4engine(generators[name], group, new_tokens if batch > 1 else new_tokens[0], Tally())
        generators[name].scheduler.calls.on_call = None
    unit = clocks["MTP 0"].median("decode")
    print(f"### per-call costs at batch {batch} (medians, in decodes) and the bound they set\n")
    print("| system | verify of k+1 | draft cycle | mean acc. length | bound | measured | of the bound |")
    print("|---|---|---|---|---|---|---|")
    base = tallies["MTP 0"].tokens / tallies["MTP 0"].seconds
    for name, clock in clocks.items():
        if name == "MTP 0":
            continue
        verify, draft = clock.median("verify") / unit, clock.median("draft") / unit
        length = tallies[name].metrics.mean_acceptance_length
        bound = length / (verify + draft)
        measured = tallies[name].tokens / tallies[name].seconds / base
        print(f"| {name} | {verify:.2f} | {draft:.2f} | {length:.2f} | {bound:.2f}x | {measured:.2f}x | "
              f"{measured / bound:.0%} |")
    print(f"\n(decode: {1000 * unit:.2f} ms)\n")


def plot(tallies: dict[str, Tally], calibration: CalibrationLog, path: Path, title: str) -> None:
    """Acceptance per position (MTP 3, DSpark 3/5/7) and the confidence head's calibration curve."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ("MTP 3", *(f"DSpark {n}" for n in WIDTHS)):
        per = tallies[name].metrics.per_position_acceptance
        left.plot(range(1, len(per) + 1), per, marker="o", label=name)
    left.set(xlabel="draft position", ylabel="share of verifies accepting it", ylim=(0, 1),
             title=f"acceptance per position ({title})")
    left.legend()
    bins = calibration.binned()
    right.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect calibration")
    right.plot([b[0] for b in bins], [b[1] for b in bins], marker="o", label="DSpark 5 (binned)")
    right.scatter([p for p, _ in calibration.by_position(5)], [a for _, a in calibration.by_position(5)],
                  marker="x", color="black", zorder=3, label="per position")
    right.set(xlabel="predicted survival (product of confidences)", ylabel="observed acceptance",
              xlim=(0, 1), ylim=(0, 1), title="confidence head calibration")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def calibration_tables(calibration: CalibrationLog) -> None:
    print("### DSpark 5 calibration: predicted survival against observed acceptance\n")
    print("| position | predicted | observed |\n|---|---|---|")
    for j, (p, a) in enumerate(calibration.by_position(5), 1):
        print(f"| {j} | {p:.2f} | {a:.2f} |")
    print("\n| predicted bin mean | observed | drafts |\n|---|---|---|")
    for p, a, n in calibration.binned():
        print(f"| {p:.2f} | {a:.2f} | {n} |")
    print()


def slice_costs(work: Path, prompt_tokens: int, batch_sizes: list[int]) -> None:
    """The wide slice with random weights, MTP 3 against DSpark 5: per-call medians, decode units."""
    engines = {}
    for drafter, k in (("mtp", 3), ("dspark", 5)):
        checkpoint = work / f"slice-{drafter}"
        if not (checkpoint / "config.json").is_file():
            make_tiny(checkpoint, config="slice", quantize="mxfp4", dtype="bfloat16", drafter=drafter)
        engines[drafter] = built_engine(checkpoint, work, mtp=k, name=f"engine-{drafter}")
    rng = np.random.default_rng(0)
    print("| batch | decode | MTP 3: verify of 4 | MTP 3: draft cycle | DSpark 5: verify of 6 | "
          "DSpark 5: draft cycle |")
    print("|---|---|---|---|---|---|")
    for batch in batch_sizes:
        medians = {}
        for drafter, engine in engines.items():
            for k in (0, None):
                g = Generator.from_engine_dir(engine, own_process=True, prefix_cache=False, mtp=k,
                                              limits=Limits(max_batch=batch), confidence_scheduling=False)
                clock = CallClock(g.scheduler.mtp)
                g.scheduler.calls.on_call = clock
                vocab = g.manifest.model.vocab_size
                prompts = [[int(t) for t in rng.integers(2, vocab, prompt_tokens)] for _ in range(batch)]
                run_v4engine(g, prompts, 12, Tally())
                medians[(drafter, k)] = {kind: statistics.median(s) for kind, s in clock.seconds.items()}
        unit = medians[("mtp", 0)]["decode"]
        cells = [f"{1000 * unit:.1f} ms"] + [f"{medians[(d, None)][kind] / unit:.2f}" for d in engines
                                            for kind in ("verify", "draft")]
        print(f"| {batch} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_arguments(p)
    p.add_argument("--dspark", type=Path, default=DSPARK,
                   help="the DSpark checkpoint (the same target as --checkpoint with its DSpark drafter)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-dspark"), help="engine folder (reused)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                   help="batch sizes measured; above 1 a saturated batch (default 1 8)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0: greedy; above 0 sampled")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampled requests and of --vary-new-tokens' draws (default 0)")
    p.add_argument("--vary-new-tokens", action="store_true",
                   help="each request's new tokens drawn from new-tokens/2 .. 3 new-tokens/2 (the same draws for "
                        "every system), as a server's requests end apart; default: new-tokens each")
    p.add_argument("--draws", type=int, default=1,
                   help="at batch 1 and a temperature above 0, requests per prompt (seeded seed, seed + 1, ...): "
                        "one draw's mean acceptance length moves by about 0.3 over 24 prompts at T = 1 (default 1)")
    p.add_argument("--rounds", type=int, default=3,
                   help="above batch 1: times each system runs the saturated batch, the systems taking turns")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "dspark.png", help="the PNG written")
    p.add_argument("--slice", action="store_true", help="call costs on the wide slice instead (random weights)")
    args = p.parse_args()
    if args.draws < 1:
        p.error(f"--draws must be at least 1, not {args.draws}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    if not args.slice and max(args.batch_sizes) > args.prompts:
        p.error(f"--batch-sizes {max(args.batch_sizes)}: a saturated batch needs at least as many --prompts "
                f"({args.prompts})")
    if args.slice:
        slice_costs(args.work, args.prompt_tokens, args.batch_sizes)
        return
    prompts = held_out_prompts(args.checkpoint / "tokenizer.json", args.prompts, args.prompt_tokens,
                               args.new_tokens, args.seed)
    lengths = [args.new_tokens] * len(prompts)
    new_tokens = f"{args.new_tokens} new tokens each"
    if args.vary_new_tokens:
        lengths = [int(n) for n in np.random.default_rng(args.seed).integers(args.new_tokens // 2,
                                                                            3 * args.new_tokens // 2 + 1, len(prompts))]
        new_tokens = f"{args.new_tokens // 2}-{3 * args.new_tokens // 2} new tokens ({sum(lengths)} in all)"
    calibration = CalibrationLog()
    first = None
    for batch in args.batch_sizes:
        generators = systems(args, batch)
        for g in generators.values():                        # warm up every system once, untimed
            run_v4engine(g, prompts[:batch], 8, Tally())
        for temperature in args.temperatures:
            tallies, per_round, owners = compare(generators, prompts, batch, temperature, lengths, args.seed,
                                                 calibration, args.rounds, args.draws)
            kind = "one at a time" if batch == 1 else "a saturated batch"
            drawn = f", {args.draws} draws each" if batch == 1 and temperature > 0 and args.draws > 1 else ""
            report(tallies, per_round, batch, temperature, f"{len(prompts)} held-out prompts of "
                   f"{args.prompt_tokens} tokens, {new_tokens}, {kind}{drawn}")
            interval_table(tallies, owners)
            if temperature == args.temperatures[0]:
                call_costs(generators, prompts, batch, lengths, tallies)
            first = first or (tallies, batch, temperature)
        del generators
    tallies, batch, temperature = first
    calibration_tables(calibration)
    plot(tallies, calibration, args.plot, f"batch {batch}, temperature {temperature:g}")


if __name__ == "__main__":
    main()
