"""The draft graph draws its drafts in the graph (builder/model/drafting.py); the runtime's acceptance uses
runtime/sampling.py. Lossless sampling needs only that each draft was drawn from the distribution returned with it,
but acceptance rates are the runtime's own only if the two define the same distribution. Held equal here on the
exported graph run by ONNX Runtime (what an engine runs), on the same logits and settings: temperature, top-k, top-p,
ties and the overflow limit included."""
from __future__ import annotations

import functools
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.export import Dim

from v4engine.builder.model.drafting import DRAFT_CANDIDATES, draft_token
from v4engine.plugins import OPSET
from v4engine.runtime import sampling
from v4engine.runtime.sampling import SamplingParams

SETTINGS = [  # temperature, top_k, top_p
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (1.0, 5, 0.3), (0.5, 0, 0.9), (1.0, 0, 1e-6), (2.0, 50, 0.95),
    (1e-30, 0, 1.0), (1e-40, 3, 0.5), (1.0, 1, 1.0), (0.0, 0, 1.0), (0.0, 7, 0.2)]


class DraftToken(torch.nn.Module):
    """One draft position of every row, as the draft graph draws it (greedy rows: temperature 0)."""

    def __init__(self, conditional: bool):
        super().__init__()
        self.conditional = conditional

    def forward(self, logits, temperature, top_k, top_p, uniform):
        return draft_token(logits, temperature, top_k, top_p, uniform, self.conditional)


@functools.cache
def exported(conditional: bool) -> ort.InferenceSession:
    """The exported draw, any batch and vocabulary (examples of neither 0 nor 1, which export would fix)."""
    batch, vocab = Dim("batch", min=1), Dim("vocab", min=2)
    examples = (torch.zeros(3, 4000), torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.zeros(3))
    dynamic = ({0: batch, 1: vocab}, {0: batch}, {0: batch}, {0: batch}, {0: batch})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(DraftToken(conditional), examples, dynamo=True, opset_version=OPSET,
                                    input_names=["logits", "temperature", "top_k", "top_p", "uniform"],
                                    output_names=["token", "probs"], dynamic_shapes=dynamic, verbose=False)
    return ort.InferenceSession(program.model_proto.SerializeToString())


def in_graph(session: ort.InferenceSession, logits: np.ndarray, settings: list, uniform: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, the distributions they were drawn from), fed as the scheduler feeds the draft graph."""
    temperature, top_k, top_p = (np.array(v) for v in zip(*settings))
    uniform = np.zeros(len(settings), np.float32) if uniform is None else uniform
    return session.run(None, {"logits": logits, "temperature": temperature.astype(np.float32),
                              "top_k": top_k.astype(np.int64), "top_p": top_p.astype(np.float32),
                              "uniform": uniform})


def runtime(logits: np.ndarray, settings: list) -> np.ndarray:
    """The runtime's distribution of each row (a greedy row: one-hot at the argmax, first on ties)."""
    def one(row, t, k, p):
        if t == 0:
            return np.eye(len(row))[int(row.argmax())]
        return sampling.distribution(row, SamplingParams(temperature=t, top_k=k, top_p=p))
    return np.stack([one(row, *s) for row, s in zip(logits, settings)])


@pytest.mark.parametrize("conditional", [True, False])
def test_the_graphs_distribution_is_the_runtimes_on_a_mixed_batch(conditional):
    logits = np.random.default_rng(0).normal(0, 3, size=(len(SETTINGS), 512)).astype(np.float32)
    _, got = in_graph(exported(conditional), logits, SETTINGS)
    want = runtime(logits, SETTINGS)
    assert np.array_equal(got > 0, want > 0), "the same tokens are kept"
    assert np.abs(got - want).max() < 1e-6


def test_ties_are_kept_or_dropped_together():
    """Top-k keeps every token tied with the k-th; top-p takes tied tokens in index order (ONNX TopK's rule, the
    runtime's stable sort); the overflow limit (T -> 0) spreads over exact ties."""
    logits = np.array([[2.0, 5.0, 5.0, 1.0, 5.0, 0.0, 3.0, 3.0]] * 5, np.float32)
    settings = [(1.0, 2, 1.0), (1.0, 4, 1.0), (1e-40, 0, 1.0), (1.0, 0, 0.5), (1.0, 5, 0.7)]
    _, got = in_graph(exported(True), logits, settings)
    want = runtime(logits, settings)
    assert np.array_equal(got > 0, want > 0) and np.abs(got - want).max() < 1e-6
    assert np.allclose(got[2], [0, 1 / 3, 1 / 3, 0, 1 / 3, 0, 0, 0], atol=1e-7)


def test_a_filtering_row_ranks_only_the_candidates_the_graph_can_sort():
    """Beyond DRAFT_CANDIDATES tokens the graph drafts from the most likely ones (documented: only acceptance can
    drop); a filter keeping fewer than that is exactly the runtime's."""
    vocab = DRAFT_CANDIDATES + 500
    logits = np.random.default_rng(1).normal(0, 1, size=(2, vocab)).astype(np.float32)
    settings = [(1.0, 100, 1.0), (1.0, 0, 0.999999)]
    _, got = in_graph(exported(True), logits, settings)
    want = runtime(logits, settings)
    assert np.abs(got[0] - want[0]).max() < 1e-6
    assert (got[1] > 0).sum() == DRAFT_CANDIDATES < (want[1] > 0).sum()


def test_a_temperature_below_float32s_range_drafts_the_argmax():
    """The scheduler feeds temperatures as float32: one that rounds to 0 drafts greedily (its one-hot q is what the
    acceptance test is given, so sampling stays lossless)."""
    logits = np.random.default_rng(3).normal(0, 1, size=(1, 64)).astype(np.float32)
    token, probs = in_graph(exported(True), logits, [(1e-300, 0, 1.0)], np.array([0.9], np.float32))
    assert token[0] == logits[0].argmax() and probs[0, token[0]] == 1


def test_a_draft_is_the_runtimes_draw_from_that_distribution():
    """Same distribution, same uniform number: the same token (greedy rows: the argmax, first on ties)."""
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, size=(len(SETTINGS), 300)).astype(np.float32)
    logits[:, 7] = logits[:, 9] = logits.max(axis=1) + 1             # a tie for the argmax
    session = exported(True)
    for _ in range(20):
        uniform = rng.random(len(SETTINGS)).astype(np.float32)
        tokens, probs = in_graph(session, logits, SETTINGS, uniform)
        for b, (row, t) in enumerate(zip(probs.astype(np.float64), tokens.tolist())):
            if SETTINGS[b][0] == 0:
                assert t == 7 and row[7] == 1
                continue
            cdf = np.cumsum(row) / row.sum()
            if np.min(np.abs(cdf - uniform[b])) > 1e-5:              # not on a float32 rounding boundary
                assert t == sampling.draw(row, _Fixed(uniform[b]))


class _Fixed:
    """A generator whose next random number is given."""

    def __init__(self, u: float):
        self.u = float(u)

    def random(self) -> float:
        return self.u
