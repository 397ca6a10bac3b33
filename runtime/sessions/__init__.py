"""Engine sessions: one small interface, one module per backend (runtime/backends.py names each one's class)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from ..backends import BACKENDS
from ..engine import EngineManifest, TensorSpec
from ..errors import V4EngineError


class EngineRunError(V4EngineError):
    """An engine call failed, or returned outputs of other shapes than its graph declares."""


class EngineSession(ABC):
    """One compiled graph of an engine directory: named arrays in, named arrays out.

    `pool_device` says where the session reads the cache pools: None, host numpy arrays (and every output is
    numpy); a torch device ("cuda:0"), torch tensors there, read in place, and the `new.*` outputs may be torch
    tensors there too (the pool writes them on the device). The other outputs are always numpy."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    pool_device: str | None = None

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every input by name) and return every output by name."""


def checked_outputs(session: EngineSession, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                    graph: object) -> dict[str, np.ndarray]:
    """`outputs`, once each has its declared rank and fixed dimensions, and the feeds' batch and sequence length:
    what the scheduler indexes them by (a graph that loads but answers otherwise is refused, not indexed)."""
    batch, seq = feeds["input_ids"].shape
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


def open_session(engine_dir: str | Path, manifest: EngineManifest, graph: str, **options: Any) -> EngineSession:
    """The session for `graph` ('target' or 'draft') of the engine's backend.

    options are ONNX Runtime's (providers, threads, ...), for the backends whose sessions take them; TensorRT and
    MIGraphX engines run on the current GPU."""
    backend = BACKENDS[manifest.backend]
    return backend.session_class()(engine_dir, manifest, graph, **(options if backend.onnxruntime_options else {}))
