"""Roundings the H200 build must keep, checked in the PTX that Triton generates for it.

The interpreter (``TRITON_INTERPRET=1``) runs kernels through numpy, which
never fuses a product into an add nor approximates a division, so what the
compiler does to them shows only in the compiled code.  Triton compiles for
a named GPU without one (as ``engine/precompile.py`` does), so this runs on
the CPU wherever Triton is installed.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moetrace.kernels import triton_attention, triton_norm  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
SCALARS = {"eps": "fp32", "inv_dim": "fp32", "score_scale": "fp32"}
FLOAT32_POINTERS = {"part_acc_ptr", "part_ml_ptr"}
INT_POINTERS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "bt_stride_ptr"}


def ptx(fn, constants: dict, **options) -> str:
    """PTX of ``fn`` for the H200: 16-bit tensors, int32 scalars unless named in SCALARS."""
    names = fn.arg_names

    def kind(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in FLOAT32_POINTERS:
            return "*fp32"
        if name in INT_POINTERS:
            return "*i32"
        if name.endswith("_ptr"):
            return "*bf16"
        return SCALARS.get(name, "i32")

    source = ASTSource(
        fn,
        {n: kind(n) for n in names},
        {(names.index(k),): v for k, v in constants.items()},
        {},
    )
    return triton.compile(source, target=H200, options=options).asm["ptx"]


@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_rms_norm_fuses_no_product_into_an_add(weight_in_float32):
    """torch squares, sums, scales by 1/dim and adds eps in separately rounded steps."""
    constants = {"BLOCK_D": 4096, "WEIGHT_IN_FLOAT32": weight_in_float32}
    code = ptx(triton_norm._rms_norm_kernel, constants, num_warps=8, enable_fp_fusion=False)
    assert "fma.rn.f32" not in code
    # The same kernel built as Triton builds by default fuses them: the check can tell.
    fused = ptx(triton_norm._rms_norm_kernel, constants, num_warps=8)
    assert "fma.rn.f32" in fused


def test_sink_attention_divides_as_ieee():
    """Each probability is ``exp / sum`` correctly rounded, as torch's softmax divides,
    not the approximate division Triton emits for ``/``."""
    constants = {
        "GROUP": 8, "BLOCK_Q": 2, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 64, "BLOCK_D": 64,
        "BLOCK_SIZE": 16, "NUM_SPLITS": 1, "DECODE_CLASS": True, "USE_WINDOW": True,
        "DOT_PRECISION": "tf32", "HAS_SINKS": True, "PRECISE_EXP": True,
    }  # fmt: skip
    code = ptx(triton_attention._paged_attention_kernel, constants, num_warps=4, num_stages=2)
    assert "div.rn.f32" in code
