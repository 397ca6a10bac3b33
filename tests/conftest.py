"""Shared fixtures: tiny checkpoints and engines are made once per test run, shared by the xdist workers."""
from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run interpreted, which must be chosen before triton is first imported
# (import torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from v4engine.builder.export_cache import FOLDER as EXPORT_CACHE
from v4engine.builder.tiny import TINY_CONFIGS, make_tiny

TINY = sorted(TINY_CONFIGS)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker takes its share of the cores (unless OMP_NUM_THREADS says otherwise): ONNX Runtime's
    sessions (runtime/sessions/onnxruntime.py) and torch follow OMP_NUM_THREADS, in the workers, which inherit it
    from here, and in every process they start. A thread per core in each worker made the workers' pools contend
    for the same cores: test_incremental and test_runtime took 1.4 times as long."""
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory, worker_id) -> Path:
    """A folder every xdist worker of this run shares (each worker's base temp lies in it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if worker_id != "master" else root


@pytest.fixture(scope="session", autouse=True)
def export_cache(run_folder) -> Path:
    """Every build of this run, in a worker or in a CLI it starts, takes an export another made of the same graph
    (builder/export_cache.py): each distinct export happens once per run. A test that needs a build slow enough to
    be stopped inside its export runs it without (hostile.env_without_export_cache)."""
    os.environ[EXPORT_CACHE] = str(run_folder / "exports")
    return run_folder / "exports"


@pytest.fixture(scope="session", autouse=True)
def step_costs(run_folder) -> Path:
    """Confidence scheduling's cost profiles (runtime/verify_schedule.py) go to this run's folder, not the user's
    cache: measured once per run for each engine and options, by whichever worker opens it first."""
    from v4engine.runtime.verify_schedule import CACHE_DIR

    os.environ[CACHE_DIR] = str(run_folder / "cache")
    return run_folder / "cache" / "step-costs"


@pytest.fixture(scope="session")
def shared(run_folder) -> Callable[[str, Callable[[Path], object]], Path]:
    """shared(name, make) -> a folder made once per test run by make(folder), whichever xdist worker asks first;
    the others wait for it. Checkpoints and engines are read-only to the tests that share them (a test that
    damages one works on a copy, `engine_copy`), so both workers can share what one built."""
    root = run_folder
    made: dict[str, Path] = {}

    def get(name: str, make: Callable[[Path], object]) -> Path:
        if name not in made:
            folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
            folder.parent.mkdir(exist_ok=True)
            with FileLock(str(root / "shared" / f"{name}.lock")):
                if not done.exists():
                    make(folder)
                    done.touch()
            made[name] = folder
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(shared):
    """tiny_checkpoint(config, **options) -> folder; each distinct request is written once per run."""
    def make(config: str = "mixed", **options) -> Path:
        name = "-".join(["ckpt", config] + [f"{k}={v}" for k, v in sorted(options.items())])
        return shared(name, lambda folder: make_tiny(folder, config=config, **options))

    return make


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint, shared):
    """tiny_engine(config, mtp=3, **checkpoint options) -> (checkpoint folder, engine folder), built once per run.

    Checkpoints use transformers' names so that the same folder also feeds the transformers oracle."""
    from v4engine.builder.build import BuildOptions, build

    def make(config: str = "mixed", mtp: int = 3, **options) -> tuple[Path, Path]:
        checkpoint = tiny_checkpoint(config, names="hf", **options)
        name = "-".join(["engine", config, f"mtp={mtp}"] + [f"{k}={v}" for k, v in sorted(options.items())])
        return checkpoint, shared(name, lambda folder: build(BuildOptions(checkpoint=checkpoint, output=folder,
                                                                          mtp=mtp, progress=False)))

    return make


TRAINED = Path(__file__).resolve().parent.parent / "examples" / "tiny-v4"
TRAINED_DSPARK = TRAINED.parent / "tiny-v4-dspark"


@pytest.fixture(scope="session")
def trained_engine(shared) -> Path:
    """The shipped trained tiny V4 (examples/tiny-v4) built with --mtp 3, once per run."""
    from v4engine.builder.build import BuildOptions, build

    return shared("trained-engine", lambda folder: build(BuildOptions(checkpoint=TRAINED, output=folder, mtp=3,
                                                                      progress=False)))


@pytest.fixture(scope="session")
def trained_dspark_engine(shared) -> tuple[Path, Path]:
    """(checkpoint, engine): the shipped trained DSpark (examples/tiny-v4-dspark) built --mtp 5, once per run."""
    from v4engine.builder.build import BuildOptions, build

    return TRAINED_DSPARK, shared("trained-dspark-engine", lambda folder: build(
        BuildOptions(checkpoint=TRAINED_DSPARK, output=folder, mtp=5, progress=False)))


@pytest.fixture(scope="session")
def cuda_engine(shared):
    """cuda_engine(checkpoint, mtp) -> the engine folder of `checkpoint` built for ONNX Runtime's CUDA provider
    (v4build --device cuda: bf16, the CUDA variant), once per run. Nothing here runs it: tests read its graphs, or
    run them in onnx's reference evaluator (testkit/cuda_reference.py)."""
    from v4engine.builder.build import BuildOptions, build

    def make(checkpoint: Path, mtp: int) -> Path:
        name = f"cuda-engine-{checkpoint.name}-mtp={mtp}"
        return shared(name, lambda folder: build(BuildOptions(checkpoint=checkpoint, output=folder, mtp=mtp,
                                                              backend_options={"device": "cuda"}, progress=False)))

    return make


@pytest.fixture
def engine_copy(tiny_engine, tmp_path) -> Path:
    """A copy of a good tiny engine (config mixed, --mtp 3) for a test to damage or attack."""
    import shutil

    return Path(shutil.copytree(tiny_engine("mixed")[1], tmp_path / "engine", symlinks=True))


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside the folders under attack, whose bytes no output may show (hostile.SECRET)."""
    from hostile import canary

    return canary(tmp_path / "outside")
