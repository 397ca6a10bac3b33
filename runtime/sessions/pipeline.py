"""The target's pipeline stages (contract/stages.py) run as one session: what the scheduler calls `target`.

Each stage is a session of its own on its own device. A call feeds every stage the call's tokens, positions, slots,
block table and its own layers' pools, runs the stages in order, and hands each stage's output streams (`hidden`)
to the next as `hidden_in` (and, for DSpark, the rows captured so far, `captured` as `captured_in`): on the device, moved device to device, where both stages keep torch tensors (the
stages before the last leave `hidden` on their device); through the host otherwise. The outputs are the last
stage's logits and streams and every stage's new rows, exactly what the single target graph returns.

Micro-batches. With one call over B rows, stage i+1 waits for stage i: on N devices each is busy 1/N of the time.
With `microbatches` M > 1 a call's rows are cut into M slices, and stage i works on slice m while stage i+1 works
on slice m-1 (one worker thread per stage; ONNX Runtime, TensorRT and MIGraphX release the GIL while they run).
Rows are independent in every graph, so the outputs are those of the whole batch, in order. It pays only where the
stages have devices of their own: on one CPU all stages share the same cores (benchmarks/RESULTS.md measures it).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from v4engine.contract.errors import V4EngineError
from v4engine.contract.layout import CAPTURED, CAPTURED_IN, NEW_PREFIX, STAGE_INPUT, STREAMS, TensorSpec

from ..pool_arrays import to_numpy
from . import EngineSession

# a stage's inputs that are the previous stage's outputs: its streams, and the rows a drafter captures (DSpark)
HANDED_ON = {STAGE_INPUT: STREAMS, CAPTURED_IN: CAPTURED}


class PipelineSession(EngineSession):
    """Stage sessions in pipeline order, run as one target session."""

    def __init__(self, stages: list[EngineSession], microbatches: int = 1):
        self.stages, self.microbatches = stages, max(1, microbatches)
        names = dict.fromkeys(spec.name for stage in stages for spec in stage.inputs if spec.name not in HANDED_ON)
        specs = {spec.name: spec for stage in stages for spec in stage.inputs}
        self.inputs = tuple(specs[name] for name in names)
        last = stages[-1].outputs
        self.outputs = tuple(last) + tuple(spec for stage in stages[:-1] for spec in stage.outputs
                                           if spec.name.startswith(NEW_PREFIX))
        self._device_of = {spec.name: stage.pool_device for stage in stages for spec in stage.inputs
                           if spec.name.startswith("pool.")}
        self.pool_device, self.pool_shape = stages[-1].pool_device, _pool_shape(stages)
        for stage in stages[:-1]:           # what the next stage takes stays where it can without the host
            stage.keep_on_device = frozenset(HANDED_ON.values())
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"v4-stage{i}") for i in range(len(stages))] \
            if self.microbatches > 1 else []

    def pool_device_of(self, pool: str) -> str | None:
        """Where the stage that reads `pool` keeps it; a pool no stage reads (the draft's) beside the last stage."""
        return self._device_of.get(pool, self.pool_device)

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        batch = feeds["input_ids"].shape[0]
        if self.microbatches == 1 or batch == 1:
            return self._run_rows(feeds)
        slices = min(self.microbatches, batch)
        edges = [batch * m // slices for m in range(slices + 1)]
        pending: list[Future] = []
        for start, stop in zip(edges, edges[1:]):
            part = {spec.name: feeds[spec.name][start:stop] if _batched(spec) else feeds[spec.name]
                    for spec in self.inputs}
            previous: Future | None = None
            for i in range(len(self.stages)):
                previous = self._workers[i].submit(self._stage_after, i, part, previous)
            pending.append(previous)
        wait(pending)           # all of them, failed or not: no stage may still run when the call returns
        results = [future.result() for future in pending]
        return {name: _concatenate([r[name] for r in results]) for name in results[0]}

    def _run_rows(self, feeds: dict[str, Any]) -> dict[str, Any]:
        outputs: dict[str, Any] = {}
        for i in range(len(self.stages)):
            outputs = self._stage(i, feeds, outputs)
        return outputs

    def _stage_after(self, i: int, feeds: dict[str, Any], previous: Future | None) -> dict[str, Any]:
        """Stage i on one micro-batch, once stage i-1 has it (that stage's future)."""
        return self._stage(i, feeds, previous.result() if previous is not None else {})

    def _stage(self, i: int, feeds: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        """Stage i's call after the stages before it (`before`: their outputs so far): those outputs with its own."""
        stage = self.stages[i]
        mine = {spec.name: feeds[spec.name] for spec in stage.inputs if spec.name not in HANDED_ON}
        for spec in stage.inputs:
            if spec.name in HANDED_ON:
                mine[spec.name] = _moved(before.pop(HANDED_ON[spec.name]), stage.pool_device)
        return before | stage.run(mine)


def _pool_shape(stages: list[EngineSession]) -> dict[str, int] | None:
    """The pool sizes every stage of static shapes takes (one pool size for all the stages' pools; a stage of sliding
    layers only has no blocks of its own); None when no stage fixes them."""
    merged: dict[str, int] = {}
    for stage in stages:
        for name, size in (stage.pool_shape or {}).items():
            if merged.setdefault(name, size) != size:
                raise V4EngineError(f"the pipeline's stages take pools of different sizes ({name}: {merged[name]} "
                                    f"and {size}); rebuild the engine")
    return merged or None


def _batched(spec: TensorSpec) -> bool:
    return bool(spec.shape) and spec.shape[0] == "batch"


def _moved(streams: Any, device: str | None) -> Any:
    """A stage's output streams where the next stage reads them: its device, or the host. A copy between GPUs is
    waited for: the next stage's engine runs on a stream of its own, and the source's memory goes back to the
    previous stage (already on its next micro-batch) as soon as it is dropped."""
    if isinstance(streams, np.ndarray):
        return streams
    if device is None:
        return to_numpy(streams)
    moved = streams.to(device)
    if moved.device.type == "cuda" and moved.device != streams.device:
        import torch

        torch.cuda.current_stream(streams.device).synchronize()
    return moved


def _concatenate(values: list[Any]) -> Any:
    if isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    import torch

    return torch.cat(values)


__all__ = ["PipelineSession"]
