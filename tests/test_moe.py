"""The routed MoE: only the chosen experts compute, and the result is the dense sum over every expert weighted by
the dense routing matrix (zero for experts not chosen), in every realisation."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from v4engine.builder.build import BuildOptions, build
from v4engine.builder.checkpoint import quantize_fp8_block, quantize_mxfp4
from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState
from v4engine.builder.model.v4 import MoE
from v4engine.builder.tiny import TINY_CONFIGS
from v4engine.contract.config import V4Config
from v4engine.contract.engine import EngineManifest
from v4engine.plugins.moe import (decode_fp8, decode_mxfp4, e8m0_scales, fp8_routed_experts, mxfp4_routed_experts,
                                  routed_experts, swiglu)
from v4engine.runtime import Generator, SamplingParams
from v4engine.runtime.sessions.onnxruntime import QMOE_GEMM
from v4engine.testkit.oracle import oracle_accepted_counts

from test_ops import run_onnx

LIMIT = 1.5          # small enough that both clamps bite on unit-scale activations


def dense(x, indices, weights, w1, w2, w3, limit):
    """Every expert on every token, weighted by the dense [T, E] routing matrix: what the export computed before
    the MoE was routed (a repeated pick adds its weight)."""
    route = torch.zeros(x.shape[0], w1.shape[0]).scatter_add(1, indices, weights)
    h = swiglu(torch.einsum("td,eid->eti", x, w1), torch.einsum("td,eid->eti", x, w3), limit)
    return torch.einsum("eti,edi->td", h * route.t().unsqueeze(-1), w2)


def experts(gen, E=32, D=24, inter=16):
    return (torch.randn(E, inter, D, generator=gen) / D ** 0.5, torch.randn(E, D, inter, generator=gen) / inter ** 0.5,
            torch.randn(E, inter, D, generator=gen) / D ** 0.5)


def picks(gen, T, E, k, repeats=False):
    """Each token's k distinct experts (or, like a hash layer's table may, some repeated) and positive weights."""
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if repeats:
        indices[::3, 1] = indices[::3, 0]
    return indices, torch.rand(T, k, generator=gen) + 0.1


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeated picks"])
def test_routed_equals_dense_with_many_more_experts_than_top_k(gen, repeats):
    w1, w2, w3 = experts(gen)
    x = 2 * torch.randn(40, 24, generator=gen)
    indices, weights = picks(gen, 40, 32, 3, repeats)
    got = routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT)
    torch.testing.assert_close(got, dense(x, indices, weights, w1, w2, w3, LIMIT), rtol=0, atol=1e-5)


def test_only_the_chosen_experts_are_read(gen):
    """An expert nobody chose may hold anything, NaN included: the result does not change."""
    w1, w2, w3 = experts(gen, E=8)
    x = torch.randn(5, 24, generator=gen)
    indices, weights = picks(gen, 5, 4, 2)                         # experts 4..7 never chosen
    expected = routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT)
    for w in (w1, w2, w3):
        w[4:] = float("nan")
    torch.testing.assert_close(routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT), expected, rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 7])
def test_onnx_function_equals_the_reference(gen, T):
    w1, w2, w3 = experts(gen)
    x = 2 * torch.randn(T, 24, generator=gen)
    indices, weights = picks(gen, T, 32, 4, repeats=True)
    expected = routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT)
    (got,) = run_onnx("RoutedExperts", [x, indices, weights, w1, w2, w3], {"limit": LIMIT}, [(torch.float32, 2)],
                      plugin=False)
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-5)


def test_stored_bytes_decode_exactly_in_the_onnx_functions():
    """Every byte, as the int8 TensorRT and MIGraphX hold: e4m3 (subnormals, both zeros, NaN) and two e2m1 codes."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.int8).reshape(1, 256)
    scale = torch.tensor([[2.0 ** -3, 2.0 ** 5]])
    (fp8,) = run_onnx("DecodeFp8", [every, scale, torch.zeros(1)], {}, [(torch.float32, 2)], plugin=False)
    np.testing.assert_array_equal(fp8, decode_fp8(every, scale).numpy())
    numbers = ~np.isnan(fp8)                                                # -0.0 too (a NaN's sign means nothing)
    np.testing.assert_array_equal(np.signbit(fp8[numbers]), np.signbit(decode_fp8(every, scale).numpy()[numbers]))
    assert np.isnan(fp8).sum() == 2 and fp8[0, 1] == 2.0 ** -9 * 2.0 ** -3           # NaN codes; a subnormal
    e8m0 = (torch.arange(16) + 127 - 8).to(torch.uint8).view(torch.int8).reshape(1, 16)        # 2^-8 .. 2^7
    (fp4,) = run_onnx("DecodeMxfp4", [every, e8m0, torch.zeros(1)], {}, [(torch.float32, 2)], plugin=False)
    np.testing.assert_array_equal(fp4, decode_mxfp4(every, e8m0_scales(e8m0)).numpy())
    assert (fp4[0, 2 * 0x71], fp4[0, 2 * 0x71 + 1]) == (0.5 * 0.5, 6.0 * 0.5)     # low nibble first; block 7


def stored(w: torch.Tensor, quantize: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [E, rows, cols] as the stored-bytes ops take them: int8 bytes and their scales (FP8: fp32 rows of the
    grid; MXFP4: the E8M0 bytes, int8)."""
    parts = []
    for expert in w:
        if quantize == "fp8":
            q, grid = quantize_fp8_block(expert)
            parts.append((q.view(torch.int8), grid.float().repeat_interleave(128, 0)[: expert.shape[0]]))
        else:
            packed, e8m0 = quantize_mxfp4(expert)
            parts.append((packed.view(torch.int8), e8m0.view(torch.int8)))     # E8M0 bytes, as stored
    return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])


@pytest.mark.parametrize("quantize, reference", [("fp8", fp8_routed_experts), ("mxfp4", mxfp4_routed_experts)])
def test_stored_bytes_functions_equal_their_reference(gen, quantize, reference):
    w1, w2, w3 = experts(gen, E=16, D=64, inter=32)
    x = 2 * torch.randn(6, 64, generator=gen)
    indices, weights = picks(gen, 6, 16, 4, repeats=True)
    inputs = [x, indices, weights, *stored(w1, quantize), *stored(w2, quantize), *stored(w3, quantize)]
    expected = reference(*inputs, limit=LIMIT)
    name = "Fp8RoutedExperts" if quantize == "fp8" else "Mxfp4RoutedExperts"
    (got,) = run_onnx(name, inputs, {"limit": LIMIT}, [(torch.float32, 2)])
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-5)
    decode = decode_fp8 if quantize == "fp8" else lambda data, e8m0: decode_mxfp4(data, e8m0_scales(e8m0))
    dequantized = [decode(*stored(w, quantize)) for w in (w1, w2, w3)]
    torch.testing.assert_close(expected, routed_experts(x, indices, weights, *dequantized, limit=LIMIT),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixed", "flash_like"])
def test_stacked_moe_equals_the_per_expert_moe(gen, name):
    """What the export runs (StackedExperts) against the checkpoint's layout (one module per expert), scored and
    hash layers alike."""
    cfg = V4Config.from_dict(TINY_CONFIGS[name])
    for hashed in (False, True):
        moe = MoE(cfg, hashed).eval()
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        if hashed:
            moe.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, moe.gate.tid2eid.shape, generator=gen))
        x = 3 * torch.randn(2, 9, cfg.hidden_size, generator=gen)
        ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
        with torch.no_grad():
            expected = moe(x, ids)
            moe.stack_experts()
            torch.testing.assert_close(moe(x, ids), expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def mxfp4_engine(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("flash_like", quantize="mxfp4")
    out = tmp_path_factory.mktemp("mxfp4") / "engine"
    build(BuildOptions(checkpoint=checkpoint, output=out, mtp=3, progress=False))
    return checkpoint, out


@torch.no_grad()
def model_greedy(model, ids: list[int], n: int) -> list[int]:
    """Our PyTorch model (MXFP4 experts dequantized, every expert module), full recompute each step."""
    seq = list(ids)
    for _ in range(n):
        state = ModelState(model.cfg, 1)
        seq.append(int(model(torch.tensor([seq]), state.positions(len(seq)), state.views()).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_an_mxfp4_engine_generates_what_the_model_does_at_every_draft_length(mxfp4_engine):
    """ONNX Runtime's QMoE over the experts as stored (int8 codes made at load), target and MTP layer alike: greedy
    tokens equal the model's for MTP 0..2, and each verify accepts what the oracle accepts."""
    checkpoint, engine = mxfp4_engine
    model = load_model(checkpoint, mtp=True)
    ids = torch.randint(0, model.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = model_greedy(model, ids, 16)
    for k in range(3):
        [result] = Generator.from_engine_dir(engine, mtp=k).generate(
            [ids], SamplingParams(max_new_tokens=16, ignore_eos=True))
        assert result.token_ids == expected, f"MTP {k}"
        if k:
            accepted = result.metrics["accepted_per_step"]
            assert accepted == oracle_accepted_counts(model, ids, k, 16)[: len(accepted)]


def test_int8_moe_activations_are_opt_in_named_in_engine_json_and_near_the_exact_path(mxfp4_engine, tmp_path):
    """v4build --int8-moe-activations (lossy): ONNX Runtime's QMoE quantizes the experts' inputs to int8, which
    engine.json names; the log-probabilities move a little off the exact path, which every other engine (and every
    other session of the process) keeps. (A value engine.json may not hold: tests/test_backends.py.)"""
    checkpoint, exact = mxfp4_engine
    lossy = tmp_path / "int8"
    build(BuildOptions(checkpoint=checkpoint, output=lossy, mtp=3, progress=False,
                       backend_options={"int8_moe_activations": True}))
    assert EngineManifest.read(lossy).compiled.moe_activations == "int8"
    assert EngineManifest.read(exact).compiled.moe_activations == "fp32"
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    [want] = Generator.from_engine_dir(exact, mtp=0).generate([ids], params)
    [got] = Generator.from_engine_dir(lossy, mtp=0).generate([ids], params)
    gaps = [abs(a.logprob - b.logprob) for a, b in zip(want.prompt_logprobs, got.prompt_logprobs)]
    assert 0 < max(gaps) < 0.1, max(gaps)
    assert os.environ[QMOE_GEMM] == "fp32"
