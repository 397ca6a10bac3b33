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
from .layout import MTP_KIND, STREAMS, CacheLayout, TensorSpec

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

    def target_outputs(self, cfg: V4Config, dtype: str) -> list[TensorSpec]:
        """What it reads of the target's last stage beside `hidden` (those outputs exist only for it)."""
        return []

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
                  TensorSpec("lengths", "int64", ("batch",)), TensorSpec("temperature", "float32", ("batch",)),
                  TensorSpec("top_k", "int64", ("batch",)), TensorSpec("top_p", "float32", ("batch",)),
                  TensorSpec("uniforms", "float32", ("batch", k))]
        outputs = [TensorSpec("drafts", "int64", ("batch", k)),
                   TensorSpec("draft_probs", "float32", ("batch", k, cfg.vocab_size))]
        return inputs + layout.inputs(dtype), outputs + layout.outputs(dtype)


MTP = MtpSpec()
DRAFT_SPECS: dict[str, DraftSpec] = {spec.method: spec for spec in (MTP,)}

__all__ = ["DRAFT_GRAPH", "DRAFT_SPECS", "DraftSpec", "MTP", "MtpSpec"]
