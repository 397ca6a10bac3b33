"""The benchmarks: modules run from the repository root, e.g. `.venv/bin/python -m benchmarks.bench_generate`.
Their figures go to benchmarks/RESULTS.md."""
from __future__ import annotations

from pathlib import Path

from v4engine.builder.cli import main as v4build


def built_engine(checkpoint: Path, work: Path, mtp: int = 3) -> Path:
    """work/engine: the engine of `checkpoint` with --mtp `mtp`, built unless a finished one this runtime reads is
    there (reruns reuse it; an engine of an older format is rebuilt; v4build --force replaces only folders of its
    own)."""
    engine = work / "engine"
    work.mkdir(parents=True, exist_ok=True)
    if not _readable(engine):
        if v4build(["--checkpoint", str(checkpoint), "--mtp", str(mtp), "--output", str(engine), "--force",
                    "--quiet"]):
            raise SystemExit(f"v4build failed for {checkpoint}")
    return engine


def _readable(engine: Path) -> bool:
    from v4engine.runtime.engine import EngineManifest
    from v4engine.runtime.engine_folder import EngineFormatError

    try:
        EngineManifest.read(engine)
    except EngineFormatError:
        return False
    return True
