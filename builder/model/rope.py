"""Rotary embedding of DeepSeek-V4: interleaved pairs on the trailing channels of a head (docs/model.md §2.4).

Sliding layers and the MTP layer use the main rope (theta 10000); every rotary inside CSA/HCA layers
uses the compress rope (theta 160000 + DeepSeek YaRN without mscale). Frequencies are computed as
transformers computes them (fp32), so the oracle comparison is not blurred by rounding.
"""
from __future__ import annotations

import math

import torch

from v4engine.contract.config import Rope


def inv_freq(rope: Rope) -> torch.Tensor:
    """The rope.dim // 2 inverse frequencies, YaRN-blended where the rope has YaRN."""
    dim = rope.dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.yarn is None:
        return extrapolation
    y = rope.yarn
    interpolation = 1.0 / (y.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, dim/2] (fp32)."""
    angles = positions.unsqueeze(-1).float() * freqs
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x in interleaved pairs (x0, x1), (x2, x3), ...

    cos/sin have x's leading shape with or without x's head axis ([B,S,r/2] for x [B,S,H,d] broadcasts
    over heads). `inverse` applies the conjugate rotation (used to de-rotate the attention output).
    """
    half = cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    pairs = rope.float().reshape(*rope.shape[:-1], half, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
