"""`make demo`: make the tiny checkpoint, check it, build it with --mtp 3, generate, and show acceptance.

The tiny checkpoint is random, with an MTP layer made to agree with the target by construction
(`v4build make-tiny --agree 0.05`), in FP8 like the release. It has no tokenizer, so the demo prints token
ids. A V4 trained on real text replaces it later. The demo also shows that MTP is lossless: greedy tokens with
MTP = 3 equal those without drafting.
"""
from __future__ import annotations

import sys
from pathlib import Path

from v4engine.builder.cli import main as v4build
from v4engine.runtime.generator import Generator
from v4engine.runtime.sampling import SamplingParams

OUT = Path(__file__).resolve().parent.parent / "demo-out"
PROMPT = [0, 17, 42, 99, 5, 63, 8, 120, 33, 71, 2, 64]
SAMPLING = SamplingParams(max_new_tokens=40, ignore_eos=True)


def main() -> int:
    checkpoint, engine = OUT / "tiny-v4", OUT / "tiny-v4-engine"
    if not (checkpoint / "config.json").exists():
        v4build(["make-tiny", str(checkpoint), "--config", "mixed", "--quantize", "fp8", "--agree", "0.05"])
    if v4build(["check", "--checkpoint", str(checkpoint), "--mtp", "3"]):
        return 1
    if not (engine / "engine.json").exists() and v4build(["--checkpoint", str(checkpoint), "--mtp", "3",
                                                           "--output", str(engine)]):
        return 1
    generator = Generator.from_engine_dir(engine)
    [result] = generator.generate([PROMPT], SAMPLING)
    [plain] = Generator.from_engine_dir(engine, mtp=0).generate([PROMPT], SAMPLING)
    print(f"\nprompt ids: {PROMPT}")
    print(f"generated:  {result.token_ids}")
    print(f"lossless:   greedy with MTP = 3 {'equals' if result.token_ids == plain.token_ids else 'DIFFERS FROM'} "
          "greedy without drafting\n")
    print(generator.totals.table())
    return 0 if result.token_ids == plain.token_ids else 1


if __name__ == "__main__":
    sys.exit(main())
