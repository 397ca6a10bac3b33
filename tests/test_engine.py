"""The ONNX Runtime engine equals our PyTorch model within 1e-4 (fp32): every output (logits, hidden streams,
state deltas) for prefill, verify (q = k+1) and whole draft cycles (drafts, their distributions, the extend's
rows), batches of 1 and 3 rows of different lengths."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch

from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.builder.model.drafting import draft_cycle
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.contract.engine import EngineManifest
from v4engine.runtime.sessions import open_session

TOL = 1e-4
MTP = 3


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def engine(request, tiny_engine):
    checkpoint, out = tiny_engine(request.param, mtp=MTP)
    manifest = EngineManifest.read(out)
    model = load_model(checkpoint, mtp=True)
    sessions = {g: open_session(out, manifest, g) for g in manifest.graphs}
    return model, manifest, sessions


def feeds(state: ModelState, **tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """An engine call's inputs: the tokens, and the state's caches as the runtime's pools."""
    return {k: v.numpy() for k, v in tokens.items()} | state.pool_feeds()


def expected(manifest: EngineManifest, part: str, result) -> dict[str, np.ndarray]:
    layers = sorted({g.layer for g in manifest.cache_groups(part)})
    deltas = dict(zip(layers, result.deltas))
    out = {"logits": result.logits, "hidden": result.hidden}
    for g in manifest.cache_groups(part):
        out[f"new.{g.layer}.{g.name}"] = getattr(deltas[g.layer], g.name)
    return {k: v.detach().numpy() for k, v in out.items()}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, f"{what}: {name} shape"
        diff = np.abs(got[name] - want[name]).max(initial=0)
        assert diff <= TOL, f"{what}: {name} differs by {diff:.2e}"


def test_manifest_describes_the_graphs(engine):
    _, manifest, sessions = engine
    assert manifest.mtp == MTP and set(manifest.graphs) == {"target", "draft"}
    assert [s.name for s in manifest.graphs["target"].inputs][:2] == ["input_ids", "positions"]
    assert manifest.caches["draft"].groups[0].rows_fixed == manifest.model.sliding_window - 1


def test_prefill_then_verify_steps_in_batches_of_one_and_three(engine):
    model, manifest, sessions = engine
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    for lengths in ([29], [5, 33, 17]):
        B = len(lengths)
        state = ModelState(cfg, B)
        S = max(lengths)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        plan = [lengths] + [[MTP + 1] * B] * 6 + [[1, 3, MTP + 1][:B]] * 2
        for step, sizes in enumerate(plan):
            S = max(sizes)
            if step:
                ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
            positions = state.positions(S)
            with torch.no_grad():
                result = model(ids, positions, state.views())
            got = sessions["target"].run(feeds(state, input_ids=ids, positions=positions))
            assert_same(got, expected(manifest, "target", result), f"target step {step} lengths {sizes}")
            state.commit(result.deltas, [max(1, s - step % 3) for s in sizes])   # some tails rejected


def test_draft_cycles(engine):
    """Extends of different lengths per row (padding after the shorter ones), greedy and sampling rows side by
    side, each with its own top-k and top-p: the same drafts, distributions and extend rows as draft_cycle."""
    model, manifest, sessions = engine
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    B = 3
    draft = ModelState(cfg, B, draft=True)
    settings = {"temperature": torch.tensor([0.0, 1.0, 0.6]), "top_k": torch.tensor([0, 0, 40]),
                "top_p": torch.tensor([1.0, 0.9, 1.0])}
    for sizes in ([7, 2, 12], [1, 1, 1], [4, 1, 2], [MTP + 1] * 3, [80, 1, 3]):
        S = max(sizes)
        hidden = torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=gen)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        positions, lengths = draft.positions(S), torch.tensor(sizes)
        uniforms = torch.rand(B, MTP, generator=gen)
        with torch.no_grad():
            cycle = draft_cycle(model, hidden, ids, positions, lengths, draft.views()[0], **settings,
                                uniforms=uniforms)
        inputs = dict(hidden=hidden, input_ids=ids, positions=positions, lengths=lengths, uniforms=uniforms,
                      **settings)
        got = sessions["draft"].run(feeds(draft, **inputs))
        want = {"drafts": cycle.drafts.numpy(), "draft_probs": cycle.probs.numpy(),
                **{g.new: getattr(cycle.delta, g.name).numpy() for g in manifest.cache_groups("draft")}}
        assert (got["drafts"] == want["drafts"]).all(), f"draft cycle {sizes}: drafts differ"
        assert_same(got, want, f"draft cycle {sizes}")
        draft.commit([cycle.delta], sizes)


def test_the_graphs_read_the_pools_only_through_gathers_of_the_rows_they_need(tiny_engine):
    """A pool is the whole budget's memory: an op over a whole pool (a copy, a transpose) would make every call
    cost as much as the budget. As exported, a ring pool is only reshaped (free) and gathered from, and a block
    pool only handed to a paged op (whose TensorRT plugin reads it through the block table); with the ops' ONNX
    functions inlined (what ONNX Runtime runs), every pool is only measured, reshaped and gathered from."""
    _, out = tiny_engine("mixed", mtp=MTP)
    paged = {"HcaAttentionPaged", "CsaAttentionPaged", "IndexerTopKPaged"}

    def readers_of(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in graph.node:
            for i, name in enumerate(node.input):
                readers.setdefault(name, []).append((node, i))
        return readers

    for graph in ("target", "draft"):
        model = onnx.load(out / f"{graph}.onnx", load_external_data=False)
        pools = [i.name for i in model.graph.input if i.name.startswith("pool.")]
        readers = readers_of(model.graph)
        for pool in pools:
            kinds = {node.op_type for node, _ in readers[pool]}
            assert kinds == {"Reshape"} or kinds <= paged, f"{graph}: {pool} read by {kinds}"
        inlined = readers_of(onnx.inliner.inline_local_functions(model).graph)
        for pool in pools:
            for node, _ in inlined[pool]:
                if node.op_type == "Shape":
                    continue
                assert node.op_type == "Reshape", f"{graph}: {pool} read by {node.op_type}"
                for user, position in inlined[node.output[0]]:
                    assert (user.op_type, position) == ("Gather", 0), f"{graph}: {pool} read by {user.op_type}"
    assert any(node.op_type in paged for node in onnx.load(out / "target.onnx", load_external_data=False).graph.node)