"""The Triton RMSNorm and rotary kernels against the plain-torch modules they replace.

Rotary must be bit-identical in bfloat16 (the same three roundings; the first
H200 build, which let the compiler fold them into one, failed here).  RMSNorm
may differ where float32 sums in another order round to a neighbouring
16-bit value.
Needs CUDA, or ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from support.triton import DEVICE, INTERPRET, KERNEL_TEST_MARKS

pytestmark = KERNEL_TEST_MARKS
HALF = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two 16-bit tensors."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    # Map the sign-magnitude bit patterns to a monotone integer line.
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("tokens", "heads", "dim"), [(1, 1, 2048), (37, 1, 4096), (5, 32, 128), (9, 4, 8), (3, 2, 72)]
)
def test_rms_norm_matches_the_module(dtype, tokens, heads, dim):
    from moetrace.kernels.triton_norm import rms_norm
    from moetrace.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(tokens * 1000 + dim)
    norm = RMSNorm(dim, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.5 + 1)
    x = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(DEVICE, dtype)
    if heads == 1:
        x = x[:, 0]
    ref = norm(x)
    got = rms_norm(x, norm.weight, norm.eps)
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
    assert _ulps_apart(got, ref) <= 1
    assert (got != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", HALF)
def test_gpt_oss_rms_norm_kernel_matches_its_module(dtype):
    """gpt-oss multiplies its weight into the float32 row and rounds once: so does the kernel."""
    from moetrace.models.gpt_oss import GptOssRMSNorm

    gen = torch.Generator().manual_seed(8)
    norm = GptOssRMSNorm(2880, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2880, generator=gen) * 0.5 + 1)
    x = (torch.randn(37, 2880, generator=gen) * 3).to(DEVICE, dtype)
    ref = norm(x)
    norm.use_triton = True
    got = norm(x)
    assert _ulps_apart(got, ref) <= 1
    assert (got != ref).float().mean() < 0.01
    # The other rounding order differs on many elements: the test can tell them apart.
    from moetrace.kernels.triton_norm import rms_norm

    assert (rms_norm(x, norm.weight, norm.eps) != ref).float().mean() > 0.05


def test_rms_norm_reads_strided_views_of_a_fused_projection():
    """q and k of a fused QKV output are views with row stride > heads x dim."""
    from moetrace.kernels.triton_norm import rms_norm

    dtype = HALF[0]
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(11, 4 * 16 + 2 * 2 * 16, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : 4 * 16].reshape(11, 4, 16)
    assert not q.is_contiguous()
    weight = (torch.rand(16, generator=gen) + 0.5).to(DEVICE, dtype)
    assert torch.equal(rms_norm(q, weight, 1e-5), rms_norm(q.contiguous(), weight, 1e-5))


@pytest.mark.parametrize(
    ("tokens", "heads", "dim"), [(1, 32, 128), (300, 4, 128), (7, 16, 64), (3, 5, 24)]
)
def test_rotary_is_bit_identical_to_the_torch_expression(tokens, heads, dim):
    from moetrace.kernels.triton_norm import rotary
    from moetrace.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(heads * 100 + dim)
    rope = RotaryEmbedding(dim, 1_000_000.0).to(DEVICE)
    positions = torch.randint(0, 40_000, (tokens,), generator=gen).to(DEVICE)
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    fused = torch.randn(tokens, heads * dim + 8, generator=gen).to(DEVICE, torch.bfloat16)
    x = fused[:, : heads * dim].reshape(tokens, heads, dim)  # a strided view, as from QKV
    ref = RotaryEmbedding.apply(x, cos, sin)
    got = rotary(x, cos, sin)
    assert got.is_contiguous()
    assert torch.equal(got, ref)
    # Rounding once (a float32 sum cast at the end) would differ in ~30% of elements:
    # the test tells the two apart.
    rotated = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    once = (x.float() * cos[:, None].float() + rotated.float() * sin[:, None].float()).bfloat16()
    assert (once != ref).float().mean() > 0.05


def test_rotary_refuses_dtypes_it_does_not_round_like():
    from moetrace.kernels.triton_norm import rotary

    x = torch.zeros(2, 1, 8, dtype=torch.float16, device=DEVICE)
    cos = torch.ones(2, 8, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="bfloat16 only"):
        rotary(x, cos, cos)
