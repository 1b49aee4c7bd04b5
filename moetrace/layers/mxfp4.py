"""MXFP4 (OCP microscaling FP4) weights: decoding, and random ones for dummy loads.

A quantized tensor is two checkpoint tensors: ``*_blocks [..., G, 16]`` uint8,
each byte two FP4 (e2m1) values with the low nibble first, and
``*_scales [..., G]`` uint8, one e8m0 exponent per block of 32 values
(scale ``2 ** (s - 127)``).  The 32 values of block ``g`` are elements
``32 g .. 32 g + 31`` of the last dimension.  Experts keep them MXFP4 on the
device (``MoEExperts(weight_format="mxfp4")``), re-laid at load into the
fused-MoE kernel's fragment layout (``kernels/mxfp4_layout.py``) unless
``MOETRACE_MXFP4_LAYOUT=checkpoint`` keeps the checkpoint's (and the kernel's
older decoders: its bit decoder at decode, ``tl.dot_scaled`` at prefill);
this module decodes the checkpoint layout for the plain path and the tests.
"""

from __future__ import annotations

import math

import torch

from moetrace import envs
from moetrace.errors import ModelError
from moetrace.kernels.mxfp4_layout import LAYOUTS

# How MoEExperts keep MXFP4 experts (read once, when the module is imported).
MXFP4_LAYOUT = envs.get("MOETRACE_MXFP4_LAYOUT")
assert MXFP4_LAYOUT in LAYOUTS
# The fragment layout's fast decoder multiplies by bf16 2**(s - 1): exact up to this scale
# (values to 12); experts with a larger one decode by the exact generic path instead.
FAST_SCALE_MAX = 128

# e2m1 by code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; code 0b0001 is subnormal.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES += tuple(-v for v in E2M1_VALUES)
E8M0_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[..., G, 16]`` blocks and ``[..., G]`` scales → ``[..., 32 G]`` values in ``dtype``.

    Exact: every e2m1 value times a power of two is representable in float32,
    and in bfloat16 (8 exponent bits) too.
    """
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
            "(want blocks [..., G, 16] with scales [..., G])"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    low, high = lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


def quant_method(config: dict) -> str | None:
    """The checkpoint's quantization method, lower case (None: plain weights)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict) or not quant.get("quant_method"):
        raise ModelError("quantization_config without a quant_method")
    return str(quant["quant_method"]).lower()


def random_mxfp4_(tensor: torch.Tensor, name: str, std: float, gen: torch.Generator) -> None:
    """Fill an MXFP4 parameter for ``--load-format dummy``: values of about ``std`` RMS.

    Blocks get uniform random bytes (every e2m1 code equally likely: RMS
    ``sqrt(mean(v**2))`` = 2.93), scales ``2 ** (s - 127)`` with ``s`` chosen
    so that the RMS lands within a factor sqrt(2) of ``std``.
    """
    if name.endswith("_scale"):
        rms = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5
        tensor.fill_(E8M0_BIAS + round(math.log2(std / rms)))
    else:
        tensor.copy_(
            torch.randint(
                0, 256, tensor.shape, generator=gen, device=gen.device, dtype=tensor.dtype
            )
        )
