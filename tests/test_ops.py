"""Each V4 custom op: its ONNX function (standard ops) on ONNX Runtime equals its PyTorch reference."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from v4engine.plugins import DOMAIN, OPSET, PLUGIN_OPS, onnx_functions
from v4engine.plugins.attention import csa_attention, hca_attention, sliding_attention
from v4engine.plugins.compressor import csa_compress, hca_compress
from v4engine.plugins.indexer import indexer_topk
from v4engine.plugins.sinkhorn import hc_sinkhorn

TOL = 1e-5
_DTYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.int64: onnx.TensorProto.INT64, torch.int8: onnx.TensorProto.INT8}


def run_onnx(op: str, inputs: list[torch.Tensor], attrs: dict, out_specs: list[tuple[torch.dtype, int]],
             plugin: bool = True, sinkhorn_rounds: int | None = None) -> list[np.ndarray]:
    """One call node of `v4::op` (with the plugin attributes unless plugin=False) in a model that carries every
    function (Sinkhorn's as a Loop, or `sinkhorn_rounds` rounds written out).

    out_specs: (dtype, rank) of each output. The model passes onnx.checker's full check."""
    names = [f"in{i}" for i in range(len(inputs))]
    outs = [f"out{i}" for i in range(len(out_specs))]
    plugin_attrs = {"plugin_namespace": "v4", "plugin_version": "1"} if plugin else {}
    node = helper.make_node(op, names, outs, domain=DOMAIN, **plugin_attrs, **attrs)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(n, _DTYPES[t.dtype], [f"{n}_{i}" for i in range(t.dim())])
         for n, t in zip(names, inputs)],
        [helper.make_tensor_value_info(o, _DTYPES[dt], [f"{o}_{i}" for i in range(rank)])
         for o, (dt, rank) in zip(outs, out_specs)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              functions=onnx_functions(sinkhorn_rounds), ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})


def positions(starts: list[int], n: int) -> torch.Tensor:
    return torch.tensor(starts).unsqueeze(1) + torch.arange(n)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def window_inputs(gen, B=3, S=5, H=4, d=16, W=8, starts=(0, 9, 30)):
    q = torch.randn(B, S, H, d, generator=gen)
    q_pos = positions(list(starts), S)
    kv = torch.randn(B, W - 1 + S, d, generator=gen)
    kv_pos = q_pos[:, :1] - (W - 1) + torch.arange(W - 1 + S)
    return q, q_pos, kv, kv_pos, torch.randn(H, generator=gen)


def test_every_op_has_a_function():
    assert {f.name for f in onnx_functions()} >= set(PLUGIN_OPS)


@pytest.mark.parametrize("unrolled", [None, 19])
def test_sinkhorn_function_is_its_reference(gen, unrolled):
    """The mHC Sinkhorn rounds as one node: its function (a Loop of 19 rounds, V4's 20 iterations, or the 19
    rounds written out for CUDA graphs) runs the reference's very operations, so ONNX Runtime agrees to float
    rounding; the reference gives doubly stochastic rows."""
    comb = torch.rand(2, 5, 4, 4, generator=gen) + 0.01
    expected = hc_sinkhorn(comb, rounds=19, eps=1e-6)
    (got,) = run_onnx("HcSinkhorn", [comb], {"rounds": 19, "eps": 1e-6}, [(torch.float32, 4)], plugin=False,
                      sinkhorn_rounds=unrolled)
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-7)
    torch.testing.assert_close(expected.sum(-2), torch.ones(2, 5, 4), rtol=0, atol=1e-5)
    ops = {node.op_type for f in onnx_functions(unrolled) if f.name == "HcSinkhorn" for node in f.node}
    assert ("Loop" in ops) == (unrolled is None)


def test_sliding_attention(gen):
    q, q_pos, kv, kv_pos, sink = window_inputs(gen)
    ref = sliding_attention(q, q_pos, kv, kv_pos, sink, window=8, scale=0.25)
    (got,) = run_onnx("SlidingAttention", [q, q_pos, kv, kv_pos, sink], dict(window=8, scale=0.25), [(torch.float32, 4)])
    assert np.abs(got - ref.numpy()).max() <= TOL


@pytest.mark.parametrize("n_rows", [0, 6])
def test_hca_attention(gen, n_rows):
    q, q_pos, kv, kv_pos, sink = window_inputs(gen)
    rows = torch.randn(3, n_rows, 16, generator=gen)
    row_ids = torch.tensor([[r if r < n else -1 for r in range(n_rows)] for n in (0, 2, 6)],
                           dtype=torch.int64).reshape(3, n_rows)
    ref = hca_attention(q, q_pos, kv, kv_pos, rows, row_ids, sink, window=8, ratio=4, scale=0.25)
    (got,) = run_onnx("HcaAttention", [q, q_pos, kv, kv_pos, rows, row_ids, sink], dict(window=8, ratio=4, scale=0.25), [(torch.float32, 4)])
    assert np.abs(got - ref.numpy()).max() <= TOL


@pytest.mark.parametrize("k", [0, 3])
def test_csa_attention(gen, k):
    q, q_pos, kv, kv_pos, sink = window_inputs(gen)
    rows = torch.randn(3, 6, 16, generator=gen)
    topk_idx = torch.randint(-1, 6, (3, 5, k), generator=gen)
    ref = csa_attention(q, q_pos, kv, kv_pos, rows, topk_idx, sink, window=8, scale=0.25)
    (got,) = run_onnx("CsaAttention", [q, q_pos, kv, kv_pos, rows, topk_idx, sink], dict(window=8, scale=0.25), [(torch.float32, 4)])
    assert np.abs(got - ref.numpy()).max() <= TOL


@pytest.mark.parametrize("op, fn, ratio, state, width", [("HcaCompress", hca_compress, 8, 7, 16),
                                                         ("CsaCompress", csa_compress, 4, 7, 32)])
@pytest.mark.parametrize("n_new, starts", [(1, (0, 3, 7)), (5, (0, 6, 13)), (12, (0, 1, 21))])
def test_compressor_emission(gen, op, fn, ratio, state, width, n_new, starts):
    kv = torch.randn(3, state + n_new, width, generator=gen)
    gate = torch.randn(3, state + n_new, width, generator=gen)
    first_pos = torch.tensor(starts) - state
    ref_rows, ref_ids = fn(kv, gate, first_pos, ratio=ratio, state_tokens=state)
    rows, ids = run_onnx(op, [kv, gate, first_pos], dict(ratio=ratio, state_tokens=state),
                          [(torch.float32, 3), (torch.int64, 2)])
    assert np.array_equal(ids, ref_ids.numpy())
    valid = ids >= 0
    assert valid.any() or n_new < ratio
    assert np.abs(rows[valid] - ref_rows.numpy()[valid]).max(initial=0) <= TOL


def test_compressor_rows_equal_a_direct_window_loop(gen):
    """The reference itself, against the definition: row w = sum over its slots of softmax(gate) * value."""
    m, d = 4, 8
    kv, gate = torch.randn(1, 20, 2 * d, generator=gen), torch.randn(1, 20, 2 * d, generator=gen)
    rows, ids = csa_compress(kv, gate, torch.tensor([0]), ratio=m, state_tokens=0)
    for i, w in enumerate(ids[0].tolist()):
        values = [kv[0, t, :d] for t in range(m * w - m, m * w) if t >= 0] + [kv[0, t, d:] for t in range(m * w, m * w + m)]
        gates = [gate[0, t, :d] for t in range(m * w - m, m * w) if t >= 0] + [gate[0, t, d:] for t in range(m * w, m * w + m)]
        expected = (torch.softmax(torch.stack(gates), 0) * torch.stack(values)).sum(0)
        assert torch.allclose(rows[0, i], expected, atol=1e-6)


@pytest.mark.parametrize("n_keys", [0, 2, 9])
def test_indexer_topk(gen, n_keys):
    q = torch.randn(3, 5, 2, 8, generator=gen)
    weights = torch.randn(3, 5, 2, generator=gen)
    keys = torch.randn(3, n_keys, 8, generator=gen)
    key_ids = torch.tensor([[r if r < n else -1 for r in range(n_keys)] for n in (0, 3, n_keys)],
                           dtype=torch.int64).reshape(3, n_keys)
    q_pos = positions([0, 12, 40], 5)
    ref = indexer_topk(q, weights, keys, key_ids, q_pos, topk=4, ratio=4, scale=0.5)
    (got,) = run_onnx("IndexerTopK", [q, weights, keys, key_ids, q_pos], dict(topk=4, ratio=4, scale=0.5), [(torch.int64, 3)])
    assert np.array_equal(got, ref.numpy())


def test_indexer_ties_go_to_the_lowest_row_in_both_realisations():
    """All-negative q.k makes every score exactly 0: the lowest visible rows must win, not arbitrary ones."""
    keys = torch.ones(1, 9, 8)
    q = -torch.ones(1, 1, 2, 8)
    args = [q, torch.ones(1, 1, 2), keys, torch.arange(9).unsqueeze(0), torch.tensor([[35]])]
    ref = indexer_topk(*args, topk=4, ratio=4, scale=0.5)
    (got,) = run_onnx("IndexerTopK", args, dict(topk=4, ratio=4, scale=0.5), [(torch.int64, 3)])
    assert ref.tolist() == got.tolist() == [[[0, 1, 2, 3]]]
