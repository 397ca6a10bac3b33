"""Quantized tiny checkpoints are laid out like the release and load through the same path as float ones."""
from __future__ import annotations

import pytest
import torch

from v4engine.builder.checkpoint import Checkpoint
from v4engine.builder.load import load_model
from v4engine.builder.model import ModelState


def logits(model, ids):
    state = ModelState(model.cfg, 1)
    with torch.no_grad():
        return model(ids, state.positions(ids.shape[1]), state.views()).logits


@pytest.mark.parametrize("quantize", ["fp8", "mxfp4"])
def test_release_layout_and_dequantized_model(tiny_checkpoint, quantize):
    folder = tiny_checkpoint("flash_like", quantize=quantize)
    ckpt = Checkpoint.open(folder)
    formats = {name: ckpt.info(name).format for name in ckpt.names()}
    expert = "layers.3.ffn.experts.1.w2.weight"
    assert formats[expert] == ("mxfp4" if quantize == "mxfp4" else "fp8_block")
    assert formats["layers.0.attn.wq_b.weight"] == formats["mtp.0.e_proj.weight"] == "fp8_block"
    assert formats["layers.2.attn.indexer.wq_b.weight"] == "fp8_block"
    assert formats["layers.2.attn.compressor.wkv.weight"] == formats["embed.weight"] == "plain"
    assert ckpt.info("layers.0.hc_attn_fn").dtype == ckpt.info("layers.0.attn.attn_sink").dtype == "F32"
    if quantize == "mxfp4":
        assert ckpt.info(expert).dtype == "I8" and ckpt.info(expert).scale.dtype == "F8_E8M0"

    exact = load_model(tiny_checkpoint("flash_like"), mtp=True)
    quantized = load_model(folder, mtp=True)
    ids = torch.randint(0, exact.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    a, b = logits(exact, ids).flatten(), logits(quantized, ids).flatten()
    assert torch.isfinite(b).all()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.9, "only quantization error (FP8 keeps 3 mantissa bits)"
    assert not torch.equal(a, b), "the quantized weights are really used"
