"""Rotary position embedding of DeepSeek-V3 / Kimi verifiers: YaRN with DeepSeek's mscale.

The draft must rotate exactly as vLLM rotates it at serving time, so the numbers follow vLLM's
`DeepseekScalingRotaryEmbedding` (get_rope with rope_type "deepseek_yarn", is_neox_style False
for every MLA layer):

- inverse frequencies: YaRN blend of interpolated (theta^(-2i/d) / factor) and extrapolated
  (theta^(-2i/d)) frequencies, with a linear ramp between the correction dims given by
  beta_fast / beta_slow at original_max_position_embeddings (floor/ceil truncated);
- cos/sin are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim);
- the softmax scale qk_head_dim^-0.5 is multiplied by mscale(factor, mscale_all_dim)^2
  (DeepSeek's correction; vLLM and transformers both apply it when mscale_all_dim is set);
- "interleaved" rotates adjacent pairs (x0, x1), (x2, x3), ... (GPT-J layout, Kimi's
  `rope_interleave: true`); the other layout rotates the two halves (NeoX).

transformers' DeepseekV3 de-interleaves q/k before rotating; that permutes the rope dims of q
and k alike, so attention scores are identical to the in-place pair rotation used here.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's magnitude correction for a YaRN factor `scale` (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    """Everything that decides the rotation, read from HF `rope_parameters` + head dims."""

    rotary_dim: int                 # qk_rope_head_dim
    theta: float
    rope_type: str = "default"      # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0     # 0 = not set (no softmax correction)
    interleaved: bool = True

    @classmethod
    def from_hf(cls, rope_parameters: Mapping[str, Any], rotary_dim: int, interleaved: bool) -> RopeSpec:
        """From a transformers-5 `rope_parameters` dict (or a legacy `rope_scaling` + rope_theta)."""
        params = dict(rope_parameters)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (only {SUPPORTED_ROPE_TYPES})")
        if params.get("attention_factor") is not None:
            # vLLM then switches to "deepseek_llama_scaling" (no softmax correction) while
            # transformers uses it for cos/sin: the two disagree, so refuse rather than guess.
            raise ValueError("rope_parameters.attention_factor is not supported")
        if "rope_theta" not in params:
            raise ValueError("rope_parameters needs rope_theta")
        if rope_type == "default":
            return cls(rotary_dim=rotary_dim, theta=float(params["rope_theta"]), interleaved=interleaved)
        return cls(
            rotary_dim=rotary_dim,
            theta=float(params["rope_theta"]),
            rope_type="yarn",
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            mscale=float(params.get("mscale", 1.0)),
            mscale_all_dim=float(params.get("mscale_all_dim", 0.0) or 0.0),
            interleaved=interleaved,
        )

    @property
    def cos_sin_scale(self) -> float:
        """Factor on cos/sin (vLLM's `DeepseekScalingRotaryEmbedding.mscale`)."""
        if self.rope_type == "default":
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """Attention logit scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN."""
        scale = qk_head_dim ** -0.5
        if self.rope_type == "yarn" and self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale


def _correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    # The rotary dim index whose wavelength fits `num_rotations` times into max_positions.
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_freq(spec: RopeSpec) -> Tensor:
    """Inverse frequencies [rotary_dim/2], fp32, computed on CPU like vLLM's cache."""
    d = spec.rotary_dim
    pos_freqs = spec.theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    extrapolation = 1.0 / pos_freqs
    if spec.rope_type == "default":
        return extrapolation
    interpolation = 1.0 / (spec.factor * pos_freqs)
    assert spec.original_max_position_embeddings is not None
    low = math.floor(_correction_dim(spec.beta_fast, d, spec.theta, spec.original_max_position_embeddings))
    high = math.ceil(_correction_dim(spec.beta_slow, d, spec.theta, spec.original_max_position_embeddings))
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite
    ramp = ((torch.arange(d // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    # Dims below `low` rotate fast enough to keep their original frequency (extrapolate);
    # dims above `high` are interpolated by `factor`; the ramp blends in between.
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    """Rotates the rope part of q/k by position. cos/sin are computed per call in fp32."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        # A plain attribute, not a buffer: `.to(bfloat16)` on the model must not round the
        # frequencies, and they are derived from the config, never part of a checkpoint.
        self._inv_freq = inv_freq(spec)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: [..., T] int -> cos, sin: [..., T, 1, rotary_dim/2] fp32 (head axis for broadcast)."""
        if self._inv_freq.is_meta:    # made on the meta device, weights assigned later: derive them now
            self._inv_freq = inv_freq(self.spec)
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        inv = self._inv_freq
        freqs = positions.to(torch.float32)[..., None] * inv  # [..., T, d/2]
        scale = self.spec.cos_sin_scale
        return (freqs.cos() * scale)[..., None, :], (freqs.sin() * scale)[..., None, :]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: [..., T, heads, rotary_dim], positions: [..., T] -> x rotated, same shape and dtype."""
        cos, sin = self.cos_sin(positions)
        xf = x.float()
        if self.spec.interleaved:
            pairs = xf.unflatten(-1, (-1, 2))          # [..., T, heads, d/2, 2]
            x1, x2 = pairs[..., 0], pairs[..., 1]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = xf.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
