"""A backend's engine against the ONNX Runtime engine of the same checkpoint: every graph on the inputs of a first
call (a prefill on empty caches), through polygraphy's comparator.

The TensorRT and MIGraphX backend tests compare their graphs run by ONNX Runtime this way, and the GPU check
(tests/test_gpu_tensorrt.py) the TensorRT engines themselves. polygraphy is imported only when a comparison runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from v4engine.contract.engine import EngineManifest
from v4engine.runtime.cache import CachePool, SequenceCache
from v4engine.runtime.pool_arrays import HostArrays


def first_call_feeds(manifest: EngineManifest, graph: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    """The inputs of a first call of `graph` (a prefill on empty caches): random tokens, and random values for
    every streams-like input (a stage's `hidden_in`, the draft's `hidden` or `captured`, `captured_in`)."""
    rng = np.random.default_rng(0)
    cfg = manifest.model
    layout = manifest.layout_of(graph)
    pool = CachePool(layout, batch, batch * layout.blocks_for(seq), HostArrays("fp32"))
    caches = [SequenceCache(pool) for _ in range(batch)]
    for cache in caches:
        cache.reserve(seq)
    feeds = {"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)),
             "positions": np.tile(np.arange(seq), (batch, 1)), **pool.feeds(caches)}
    if graph == "draft":              # greedy and sampling rows alike
        feeds |= {"lengths": np.full(batch, seq, np.int64),
                  "temperature": np.arange(batch, dtype=np.float32) % 2,
                  "top_k": np.zeros(batch, np.int64), "top_p": np.ones(batch, np.float32),
                  "uniforms": rng.random((batch, manifest.mtp), dtype=np.float32)}
    sizes = {"batch": batch, "seq": seq}
    for spec in manifest.graphs[graph].inputs:
        if spec.name not in feeds:
            shape = tuple(sizes.get(d, d) if isinstance(d, str) else d for d in spec.shape)
            feeds[spec.name] = rng.integers(0, cfg.vocab_size, shape) if spec.dtype == "int64" else \
                rng.standard_normal(shape).astype(np.float32)
    return {spec.name: feeds[spec.name] for spec in manifest.graphs[graph].inputs}


def compare_with_onnxruntime(manifest: EngineManifest, reference: Path, runner: Callable[[str], Any], atol: float
                             ) -> tuple[bool, str]:
    """Every graph of `manifest`: runner(graph) (a polygraphy runner) against ONNX Runtime on the graph of the
    engine folder `reference`, on a first call. Returns (all equal within atol, one line naming each graph)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    verdicts, ok = [], True
    for graph in manifest.graphs:
        runners = [OnnxrtRunner(SessionFromOnnx(str(reference / f"{graph}.onnx"))), runner(graph)]
        results = Comparator.run(runners, data_loader=[first_call_feeds(manifest, graph, 2, 9)])
        same = bool(Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=atol, rtol=0)))
        ok &= same
        verdicts.append(f"{graph} {'matches' if same else 'DIFFERS'}")
    return ok, ", ".join(verdicts) + f" ONNX Runtime within {atol} (polygraphy)"
