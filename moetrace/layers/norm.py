"""RMSNorm computed the way the reference models do: in float32, then cast back."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    kernel_half_only = True  # the Triton kernel rounds like this path only for 16-bit inputs
    # False: the normalised row is rounded to the input dtype, then weighted (most
    # references); True: the weight multiplies the float32 row, rounded once (gpt-oss's).
    weight_in_float32 = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.use_triton = False  # set by the model runner on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from moetrace.kernels.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, weight_in_float32=self.weight_in_float32)
        dtype = x.dtype
        # gpt-oss's reference takes even float64 rows to float32
        wide = dtype == torch.float64 and not self.weight_in_float32
        h = x if wide else x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            return (self.weight.to(torch.float32) * h).to(dtype)
        return self.weight * h.to(dtype)
