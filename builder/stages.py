"""`v4build --pipeline-stages N`: where the target's layers are cut so that every stage holds about as many resident
bytes (contract/stages.py says what a stage is).

The cut must be known before the stage graphs are exported, so each weight's resident bytes are computed here from
the checkpoint's headers and the model's parameters, by the same rules attach_weights follows when it gives the
graphs their weights (builder/weights.py: `tensor_treatment`, `expert_form`, `resident_form`); engine.json then
records each stage's bytes as attach_weights counted them, and the tests hold the two equal. Then the layers are
split into N consecutive, non-empty runs minimizing the largest stage, the first stage paying for the embedding and
the last for the final norm and head and for the draft graph (the MTP layer, with the embedding and head again).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from v4engine.contract.backends import Backend
from v4engine.contract.config import V4Config
from v4engine.contract.errors import V4EngineError
from v4engine.contract.stages import Stage, stages_of

from .checkpoint import Checkpoint
from .export import DRAFT_FORWARDS, rope_table
from .model import Transformer
from .weights import (GATHERED_TABLES, ONNX_OF_TORCH, expert_form, expert_treatment, group_bytes, resident_form,
                      stacked_expert_names, tensor_treatment)


class StageError(V4EngineError):
    """The pipeline stages asked for cannot be made from this model."""


@dataclass
class ModelBytes:
    """Resident bytes of the weights, by where they run: each target layer, the embedding, the final hc_head and
    norm, the LM head, and the draft module's own weights (under `mtp.*`)."""

    layers: list[int]
    embedding: int = 0
    final: int = 0
    head: int = 0
    draft: int = 0

    def stage(self, stage: Stage, draft: bool) -> int:
        """Bytes a stage's device holds: its layers, the embedding if first, the final hc_head, norm and LM head if
        last, and beside the last the draft graph (the MTP layer, reading the embedding and the LM head again)
        when the engine drafts."""
        extra = (self.embedding if stage.first else 0) + (self.final + self.head if stage.last else 0)
        if stage.last and draft:
            extra += self.draft + self.embedding + self.head
        return sum(self.layers[i] for i in stage.layers) + extra


def model_bytes(cfg: V4Config, ckpt: Checkpoint, backend: Backend, dtype: torch.dtype, draft: bool) -> ModelBytes:
    """Every weight's resident bytes for `backend` with activations in `dtype` (what attach_weights will count),
    summed by where it runs."""
    method = ckpt.draft_module if draft else None
    with torch.device("meta"):
        model = Transformer(cfg, mtp=method == "mtp").stack_experts().to_dtype(dtype)
        drafter = DRAFT_FORWARDS[method].model(cfg).stack_experts().to_dtype(dtype) if method == "dspark" else None
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if drafter is not None:                      # its own weights (its embedding and head are the target's)
        tensors += [(n, v) for n, v in [*drafter.named_parameters(), *drafter.named_buffers()] if n.startswith("mtp.")]
    out = ModelBytes([0] * cfg.num_hidden_layers)
    for name, value in tensors:
        if rope_table(cfg, name) is not None:             # computed tables, inline and tiny
            continue
        resident = _resident_bytes(name, value, cfg, ckpt, backend)
        part = name.split(".")[0]
        if part == "layers":
            out.layers[int(name.split(".")[1])] += resident
        else:
            owner = {"mtp": "draft", "embed": "embedding", "head": "head"}.get(part, "final")
            setattr(out, owner, getattr(out, owner) + resident)
    return out


def _resident_bytes(name: str, value: torch.Tensor, cfg: V4Config, ckpt: Checkpoint, backend: Backend) -> int:
    data_type = ONNX_OF_TORCH[value.dtype]
    experts = stacked_expert_names(name, cfg.n_routed_experts)
    if experts is None:
        info = ckpt.info(name)
        treatment = tensor_treatment(info, backend, data_type, gathered=bool(GATHERED_TABLES.search(name)))
        return resident_form(treatment, backend, group_bytes(info), value.numel(), data_type)[1]
    infos = [ckpt.info(e) for e in experts]
    form = expert_form(backend, infos[0].format)
    if form is None:           # stacked: each expert as any tensor
        return sum(resident_form(tensor_treatment(i, backend, data_type, False), backend, group_bytes(i),
                                 value.numel() // len(infos), data_type)[1] for i in infos)
    return resident_form(expert_treatment(form, infos[0].format), backend, sum(map(group_bytes, infos)),
                         value.numel(), data_type)[1]


def plan_stages(sizes: ModelBytes, count: int, draft: bool) -> list[Stage]:
    """`count` stages of consecutive layers whose largest resident bytes (ModelBytes.stage) is the least possible.
    StageError when there are more stages than layers."""
    layers = len(sizes.layers)
    if not 1 <= count <= layers:
        raise StageError(f"--pipeline-stages {count}: the model has {layers} layers, so from 1 to {layers} stages")
    # best[n][j]: the least largest stage over the first j layers cut into n stages; cut[n][j]: where the last starts
    best = [[math.inf] * (layers + 1) for _ in range(count + 1)]
    cut = [[0] * (layers + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for n in range(1, count + 1):
        for j in range(n, layers + 1):
            for i in range(n - 1, j):
                stage = Stage(n - 1, count, range(i, j))
                if stage.last != (j == layers):     # only the stage that ends the model is last
                    continue
                worst = max(best[n - 1][i], sizes.stage(stage, draft))
                if worst < best[n][j]:
                    best[n][j], cut[n][j] = worst, i
    bounds = [layers]
    for n in range(count, 0, -1):
        bounds.append(cut[n][bounds[-1]])
    return stages_of(bounds[::-1])


__all__ = ["ModelBytes", "StageError", "model_bytes", "plan_stages"]
