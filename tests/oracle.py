"""The transformers oracle, with the indexer tie rule of DESIGN.md: top-k ties go to the lowest index.

transformers 5.23 picks indexer rows with `Tensor.topk`, which breaks exact ties (ReLU makes many scores 0)
differently for rows of different lengths. Every realisation of ours breaks them by lowest index, so the
oracle is patched to the same rule before it is compared with anything. This module is the one place
that knows how.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


def stable_topk(values: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """topk whose equal values keep index order (lowest index first), like ONNX TopK."""
    ordered, order = torch.sort(values, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((ordered.narrow(dim, 0, k), order.narrow(dim, 0, k)))


@contextlib.contextmanager
def lowest_index_ties() -> Iterator[None]:
    """Within the block, every Tensor.topk (so transformers' indexer) breaks ties by lowest index."""
    original = torch.Tensor.topk
    torch.Tensor.topk = stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def load_transformers(checkpoint: str | Path):
    """DeepseekV4ForCausalLM (5.23) from a checkpoint folder, fp32, eval."""
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@torch.no_grad()
def transformers_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits of the oracle, ties broken by lowest index."""
    with lowest_index_ties():
        return model(input_ids, use_cache=False).logits.float()
