"""DSpark on a GPU (part of scripts/gpu_check.sh): our PyTorch DSpark cycle at V4-Flash-0731's widths (hidden 4096,
64 heads of 512, vocabulary 129,280, Markov rank 256, window 128, N = 5; 8 routed experts per stage instead of 256,
which changes no width) in bf16 against the same cycle in fp32, and the whole cycle (context keys, block, head,
Markov loop) recorded as one CUDA graph and replayed bit for bit on fresh inputs: what vLLM's one-graph DSpark
drafter does, and what an engine's draft call replays under --cuda-graphs. Skipped without a CUDA GPU."""
from __future__ import annotations

import pytest
import torch

from v4engine.builder.model.dspark import BlockContext, DSpark, greedy_sampler
from v4engine.builder.model.v4 import StackedExperts
from v4engine.builder.release import RELEASES
from v4engine.builder.tiny import randomize
from v4engine.contract.config import V4Config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]
N, ROWS = 5, 4


@pytest.fixture(scope="module")
def drafter() -> DSpark:
    raw = {**RELEASES["v4-flash-0731"][0], "n_routed_experts": 8, "num_experts_per_tok": 6}
    with torch.device("cuda"):
        model = DSpark(V4Config.from_dict(raw))
        randomize(model, torch.Generator(device="cuda").manual_seed(0))
    return model.stack_experts().eval()


def cycle(model: DSpark, captured: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Context keys of every position of `captured` [B, W, 3D], the block after them, the greedy Markov loop."""
    B, W = captured.shape[:2]
    positions = torch.arange(W, device=captured.device).expand(B, W)
    keys = model.context_keys(captured, positions)
    visible = torch.ones(B, W, dtype=torch.bool, device=captured.device)
    y, logits = model.block(anchor, torch.full_like(anchor, W), [BlockContext(k, visible) for k in keys], N)
    out = model.markov_drafts(y, logits, anchor, greedy_sampler)
    return out.logits, out.confidence


@torch.no_grad()
def test_the_bf16_cycle_follows_the_fp32_cycle(drafter):
    gen = torch.Generator(device="cuda").manual_seed(1)
    captured = torch.randn(ROWS, 128, 3 * 4096, device="cuda", generator=gen)
    anchor = torch.randint(0, 129280, (ROWS,), device="cuda", generator=gen)
    exact, _ = cycle(drafter.float(), captured, anchor)
    low, _ = cycle(drafter.to_dtype(torch.bfloat16), captured.bfloat16(), anchor)
    drafter.float()
    error = (low - exact).abs().max().item()
    assert error <= 0.05 * exact.abs().max().item(), f"bf16 logits off by {error}"


@torch.no_grad()
def test_the_whole_cycle_replays_as_one_cuda_graph(drafter, monkeypatch):
    """The routed experts run as an engine runs them under a CUDA graph: the plugin's Triton launcher (the eager
    reference asks the host which experts were picked, which no graph can hold)."""
    from v4engine.plugins.kernels import moe as moe_kernels

    monkeypatch.setattr(StackedExperts, "forward", lambda self, x, indices, weights: moe_kernels.routed_experts(
        x, indices, weights, self.w1, self.w2, self.w3, limit=self.limit))
    model = drafter.to_dtype(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    captured = torch.randn(ROWS, 128, 3 * 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    anchor = torch.randint(0, 129280, (ROWS,), device="cuda", generator=gen)
    cycle(model, captured, anchor)                                      # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = cycle(model, captured, anchor)
    fresh_captured = torch.randn(captured.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    fresh_anchor = torch.randint(0, 129280, (ROWS,), device="cuda", generator=gen)
    captured.copy_(fresh_captured)
    anchor.copy_(fresh_anchor)
    graph.replay()
    direct = cycle(model, fresh_captured, fresh_anchor)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(recorded, direct)), "the replay differs from the direct run"
    drafter.float()
