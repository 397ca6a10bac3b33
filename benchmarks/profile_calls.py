"""Where a verify's cost goes: ONNX Runtime's profiler, per op type, a decode (q = 1) against a verify (q = k + 1).

Issue 16 asks what makes a verify of k + 1 tokens cost more than a decode. This runs one prompt through an MTP 0
generator (every target call after the prefill is a decode) and through an MTP k generator (every one is a
verify), each engine's target session profiled by ONNX Runtime, then sums each op type's time over the calls
after the prefill and divides by their number: a table of ms per call, decode and verify side by side, largest
growth first. The profiler records every node, which costs far more than tiny-v4's small nodes themselves (a
decode profiled takes about ten times its 4-5 ms): the columns rank where a verify's extra time goes, they are
not call costs (benchmarks/bench_generate.py measures those).

    .venv/bin/python -m benchmarks.profile_calls --engine /tmp/tiny-engine [--tokens 48] [--top 20]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import onnxruntime as ort

from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams
from v4engine.runtime.sessions import onnxruntime as session_module

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 14, 70, 2, 33]


def _profiled_options(prefix: str) -> type:
    """SessionOptions that profile every session made with them into files starting with `prefix`."""
    class Profiled(ort.SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    return Profiled


def op_times(profile: Path) -> tuple[dict[str, float], int]:
    """ms per op type summed over every run after the first (the prefill), and the number of those runs."""
    events = json.loads(profile.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    later = runs[1:]
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if any(start <= e["ts"] <= end for start, end in later):
            totals[e["args"]["op_name"]] += e["dur"] / 1000.0
    return totals, len(later)


def profile_target(engine: Path, mtp: int, tokens: int, work: Path) -> tuple[dict[str, float], int]:
    """Per-op ms summed over the target's calls after the prefill, for a generator of draft length `mtp`."""
    prefix = str(work / f"mtp{mtp}")
    real = session_module.ort.SessionOptions
    session_module.ort.SessionOptions = _profiled_options(prefix)
    try:
        generator = Generator.from_engine_dir(engine, mtp=mtp, prefix_cache=False)
    finally:
        session_module.ort.SessionOptions = real
    generator.generate([PROMPT], SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    target = generator.scheduler.target_session
    path = Path(target._session.end_profiling())
    if generator.scheduler.draft_session is not None:
        Path(generator.scheduler.draft_session._session.end_profiling()).unlink()
    return op_times(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=Path, required=True, help="an ONNX Runtime engine built with --mtp k >= 1")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per generation (default 48)")
    parser.add_argument("--top", type=int, default=20, help="op types to print, largest growth first (default 20)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mtp = Generator.from_engine_dir(args.engine).scheduler.mtp
        decode, decodes = profile_target(args.engine, 0, args.tokens, work)
        verify, verifies = profile_target(args.engine, mtp, args.tokens, work)
    per_decode = {op: ms / decodes for op, ms in decode.items()}
    per_verify = {op: ms / verifies for op, ms in verify.items()}
    ops = sorted(set(per_decode) | set(per_verify), key=lambda o: per_decode.get(o, 0) - per_verify.get(o, 0))
    growth = {op: per_verify.get(op, 0.0) - per_decode.get(op, 0.0) for op in ops}
    print(f"target calls after the prefill: {decodes} decodes (q = 1), {verifies} verifies (q = {mtp + 1}); "
          f"profiled op time per call (not call costs, see above): decode {sum(per_decode.values()):.2f} ms, "
          f"verify {sum(per_verify.values()):.2f} ms; growth summed over the op types that grew: "
          f"{sum(g for g in growth.values() if g > 0):+.2f} ms\n")
    print("| op | decode ms | verify ms | verify - decode |")
    print("|---|---|---|---|")
    for op in ops[: args.top]:
        d, v = per_decode.get(op, 0.0), per_verify.get(op, 0.0)
        print(f"| {op} | {d:.3f} | {v:.3f} | {v - d:+.3f} |")


if __name__ == "__main__":
    main()
