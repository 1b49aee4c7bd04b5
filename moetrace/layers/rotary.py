"""Rotary position embedding (the rotate-half layout Hugging Face checkpoints use)."""

from __future__ import annotations

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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", None):
            raise ModelError(f"rope scaling type {kind!r} is not supported yet")
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` is [tokens, heads, head_dim]; cos/sin are [tokens, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
