"""What an engine's draft graph is to the engine contract, per drafting method: one `DraftSpec` each.

A DraftSpec says everything about a drafter that engine.json, the exporter, the profiles, the CUDA-graph buckets
and the pipeline plan need, by name: its graph's inputs and outputs, its cache groups, the calls it is made with,
and what it reads of the target beside the streams every target graph returns. engine.json's `drafter` names the
method (`DRAFT_SPECS`); the runtime's drafter of the same name (runtime/drafters/) runs it. A drafter without
weights (prompt lookup) has no graph, so no DraftSpec: it drafts on any engine.

To add a method with a graph: a DraftSpec here, its forward in builder/model/ and its export
(builder/export.py `DRAFT_FORWARDS`), its runtime drafter; docs/extending.md lists the steps and their tests.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from .calls import Call
from .config import V4Config
from .layout import CAPTURED, CAPTURED_IN, DSPARK_KIND, MTP_KIND, STREAMS, CacheLayout, TensorSpec
from .stages import Stage

DRAFT_GRAPH = "draft"           # the draft graph's name in engine.json (its file: draft.onnx)


class DraftSpec(ABC):
    """One drafting method's part of the engine contract."""

    method: str                 # engine.json's `drafter`
    graph = DRAFT_GRAPH

    @abstractmethod
    def layout(self, cfg: V4Config, value_bytes: int = 4) -> CacheLayout:
        """The cache groups it keeps per sequence (engine.json's `caches.groups.draft`)."""

    @abstractmethod
    def graph_specs(self, cfg: V4Config, dtype: str, k: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(inputs, outputs) of its graph drafting k tokens per call."""

    def default_tokens(self, cfg: V4Config) -> int:
        """Draft tokens per step when a build names none (`v4build --mtp` without a value)."""
        return 1

    def captured_layers(self, cfg: V4Config) -> tuple[int, ...]:
        """The target layers whose output streams it reads beside the last stage's `hidden` (none for MTP)."""
        return ()

    def stage_io(self, cfg: V4Config, dtype: str, stage: Stage) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(inputs, outputs) it adds to a target stage to carry what it reads of the captured layers to the last
        stage (those inputs and outputs exist only for it)."""
        return [], []

    def calls(self, k: int, chunk: int) -> dict[Call, tuple[int, int, int]]:
        """Its calls and the (min, opt, max) positions per row of each: EXTEND over a prompt in chunks, CYCLE over
        the 1..k+1 positions a verify committed."""
        return {Call.EXTEND: (1, chunk, chunk), Call.CYCLE: (1, k + 1, k + 1)}


class MtpSpec(DraftSpec):
    """V4's one-layer MTP module (`mtp.0.*`) as a whole draft cycle per call (builder/model/drafting.py).

    In: the target's streams `hidden` and the next tokens over the newly committed positions, each row's valid
    `lengths`, its sampling settings and one uniform number per draft. Out: the `drafts`, the distributions they were
    drawn from (`draft_probs`) and the extend's rows of the layer's window."""

    method = "mtp"

    def layout(self, cfg: V4Config, value_bytes: int = 4) -> CacheLayout:
        return CacheLayout(cfg, [(cfg.num_hidden_layers, MTP_KIND)], value_bytes)

    def graph_specs(self, cfg: V4Config, dtype: str, k: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
        if k < 1:
            raise ValueError(f"the draft graph drafts k >= 1 tokens (got {k})")
        layout = self.layout(cfg)
        inputs = [TensorSpec(STREAMS, dtype, ("batch", "seq", cfg.hc_mult, cfg.hidden_size)),
                  TensorSpec("input_ids", "int64", ("batch", "seq")), TensorSpec("positions", "int64", ("batch", "seq")),
                  TensorSpec("lengths", "int64", ("batch",))] + sampling_inputs(k)
        return inputs + layout.inputs(dtype), draft_outputs(cfg, k) + layout.outputs(dtype)


def sampling_inputs(k: int) -> list[TensorSpec]:
    """Each row's sampling settings and one uniform number per draft: what a graph that draws k drafts takes."""
    return [TensorSpec("temperature", "float32", ("batch",)), TensorSpec("top_k", "int64", ("batch",)),
            TensorSpec("top_p", "float32", ("batch",)), TensorSpec("uniforms", "float32", ("batch", k))]


def draft_outputs(cfg: V4Config, k: int) -> list[TensorSpec]:
    """The k drafts of each row and the distribution each was drawn from."""
    return [TensorSpec("drafts", "int64", ("batch", k)),
            TensorSpec("draft_probs", "float32", ("batch", k, cfg.vocab_size))]


class DSparkSpec(DraftSpec):
    """The DSpark drafter of the current V4 releases (`mtp.0..2`, builder/model/dspark.py) as one call per cycle.

    It reads the target's `captured` rows (the mean of the hc streams after each of dspark_target_layer_ids) of
    the newly committed positions and keeps, per stage, a ring of the context keys of the last W positions. In:
    those rows, their positions, each row's valid `lengths`, the `anchor` (the token after them, whose position
    starts the block), its sampling settings and one uniform number per draft. Out: the `drafts`, the
    distributions they were drawn from, each draft's `confidence` logit, and the new rows of every stage's ring."""

    method = "dspark"

    def layout(self, cfg: V4Config, value_bytes: int = 4) -> CacheLayout:
        stages = cfg.dspark.stages if cfg.dspark is not None else 0
        return CacheLayout(cfg, [(cfg.num_hidden_layers + s, DSPARK_KIND) for s in range(stages)], value_bytes)

    def default_tokens(self, cfg: V4Config) -> int:
        return cfg.dspark.block_size if cfg.dspark is not None else 1

    def captured_width(self, cfg: V4Config) -> int:
        return len(cfg.dspark.target_layer_ids) * cfg.hidden_size if cfg.dspark is not None else 0

    def graph_specs(self, cfg: V4Config, dtype: str, k: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
        if k < 1:
            raise ValueError(f"the draft graph drafts k >= 1 tokens (got {k})")
        layout = self.layout(cfg)
        inputs = [TensorSpec(CAPTURED, dtype, ("batch", "seq", self.captured_width(cfg))),
                  TensorSpec("positions", "int64", ("batch", "seq")), TensorSpec("lengths", "int64", ("batch",)),
                  TensorSpec("anchor", "int64", ("batch",))] + sampling_inputs(k)
        outputs = draft_outputs(cfg, k) + [TensorSpec("confidence", "float32", ("batch", k))]
        return inputs + layout.inputs(dtype), outputs + layout.outputs(dtype)

    def captured_layers(self, cfg: V4Config) -> tuple[int, ...]:
        return cfg.dspark.target_layer_ids if cfg.dspark is not None else ()

    def stage_io(self, cfg: V4Config, dtype: str, stage: Stage) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """A stage after a captured layer takes the rows captured so far (`captured_in`); a stage at or after one
        returns them with its own layers' appended (`captured`): the last stage returns them all. The layer ids
        are ascending (V4Config checks), so the rows come out in dspark_target_layer_ids order."""
        ids = self.captured_layers(cfg)
        before = sum(1 for i in ids if i < stage.layers.start)
        upto = sum(1 for i in ids if i < stage.layers.stop)
        width = cfg.hidden_size
        inputs = [TensorSpec(CAPTURED_IN, dtype, ("batch", "seq", before * width))] if before else []
        outputs = [TensorSpec(CAPTURED, dtype, ("batch", "seq", upto * width))] if upto else []
        return inputs, outputs


MTP = MtpSpec()
DSPARK = DSparkSpec()
DRAFT_SPECS: dict[str, DraftSpec] = {spec.method: spec for spec in (MTP, DSPARK)}

__all__ = ["DRAFT_GRAPH", "DRAFT_SPECS", "DSPARK", "DSparkSpec", "DraftSpec", "MTP", "MtpSpec", "draft_outputs",
           "sampling_inputs"]
