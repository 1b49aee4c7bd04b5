"""``triton_rounding.round_to``: the nearest bfloat16 or float16, as torch's casts give it.

Kernels that must agree with transformers' eager modules round every float32
intermediate the reference holds in 16 bits.  On the GPU the bfloat16 rounding
is the conversion instruction itself (inline assembly, which the compiler
cannot fold away as it did a cast down and back up); in the interpreter it
works on the bits.  Either way it must be torch's cast: ties to even, overflow
to infinity, subnormals kept.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from support.triton import DEVICE, KERNEL_TEST_MARKS  # noqa: E402

from moetrace.kernels.triton_rounding import round_to  # noqa: E402

pytestmark = KERNEL_TEST_MARKS


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, round_to(tl.load(x_ptr + offs, mask=ok), DTYPE), mask=ok)


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """float32s across the range, exact ties between two ``dtype`` values (even and odd
    last bits), their neighbours, the largest finite values and past them, subnormals of
    both types, zeros and infinities."""
    gen = torch.Generator().manual_seed(1)
    spread = torch.randn(4096, generator=gen) * torch.exp2(
        torch.randint(-40, 40, (4096,), generator=gen).float()
    )
    low = torch.arange(0, 1 << 16, 37, dtype=torch.int32)  # one type's values as a bit field
    if dtype == torch.bfloat16:
        upper = low.to(torch.int32) << 16
        ties = (upper | 0x8000).view(torch.float32)
        ties = ties[torch.isfinite(ties)]
    else:
        halves = low.to(torch.int16).view(torch.float16).float()
        finite = halves[torch.isfinite(halves)]
        nxt = torch.nextafter(
            finite.to(torch.float16), torch.tensor(float("inf"), dtype=torch.float16)
        )
        ties = (finite + (nxt.float() - finite) / 2)[torch.isfinite(nxt)]
    ulp = torch.nextafter(ties, torch.tensor(float("inf"))) - ties
    big = torch.finfo(dtype).max
    edges = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), big, -big, big * 1.001, big * 0.9999,
         torch.finfo(dtype).tiny / 3, torch.finfo(torch.float32).tiny / 5, 1e-45, -1e-45],
    )  # fmt: skip
    return torch.cat([spread, ties, ties + ulp, ties - ulp, -ties, edges]).float()


def round_on(x: torch.Tensor, kind) -> torch.Tensor:
    """``round_to(x, kind)`` run by the kernel, back on the CPU."""
    out = torch.empty_like(x, device=DEVICE)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](
        x.to(DEVICE), out, x.numel(), DTYPE=kind, BLOCK=1024
    )
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_lands_on_torchs_cast(dtype):
    """Every value its cast's bits (a NaN stays a NaN)."""
    x = _hard_values(dtype)
    want = x.to(dtype).float()
    kind = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    got = round_on(x, kind)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isnan(round_on(torch.tensor([float("nan")]), kind)).all()
    # The test tells: truncating the low bits instead misses the rounding.
    truncated = (x.view(torch.int32) & -65536).view(torch.float32)
    assert dtype != torch.bfloat16 or not torch.equal(truncated, want)
