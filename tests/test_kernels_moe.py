"""The Triton kernels of v4::RoutedExperts against the PyTorch reference (plugins/moe.py): weights as stored (the
activation dtype, FP8 block, MXFP4) dequantized inside the kernels; experts with more picks than a block, repeated
picks, masked picks. Without a GPU they run under the Triton interpreter (conftest.py) on small shapes;
test_kernels_aot.py compiles their plans (the catalog's) ahead of time."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from v4engine.builder.checkpoint import (E2M1_VALUES, FP8_BLOCK, MXFP4_BLOCK, quantize_fp8_block,  # noqa: E402
                                         quantize_mxfp4)
from v4engine.plugins import moe  # noqa: E402
from v4engine.plugins.kernels.moe import BLOCK_T, routed_experts  # noqa: E402

LIMIT = 1.5           # small enough that both clamps bite


def experts(gen, E, D, inter):
    return (torch.randn(E, inter, D, generator=gen) / D ** 0.5, torch.randn(E, D, inter, generator=gen) / inter ** 0.5,
            torch.randn(E, inter, D, generator=gen) / D ** 0.5)


def picks(gen, T, E, k):
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    indices[::4, 1] = indices[::4, 0]                                  # a hash layer's repeated pick
    return indices, torch.rand(T, k, generator=gen) + 0.1


def fp8(w):
    """FP8 block-quantized weights as the kernel takes them (e4m3 bytes, fp32 scale per 128 inputs, one row per
    output row) and their exact float values."""
    stored, scales, values = [], [], []
    for expert in w:
        q, e8m0 = quantize_fp8_block(expert)
        grid = torch.exp2(e8m0.view(torch.uint8).float() - 127).repeat_interleave(FP8_BLOCK, 0)[: expert.shape[0]]
        stored.append(q.view(torch.uint8))
        scales.append(grid)
        values.append(q.float() * grid.repeat_interleave(FP8_BLOCK, 1)[:, : expert.shape[1]])
    return torch.stack(stored), torch.stack(scales), torch.stack(values)


def mxfp4(w):
    """MXFP4 weights as the kernel takes them (packed codes, an E8M0 byte per 32 inputs) and their float values."""
    stored, scales, values = [], [], []
    table = torch.tensor(E2M1_VALUES)
    for expert in w:
        packed, e8m0 = quantize_mxfp4(expert)
        codes = torch.stack([packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4], -1).flatten(-2).long()
        scale = torch.exp2(e8m0.view(torch.uint8).float() - 127)
        magnitude = table[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
        stored.append(packed.view(torch.uint8))
        scales.append(e8m0.view(torch.uint8))
        values.append(magnitude * scale.repeat_interleave(MXFP4_BLOCK, 1))
    return torch.stack(stored), torch.stack(scales), torch.stack(values)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def test_float_weights_with_experts_of_more_picks_than_a_block(gen):
    E, D, inter, T, k = 12, 48, 40, 2 * BLOCK_T + 5, 3
    w1, w2, w3 = experts(gen, E, D, inter)
    x = 2 * torch.randn(T, D, generator=gen)
    indices, weights = picks(gen, T, E, k)
    indices[:, 2] = 7                                                  # expert 7: T picks, three blocks
    got = routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT)
    torch.testing.assert_close(got, moe.routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("weight_format, quantize", [("fp8", fp8), ("mxfp4", mxfp4)])
def test_quantized_weights_are_dequantized_inside_exactly(gen, weight_format, quantize):
    """The kernels read the stored bytes and scales; the reference gets the same weights dequantized in PyTorch.
    Sizes not multiples of the FP8 block (partial blocks on both axes)."""
    E, D, inter, T, k = 6, 160, 96, 9, 2
    (q1, s1, v1), (q2, s2, v2), (q3, s3, v3) = (quantize(w) for w in experts(gen, E, D, inter))
    x = 2 * torch.randn(T, D, generator=gen)
    indices, weights = picks(gen, T, E, k)
    got = routed_experts(x, indices, weights, q1, q2, q3, limit=LIMIT, scales=(s1, s2, s3),
                         weight_format=weight_format)
    torch.testing.assert_close(got, moe.routed_experts(x, indices, weights, v1, v2, v3, limit=LIMIT),
                               rtol=0, atol=1e-5)


def test_masked_picks_count_nothing(gen):
    """A pick whose expert is out of range (-1, or E) adds nothing; a token whose picks are all masked gets 0."""
    E, D, inter, T, k = 5, 32, 24, 6, 2
    w1, w2, w3 = experts(gen, E, D, inter)
    x = torch.randn(T, D, generator=gen)
    indices, weights = picks(gen, T, E, k)
    indices[1, 0], indices[2, 1], indices[3] = -1, E, torch.tensor([-1, E + 3])
    got = routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT)
    kept = torch.where((indices >= 0) & (indices < E), weights, 0.0)
    expected = moe.routed_experts(x, indices.clamp(0, E - 1), kept, w1, w2, w3, limit=LIMIT)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(got[3], torch.zeros(D))


def test_bfloat16_activations(gen):
    """bf16 x and weights, fp32 accumulation: the reference on the same bf16 values, to bf16 rounding."""
    E, D, inter, T, k = 8, 64, 32, 5, 2
    w1, w2, w3 = (w.bfloat16() for w in experts(gen, E, D, inter))
    x = torch.randn(T, D, generator=gen).bfloat16()
    indices, weights = picks(gen, T, E, k)
    got = routed_experts(x, indices, weights, w1, w2, w3, limit=LIMIT)
    expected = moe.routed_experts(x.float(), indices, weights, w1.float(), w2.float(), w3.float(), limit=LIMIT)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name, quantize", [("Fp8RoutedExperts", fp8), ("Mxfp4RoutedExperts", mxfp4)])
def test_tensorrt_plugins_run_the_kernels_on_the_stored_bytes(gen, name, quantize):
    """The TensorRT plugins' just-in-time implementation (run_jit over the launcher of their OPS row), on the int8
    bytes TensorRT hands them, writes what the op's reference (plugins/moe.py, which decodes the bytes itself)
    computes, and what the float op computes on the dequantized values."""
    from v4engine.plugins.tensorrt.plugins import OPS, run_jit

    op = next(op for op in OPS if op.name == name)
    E, D, inter, T, k = 6, 256, 64, 7, 3
    (q1, s1, v1), (q2, s2, v2), (q3, s3, v3) = (quantize(w) for w in experts(gen, E, D, inter))
    x = 2 * torch.randn(T, D, generator=gen)
    indices, weights = picks(gen, T, E, k)
    inputs = [x, indices, weights, q1.view(torch.int8), s1, q2.view(torch.int8), s2, q3.view(torch.int8), s3]
    out = torch.full((T, D), float("nan"))
    run_jit(op, inputs, {"limit": LIMIT}, [out])
    torch.testing.assert_close(out, op.reference(*inputs, limit=LIMIT), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, moe.routed_experts(x, indices, weights, v1, v2, v3, limit=LIMIT),
                               rtol=0, atol=1e-5)
