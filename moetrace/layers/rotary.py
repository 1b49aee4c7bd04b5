"""Rotary position embedding (the rotate-half layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrace.errors import ModelError


def rope_settings(config: dict) -> tuple[float, dict]:
    """(theta, scaling dict) from either the old (``rope_theta``) or new (``rope_parameters``) keys."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    return float(theta), merged


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original_len: int) -> float:
    """The rotary dimension that turns ``rotations`` times over the original context."""
    return (dim * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def yarn_parameters(
    head_dim: int, theta: float, scaling: dict, max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN's (inv_freq, attention factor), step for step as transformers computes them.

    High frequencies keep their rotation, low ones are interpolated by ``factor``
    and a linear ramp blends the two; cos/sin are scaled by the attention
    factor.  Same float32 ops and the same ``truncate=True`` default as the
    reference: a different rounding would move attention and with it routing.
    """
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelError("yarn rope with partial_rotary_factor != 1 is not supported")
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise ModelError("yarn rope needs original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ModelError("yarn rope needs a factor or max_position_embeddings")
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, head_dim, theta, original)
    high = _yarn_correction_dim(beta_slow, head_dim, theta, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None = None,
        *,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        self.attention_scaling = 1.0
        if kind == "yarn":
            inv_freq, self.attention_scaling = yarn_parameters(
                head_dim, theta, scaling or {}, max_position_embeddings
            )
        elif kind in ("default", None):
            inv_freq = 1.0 / (
                theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
            )
        else:
            raise ModelError(f"rope scaling type {kind!r} is not supported yet")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # scaled in float32 before the cast, as the reference
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` is [tokens, heads, head_dim]; cos/sin are [tokens, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    # Interleaved layouts (DeepSeek): the rotated pairs are (x0, x1), (x2, x3), ...
    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """complex64 [tokens, head_dim / 2] rotations times the attention factor (DeepSeek-V2).

        Built with ``torch.polar`` in float32 as the reference builds them, so the
        rotated keys round the same way.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling

    @staticmethod
    def apply_complex(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V2: pairs rotated as complex numbers in float32; output stays interleaved."""
        pairs = torch.view_as_complex(x.float().contiguous().view(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotations[:, None, :]).flatten(-2).type_as(x)

    @staticmethod
    def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 ``rope_interleave``: pairs rotated in x's dtype; output is de-interleaved.

        The output holds every pair's first component, then every second one:
        the layout the reference caches (q and k alike, so q·k is unchanged).
        """
        half = cos.shape[-1] // 2
        cos, sin = cos[:, None, :half], sin[:, None, :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
