"""The transformers oracle, with the indexer tie rule (docs/model.md §7): top-k ties go to the lowest index.

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

from v4engine.builder.model import ModelState
from v4engine.builder.model.v4 import hyper_head


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


def transformers_copy(checkpoint: str | Path, out: str | Path, names: str = "hf") -> Path:
    """An fp32 copy of a checkpoint's target in transformers' names, weights dequantized exactly as the engine
    dequantizes them: the oracle for checkpoints transformers cannot load on the CPU (FP8, official names).
    names="official": the same in the release's names, with its tokenizer (what llama.cpp's converter reads)."""
    import json

    from v4engine.builder.load import load_model
    from v4engine.builder.tiny import save_checkpoint

    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("quantization_config", "expert_dtype")}
    tokenizer = {"tokenizer.json": Path(checkpoint) / "tokenizer.json"} if names == "official" else None
    return save_checkpoint(load_model(checkpoint, mtp=False), raw, out, names=names, dtype="float32", mtp=False,
                           extra_files=tokenizer)


@torch.no_grad()
def transformers_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits of the oracle, ties broken by lowest index."""
    with lowest_index_ties():
        return model(input_ids, use_cache=False).logits.float()


def oracle_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers, full recompute each step, indexer ties by lowest index."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(transformers_logits(hf, torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


@torch.no_grad()
def oracle_accepted_counts(model, ids: list[int], k: int, new_tokens: int) -> list[int]:
    """The speculative loop by full recompute (no caches): per verify step, how many drafts greedy accepts."""
    cfg = model.cfg

    def target(seq):
        state = ModelState(cfg, 1)
        return model(torch.tensor([seq]), state.positions(len(seq)), state.views())

    def mtp_rows(hidden, next_ids):
        mtp = model.mtp[0]
        x = mtp.h_proj(mtp.hnorm(hidden)) + mtp.e_proj(mtp.enorm(model.embed(next_ids))).unsqueeze(2)
        empty = ModelState(cfg, 1, draft=True)
        x, _ = mtp(x, next_ids, torch.arange(hidden.shape[1]).unsqueeze(0), empty.views()[0])
        y = mtp.norm(hyper_head(x, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, cfg))
        return model.head(y).float(), x

    seq = list(ids) + [int(target(ids).logits[0, -1].argmax())]
    counts = []
    while len(seq) - len(ids) < new_tokens:
        hidden = target(seq[:-1]).hidden                                # H_0 .. H_{n-1}
        rows_h, rows_t, drafts = hidden, torch.tensor([seq[1:]]), []
        for _ in range(k):
            logits, streams = mtp_rows(rows_h, rows_t)
            drafts.append(int(logits[0, -1].argmax()))
            rows_h = torch.cat([rows_h, streams[:, -1:]], 1)
            rows_t = torch.cat([rows_t, torch.tensor([[drafts[-1]]])], 1)
        verify = target(seq + drafts).logits[0, len(seq) - 1:].argmax(-1).tolist()
        n = 0
        while n < k and verify[n] == drafts[n]:
            n += 1
        counts.append(n)
        seq += drafts[:n] + [verify[n]]
    return counts
