"""v4engine.triton_repo: a Triton Inference Server model repository that serves an engine directory.

    from v4engine.triton_repo import render
    render("out/engine", "out/triton-repo")            # or: v4build triton-repo out/engine out/triton-repo

The repository holds four models (config.py): `preprocessing` -> `v4_generate` -> `postprocessing`, wired by
`ensemble`, the model clients call (HTTP generate / generate_stream, gRPC streaming). The Python models' code is
this package's `models/`; each rendered model.py only imports it, so the server's Python environment needs
v4engine installed (and, for Triton 2.51's Python backend, numpy < 2). The engine directory is referenced by its
absolute path in the configs' parameters, not copied. `gpu=True` renders the same contract with v4_generate on
KIND_GPU instances (ONNX Runtime's CUDA provider), `gpus=[0, 1]` with each instance spanning those GPUs, one per
pipeline stage of the engine (KIND_MODEL). `drafter` and `mtp` choose the drafting method and the draft tokens per
step, as Generator.from_engine_dir takes them. server.py starts the Triton that the nvidia-pytriton wheel
bundles on a rendered repository.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from v4engine.contract.backends import BACKENDS
from v4engine.contract.engine import EngineManifest
from v4engine.contract.errors import V4EngineError
from v4engine.contract.stages import check_devices
from v4engine.contract.staging import Ours, check_destination, staged_folder
from v4engine.runtime.generator import drafter_tokens

from .config import STEPS, Options, model_configs

MODEL_PY = '''"""Triton Python model `{name}` of a v4engine repository: {doc}."""
from v4engine.triton_repo.models.{name} import TritonPythonModel  # noqa: F401
'''


def _repository_entry(entry: PurePosixPath) -> bool:
    """What render() writes, and the Python backend's byte-code cache beside each model.py."""
    parts = entry.parts
    if parts[0] not in {"ensemble", *(s.name for s in STEPS)}:
        return False
    return len(parts) == 1 or parts[1:] in (("config.pbtxt",), ("1",), ("1", "model.py"), ("1", "__pycache__")) \
        or parts[1:3] == ("1", "__pycache__")


# The only kind of folder `force` replaces
REPOSITORY = Ours("a model repository rendered by v4build triton-repo", "ensemble/config.pbtxt", _repository_entry)


class RenderError(V4EngineError):
    """The repository cannot be rendered as asked (engine directory, output folder, option values)."""


def render(engine_dir: str | Path, out: str | Path, *, gpu: bool = False, max_batch: int | None = None,
           max_queue_size: int = 32, instance_count: int = 1, gpus: Sequence[int] = (), drafter: str | None = None,
           mtp: int | None = None, confidence_scheduling: bool | None = None, report_prefix_hits: bool = False,
           force: bool = False) -> Path:
    """Write the model repository for `engine_dir` to `out` and return `out`.

    max_batch: requests generating together (default: the largest batch the engine was built for);
    max_queue_size: requests that may wait for a batch slot; beyond that a request is refused at once;
    instance_count: v4_generate instances, each with its own scheduler and engine sessions;
    gpus: the GPUs one instance spans, one per pipeline stage of the engine (v4build --pipeline-stages);
    drafter, mtp: the drafting method and draft tokens per step (default: the engine's own drafter and k);
    confidence_scheduling: verify only the drafts that pay (runtime/verify_schedule.py; default: on for DSpark);
    report_prefix_hits: each request's metrics name its prefix_hit_tokens (default: only the Prometheus total, so
    a client cannot learn from them whether another sent a prompt; docs/security.md).
    The repository is written to a temporary folder beside `out` and renamed at the end: a failure leaves
    nothing behind, and `force` replaces an existing `out` only then."""
    engine_dir, out = Path(engine_dir).resolve(), Path(out)
    manifest = EngineManifest.read(engine_dir)
    if not (engine_dir / "tokenizer.json").is_file():
        raise RenderError(f"{engine_dir}: no tokenizer.json; the repository tokenizes text_input with it")
    built_batch = manifest.limits["max_batch"]
    max_batch = built_batch if max_batch is None else max_batch
    limits = (("max_batch", max_batch, 1, built_batch), ("max_queue_size", max_queue_size, 0, None),
              ("instance_count", instance_count, 1, None))
    for name, value, low, high in limits:
        if not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f"from {low} to {high} (the engine was built for batches of {high})" if high else f">= {low}"
            raise RenderError(f"{name} must be an integer {bound} (got {value!r})")
    if gpus:
        gpus = check_devices(gpus, len(manifest.stages), str(engine_dir), RenderError)
    try:                                 # the model must open: checked here, not when Triton loads it
        method, _ = drafter_tokens(manifest, drafter, mtp, manifest.limits["max_prefill_chunk"], str(engine_dir))
    except V4EngineError as e:
        raise RenderError(str(e)) from None
    if confidence_scheduling not in (None, True, False) or (confidence_scheduling and not (
            method is not None and method.gives_confidence)):
        raise RenderError(f"confidence_scheduling {confidence_scheduling!r}: it needs a drafter whose drafts carry "
                          f"a confidence (dspark); this repository's is {method.method if method else 'none'}")
    check_destination(out, force, REPOSITORY)
    if not out.parent.is_dir():
        raise RenderError(f"{out.parent}: no such folder")
    try:
        # on GPUs, a backend whose sessions choose execution providers (ONNX Runtime's) is given CUDA's
        takes = {f.name for f in dataclasses.fields(BACKENDS[manifest.backend].session_options)}
        providers = ("CUDAExecutionProvider", "CPUExecutionProvider") if (gpu or gpus) and "providers" in takes else ()
        options = Options(engine_dir=str(engine_dir), max_seq_len=manifest.limits["max_seq_len"],
                          max_batch=max_batch, max_queue_size=max_queue_size, instance_count=instance_count, gpu=gpu,
                          gpus=tuple(gpus), drafter=drafter, mtp=mtp, providers=providers,
                          confidence_scheduling=confidence_scheduling, report_prefix_hits=report_prefix_hits is True,
                          chat_profile=manifest.chat_profile)
        configs = model_configs(options)
    except ValueError as e:
        raise RenderError(f"{engine_dir}: cannot be written into a config.pbtxt: {e}") from None
    with staged_folder(out, "rendering", force, REPOSITORY) as tmp:
        for name, text in configs.items():
            (tmp / name / "1").mkdir(parents=True)        # the ensemble's version folder stays empty
            (tmp / name / "config.pbtxt").write_text(text)
        for step in STEPS:
            (tmp / step.name / "1" / "model.py").write_text(MODEL_PY.format(name=step.name, doc=step.doc))
    return out
