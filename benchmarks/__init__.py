"""The benchmarks: modules run from the repository root, e.g. `.venv/bin/python -m benchmarks.bench_generate`.
Their figures go to benchmarks/RESULTS.md."""
from __future__ import annotations

from pathlib import Path

from v4engine.builder.cli import main as v4build


def built_engine(checkpoint: Path, work: Path, mtp: int = 3) -> Path:
    """work/engine: the engine of `checkpoint` with --mtp `mtp`, built unless a finished one is there (reruns reuse
    it; v4build --force replaces only folders of its own)."""
    engine = work / "engine"
    work.mkdir(parents=True, exist_ok=True)
    if not (engine / "engine.json").is_file():
        if v4build(["--checkpoint", str(checkpoint), "--mtp", str(mtp), "--output", str(engine), "--force",
                    "--quiet"]):
            raise SystemExit(f"v4build failed for {checkpoint}")
    return engine
