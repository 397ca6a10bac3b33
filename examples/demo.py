"""`make demo`: build the shipped tiny V4 with each of its drafters, complete a Python prompt, and show acceptance.

examples/tiny-v4 is a small DeepSeek-V4 with its MTP layer, trained on the Python standard library by
examples/train_tiny.py; examples/tiny-v4-dspark is the same target with the drafter the current V4 releases ship,
DSpark, trained by examples/train_dspark.py (see their READMEs). The demo checks both checkpoints, builds them for
the CPU default (ONNX Runtime) into demo-out/ (MTP with --mtp 3, DSpark with --mtp 5), completes a fixed Python
prompt greedily with MTP 0 (no drafting), MTP 3 and DSpark 5, shows that each drafter is lossless (the same
tokens as no drafting), how fast each is, and their acceptance tables.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from v4engine.builder.checkpoint import Checkpoint
from v4engine.builder.cli import main as v4build
from v4engine.contract.engine import FORMAT_VERSION
from v4engine.runtime.generator import GenerationResult, Generator
from v4engine.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 'import os\n\n\ndef read_file(path):\n    """Return the contents of the file at path."""'
SAMPLING = SamplingParams(max_new_tokens=60, ignore_eos=True)
ROUNDS = 3
# system: (checkpoint, engine built with --mtp, draft tokens per step)
SYSTEMS = {"MTP 0": ("tiny-v4", 3, 0), "MTP 3": ("tiny-v4", 3, 3), "DSpark 5": ("tiny-v4-dspark", 5, 5)}


def engine_is_current(checkpoint: Path, engine: Path) -> bool:
    """An engine already built from this very checkpoint (same fingerprint), in this runtime's format, is reused."""
    manifest = engine / "engine.json"
    if not manifest.exists():
        return False
    written = json.loads(manifest.read_text())
    return (written.get("format_version") == FORMAT_VERSION
            and written.get("checkpoint", {}).get("fingerprint") == Checkpoint.open(checkpoint).fingerprint())


def built(name: str, mtp: int) -> Path | None:
    """examples/NAME checked and built with --mtp `mtp` into demo-out/ (reused when current); None if that failed."""
    checkpoint, engine = ROOT / "examples" / name, ROOT / "demo-out" / f"{name}-engine"
    if v4build(["check", "--checkpoint", str(checkpoint), "--mtp", str(mtp)]):
        return None
    engine.parent.mkdir(exist_ok=True)
    if not engine_is_current(checkpoint, engine) and v4build(["--checkpoint", str(checkpoint), "--mtp", str(mtp),
                                                              "--output", str(engine), "--force"]):
        return None
    return engine


def main() -> int:
    engines = {name: built(name, mtp) for name, mtp, _ in SYSTEMS.values()}
    if None in engines.values():
        return 1
    # the demo is a process of its own: target and draft take turns on one ONNX Runtime pool. Every round runs the
    # same prompt, whose prefill the prefix cache would skip after the first: off, so each round does the same work
    generators = {system: Generator.from_engine_dir(engines[name], mtp=k, own_process=True, prefix_cache=False)
                  for system, (name, _, k) in SYSTEMS.items()}
    results: dict[str, GenerationResult] = {}
    speed = dict.fromkeys(SYSTEMS, 0.0)
    for _ in range(ROUNDS):                     # interleaved, best of ROUNDS: machine noise hits all alike
        for system, generator in generators.items():
            [results[system]] = generator.generate([PROMPT], SAMPLING)
            speed[system] = max(speed[system], results[system].metrics["tokens_per_second"])
    plain = results["MTP 0"]
    print("\n---- prompt + completion (greedy, DSpark 5) " + "-" * 36)
    text = results["DSpark 5"].text
    print(PROMPT + ("\033[1m" + text + "\033[0m" if sys.stdout.isatty() else text))
    print("-" * 80)
    print(f"\n{SAMPLING.max_new_tokens} tokens, batch 1, greedy, best of {ROUNDS} rounds:\n")
    print("| system | tokens/s | vs MTP 0 | mean acceptance length | per position | lossless |")
    print("|---|---|---|---|---|---|")
    lossless = True
    for system, result in results.items():
        same = result.token_ids == plain.token_ids
        lossless &= same
        m = generators[system].totals
        drafted = system != "MTP 0"
        print(f"| {system} | {speed[system]:.0f} | {speed[system] / speed['MTP 0']:.2f}x | "
              f"{f'{m.mean_acceptance_length:.2f}' if drafted else '-'} | "
              f"{' / '.join(f'{a:.2f}' for a in m.per_position_acceptance) if drafted else '-'} | "
              f"{('same tokens as MTP 0' if same else 'DIFFERS FROM MTP 0') if drafted else '-'} |")
    for system in ("MTP 3", "DSpark 5"):
        print(f"\n{system}:\n" + generators[system].totals.table())
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
