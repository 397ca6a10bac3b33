"""Where v4engine and transformers disagree most, was it a near tie in one of the model's top-k choices?

V4 makes discrete choices inside every forward: the lightning indexer keeps the top `index_topk` compressed
entries per query (CSA layers), score routing keeps the top experts per token. Two exact implementations that sum
in different orders can break a near tie differently, and then their logits differ by far more than rounding.
This script takes a run saved by `bench_llamacpp --save`, finds the position whose log-probability differs most
from transformers', records every top-k site's scores in transformers' forward over that prompt (forward hooks),
prints the relative margin between the k-th and (k+1)-th score at that row against the other decode rows, then
flips the nearest tie at that row (the (k+1)-th candidate for the k-th) and measures the agreement again: if the
gap closes to rounding, the disagreement was that one choice, each side exact to its own.

    .venv/bin/python -m benchmarks.bench_llamacpp --work /work/scratch/llama --prompt-tokens 4000 --prompts 2 \
        --rounds 1 --without-llama --save /work/scratch/llama/4k.json
    .venv/bin/python -m benchmarks.topk_ties /work/scratch/llama/4k.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from v4engine.testkit import oracle


def top_k_sites(model) -> list[tuple[str, torch.nn.Module, int, int]]:
    """(name, module, k, compress rate or 0) of every top-k choice of transformers' DeepSeek-V4: each indexer's
    scorer (scores [B, S, T], entries past a query's closed windows excluded) and each score router."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    sites = []
    for name, module in model.named_modules():
        if isinstance(module, v4.DeepseekV4Indexer):
            sites.append((f"{name}.scorer", module.scorer, module.index_topk, module.compress_rate))
        elif isinstance(module, v4.DeepseekV4TopKRouter):
            sites.append((name, module, module.top_k, 0))
    return sites


def candidate_scores(module: torch.nn.Module, output, rate: int) -> torch.Tensor:
    """[S, C] the scores the site ranks, per row (batch of one): an indexer's with the entries a query may not read
    at -inf, a router's sqrt-softplus scores plus its correction bias."""
    if rate:
        scores = output[0]
        S, T = scores.shape
        closed = (torch.arange(S) + 1) // rate                                  # windows closed at each row
        return scores.masked_fill(torch.arange(T)[None] >= closed[:, None], float("-inf"))
    return module.score_fn(output[0]) + module.e_score_correction_bias


def relative_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[S] (k-th - (k+1)-th) / |k-th| per row; inf where a row has no (k+1)-th candidate."""
    if scores.shape[-1] <= k:
        return torch.full(scores.shape[:1], float("inf"))
    top = scores.topk(k + 1, dim=-1).values
    margin = (top[:, k - 1] - top[:, k]) / top[:, k - 1].abs().clamp(min=1e-30)
    return torch.where(torch.isfinite(top[:, k]), margin, torch.full_like(margin, float("inf")))


def flipped(module: torch.nn.Module, output, rate: int, k: int, row: int):
    """The site's output with the (k+1)-th candidate of `row` chosen instead of its k-th."""
    scores = candidate_scores(module, output, rate)[row]
    order = scores.argsort(descending=True)
    kth, next_one = order[k - 1], order[k]
    if rate:                                                                     # scores: lift the (k+1)-th above
        out = output.clone()
        out[0, row, next_one] = scores[kth] + 1e-3 * scores[kth].abs()
        out[0, row, kth] = scores[next_one]
        return out
    logits, weights, indices = output                                            # a router: swap the expert
    indices, weights = indices.clone(), weights.clone()
    chosen = indices[row].clone()
    chosen[chosen == kth] = next_one
    raw = module.score_fn(logits[row]).gather(0, chosen)
    indices[row], weights[row] = chosen, raw / (raw.sum() + 1e-20) * module.routed_scaling_factor
    return logits, weights, indices


def log_probs(model, ids: list[int], sites, hook) -> torch.Tensor:
    """[S, V] transformers' log-probabilities over `ids`, with `hook(site index, module, output)` on every site."""
    handles = [module.register_forward_hook(lambda m, _, out, i=i: hook(i, m, out))
               for i, (_, module, _, _) in enumerate(sites)]
    try:
        with torch.no_grad():
            return torch.log_softmax(oracle.transformers_logits(model, torch.tensor([ids]))[0].double(), -1)
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="JSON written by bench_llamacpp --save")
    p.add_argument("--threads", type=int, default=2, help="torch threads of transformers' forward (default 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    saved = json.loads(args.run.read_text())
    ours = saved["results"]["v4engine"][0]["runs"]
    theirs = saved["results"]["transformers"][0]["runs"]
    gap, prompt_index, step = max((abs(a - b), i, j) for i, (o, t) in enumerate(zip(ours, theirs))
                                  for j, (a, b) in enumerate(zip(o["logprobs"], t["logprobs"])))
    prompt, tokens = saved["prompts"][prompt_index], ours[prompt_index]["tokens"]
    first, row = len(prompt) - 1, len(prompt) - 1 + step                         # forward rows of steps 0 and `step`
    ours_logp = torch.tensor(ours[prompt_index]["logprobs"], dtype=torch.float64)
    print(f"largest gap {gap:.3g} nats: prompt {prompt_index}, decode step {step} (forward row {row})")

    model = oracle.load_transformers(saved["transformers_checkpoint"])
    sites = top_k_sites(model)
    margins: dict[int, torch.Tensor] = {}

    def record(i, module, output):
        _, _, k, rate = sites[i]
        margins[i] = relative_margin(candidate_scores(module, output, rate).detach(), k)

    def agreement(rows: torch.Tensor) -> str:
        gaps = (rows[first + torch.arange(len(tokens)), torch.tensor(tokens)] - ours_logp).abs()
        return (f"max {gaps.max().item():.2g} (step {int(gaps.argmax())}), median {gaps.median().item():.2g}, "
                f"before step {step} {gaps[:step].max().item() if step else 0:.2g}, "
                f"after it {gaps[step + 1:].max().item() if step + 1 < len(gaps) else 0:.2g}")

    print(f"transformers as it is: {agreement(log_probs(model, prompt + tokens[:-1], sites, record))}")
    print("relative margin between the k-th and (k+1)-th score: at that row | median / min over the decode rows")
    decode = slice(first, first + len(tokens))
    for i, (name, _, k, _) in enumerate(sites):
        m = margins[i]
        print(f"  {name} (top {k}): {m[row].item():.2g} | {m[decode].median().item():.2g} / "
              f"{m[decode].min().item():.2g}")
    nearest = min(range(len(sites)), key=lambda i: margins[i][row].item())
    name, _, k, rate = sites[nearest]

    def flip(i, module, output):
        return flipped(module, output, rate, k, row) if i == nearest else None

    print(f"with {name}'s choice at that row flipped: {agreement(log_probs(model, prompt + tokens[:-1], sites, flip))}")


if __name__ == "__main__":
    main()
