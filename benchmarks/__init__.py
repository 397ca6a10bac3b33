"""The benchmarks: modules run from the repository root, e.g. `.venv/bin/python -m benchmarks.bench_generate`.
Their figures go to benchmarks/RESULTS.md."""
from __future__ import annotations

from pathlib import Path

from v4engine.builder.cli import main as v4build


def built_engine(checkpoint: Path, work: Path, mtp: int = 3, *flags: str, name: str = "engine") -> Path:
    """work/name: the engine of `checkpoint` with --mtp `mtp` and v4build's `flags`, built unless a finished one this
    runtime reads is there (reruns reuse it; an engine of an older format is rebuilt; v4build --force replaces only
    folders of its own)."""
    engine = work / name
    work.mkdir(parents=True, exist_ok=True)
    stages = int(flags[flags.index("--pipeline-stages") + 1]) if "--pipeline-stages" in flags else 1
    if not _readable(engine, mtp, stages):
        if v4build(["--checkpoint", str(checkpoint), "--mtp", str(mtp), "--output", str(engine), *flags, "--force",
                    "--quiet"]):
            raise SystemExit(f"v4build failed for {checkpoint}")
    return engine


def _readable(engine: Path, mtp: int, stages: int) -> bool:
    """Whether `engine` is one this runtime reads, built with this k and this many pipeline stages."""
    from v4engine.contract.engine import EngineManifest
    from v4engine.contract.engine_folder import EngineFormatError

    try:
        manifest = EngineManifest.read(engine)
    except EngineFormatError:
        return False
    return manifest.mtp == mtp and len(manifest.stages) == stages
