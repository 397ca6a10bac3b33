"""Engine sessions: one small interface, one module per backend (contract/backends.py names each one's class)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from v4engine.contract.backend_options import BackendOptions
from v4engine.contract.backends import BACKENDS
from v4engine.contract.engine import EngineManifest, TensorSpec
from v4engine.contract.errors import V4EngineError
from v4engine.contract.layout import NEW_PREFIX


SAMPLED = frozenset({"logits", "draft_probs"})     # the outputs tokens are decided from (runtime/samplers.py)


class EngineRunError(V4EngineError):
    """An engine call failed, or returned outputs of other shapes than its graph declares."""


class EngineSession(ABC):
    """One compiled graph of an engine directory: named arrays in, named arrays out.

    `pool_device` says where the session reads the cache pools: None, host numpy arrays (and every output is
    numpy); a torch device ("cuda:0"), torch tensors there, read in place, and the `new.*` outputs may be torch
    tensors there too (the pool writes them on the device), as may the distributions tokens are decided from
    (`SAMPLED`: the target's logits, the draft's probabilities; runtime/samplers.py DeviceSampler decides there) and
    those named in `keep_on_device` (a pipeline stage's streams, for the next stage). The other outputs are always
    numpy. `pool_shape`: the pool sizes
    (`pool_slots`, `pool_blocks`) a session of static shapes takes and no other (MIGraphX's programs), which the
    scheduler then allocates; None: any."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    pool_device: str | None = None
    pool_shape: dict[str, int] | None = None
    keep_on_device: frozenset[str] = frozenset()    # outputs besides `new.*` left on the device (a stage's streams)

    @classmethod
    def own_process(cls, options: BackendOptions) -> None:
        """Take process-wide resources for speed: asked once by a program that owns its process (v4generate, the
        demo, the benchmarks), never by the library on its own. Nothing by default."""

    @classmethod
    def prefill_chunk(cls, options: BackendOptions, devices: object, manifest: EngineManifest | None = None
                      ) -> int | None:
        """The prompt tokens per call this backend runs best with where the engine allows more and the caller
        named none (Limits.max_prefill_chunk), on these options and `devices` (for the engine `manifest`); None:
        the engine's limit."""
        return None

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every input by name) and return every output by name."""

    def pool_device_of(self, pool: str) -> str | None:
        """Where this session reads the pool input `pool` (a pipeline's stages each on their own device)."""
        return self.pool_device

    def on_device(self, output: str) -> bool:
        """Whether `output` may stay a torch tensor on the session's device (new rows, what tokens are decided from,
        and keep_on_device)."""
        return output.startswith(NEW_PREFIX) or output in self.keep_on_device or (
            self.pool_device is not None and output in SAMPLED)


def checked_outputs(session: EngineSession, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                    graph: object) -> dict[str, np.ndarray]:
    """`outputs`, once each has its declared rank and fixed dimensions, and the feeds' batch and sequence length:
    what the scheduler indexes them by (a graph that loads but answers otherwise is refused, not indexed)."""
    batch, seq = feeds["positions"].shape                    # every graph takes positions [batch, seq]
    sizes = {"batch": batch, "seq": seq}
    for spec in session.outputs:
        value = outputs.get(spec.name)
        want = [sizes.get(d, d) if isinstance(d, str) else d for d in spec.shape]
        if value is None or value.ndim != len(want) or any(isinstance(w, int) and w != d
                                                           for w, d in zip(want, value.shape)):
            got = None if value is None else list(value.shape)
            raise EngineRunError(f"{graph}: output {spec.name} has shape {got}, not {spec.shape} (batch {batch}, "
                                 f"seq {seq}); refused")
    return outputs


def open_session(engine_dir: str | Path, manifest: EngineManifest, graph: str, device: int | None = None,
                 options: BackendOptions | None = None, alternating: bool = False) -> EngineSession:
    """The session for `graph` (the draft, or a target stage) of the engine's backend, on GPU `device` (None: the
    backend's default: ONNX Runtime's providers as given, TensorRT's and MIGraphX's current GPU), with the backend's
    session options (default: its defaults). `alternating`: it takes turns with other sessions of this process on
    the same cores (target and draft graph, pipeline stages)."""
    backend = BACKENDS[manifest.backend]
    return backend.session_class()(engine_dir, manifest, graph, device=device,
                                   options=options or backend.session_options(), alternating=alternating)


def open_target(engine_dir: str | Path, manifest: EngineManifest, devices: list[int] | None = None,
                microbatches: int | None = None, **session: Any) -> EngineSession:
    """The target: its one graph's session, or its pipeline stages as one (sessions/pipeline.py), stage i on
    devices[i] (`session`: open_session's options). microbatches: slices of a call's rows in flight on different
    stages at once (default: one per stage when each stage has a GPU of its own, else none)."""
    names = manifest.stage_graphs
    stages = [open_session(engine_dir, manifest, name, device=device, **session)
              for name, device in zip(names, devices if devices is not None else [None] * len(names))]
    if len(stages) == 1:
        return stages[0]
    from .pipeline import PipelineSession

    if microbatches is None:
        microbatches = len(stages) if devices is not None and len(set(devices)) == len(devices) else 1
    return PipelineSession(stages, microbatches)
