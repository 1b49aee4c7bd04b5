"""Roundings the H200 build must keep, checked in the PTX that Triton generates for it.

The interpreter (``TRITON_INTERPRET=1``) runs kernels through numpy, which
never fuses a product into an add nor approximates a division, so what the
compiler does to them shows only in the compiled code.  Triton compiles for
a named GPU without one (as ``engine/precompile.py`` does), so this runs on
the CPU wherever Triton is installed.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the H200: the interpreter stands in for jit", allow_module_level=True)

import triton.language as tl  # noqa: E402
from support.h200_compile import (  # noqa: E402
    FLOAT32_SCALARS,
    compile_h200,
    opcode,
    sass,
    sixteen_bit_kind,
)

from moetrace.kernels import triton_attention, triton_norm  # noqa: E402


def ptx(fn, constants: dict, **options) -> str:
    """PTX of ``fn`` for the H200: 16-bit tensors, int32 scalars unless float32 by name."""
    return compile_h200(fn, sixteen_bit_kind, constants, **options).asm["ptx"]


@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_rms_norm_fuses_no_product_into_an_add(weight_in_float32):
    """torch squares, sums, scales by 1/dim and adds eps in separately rounded steps."""
    constants = {"BLOCK_D": 4096, "WEIGHT_IN_FLOAT32": weight_in_float32}
    code = ptx(triton_norm._rms_norm_kernel, constants, num_warps=8, enable_fp_fusion=False)
    assert "fma.rn.f32" not in code
    # The same kernel built as Triton builds by default fuses them: the check can tell.
    fused = ptx(triton_norm._rms_norm_kernel, constants, num_warps=8)
    assert "fma.rn.f32" in fused


# The key passes; a window layer's one tile; scores kept in the pool.
@pytest.mark.parametrize(("one_tile", "scores_pool"), [(0, False), (128, False), (0, True)])
@pytest.mark.parametrize("reciprocal", [False, True])
def test_sink_attention_divides_as_ieee(one_tile, scores_pool, reciprocal):
    """Each probability is ``exp / sum`` correctly rounded, as torch's softmax divides,
    not the approximate division Triton emits for ``/``: an IEEE division, or (``reciprocal``)
    the row's IEEE reciprocal and the fused multiply-adds of Markstein's correction."""
    constants = {
        "GROUP": 8, "BLOCK_Q": 2, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 64, "BLOCK_D": 64,
        "BLOCK_SIZE": 16, "NUM_SPLITS": 1, "DECODE_CLASS": True, "USE_WINDOW": True,
        "DOT_PRECISION": "tf32", "HAS_SINKS": True, "PRECISE_EXP": True, "ONE_TILE": one_tile,
        "SCORES_POOL": scores_pool, "RECIPROCAL": reciprocal,
    }  # fmt: skip
    code = ptx(triton_attention._paged_attention_kernel, constants, num_warps=4, num_stages=2)
    assert "div.rn.f32" in code
    assert not re.search(r"div\.(full|approx)|rcp\.approx", code)
    if reciprocal:
        assert "fma.rn.f32" in code


def test_bf16_rounding_is_a_conversion_and_a_mask_an_element():
    """``round_to_bf16`` compiled is the conversion instruction (``cvt.rn.bf16x2.f32``, which
    nothing folds, as the compiler folds a cast down and back up) and a mask: two
    instructions an element where the bit arithmetic took five or six."""
    from test_triton_rounding import _round_kernel

    block, warps = 1024, 4
    pointers = {"x_ptr": "*fp32", "out_ptr": "*fp32"}
    compiled = compile_h200(
        _round_kernel,
        lambda name: pointers.get(name, "i32"),
        {"DTYPE": tl.bfloat16, "BLOCK": block},
        ["x_ptr", "out_ptr", "n"],
        num_warps=warps,
    )
    ops = [opcode(i) for _, i in sass(compiled)]
    per_thread = block // (32 * warps)
    assert sum(op.startswith("F2FP.BF16") for op in ops) == per_thread
    # One mask an element, and a couple of integer operations for the addresses.
    integer = ("LOP3", "IADD3", "SHF", "SGXT", "IMAD.SHL", "IMAD.U32")
    assert sum(op.startswith(integer) for op in ops) <= per_thread + 3


def _ttgir_and_ptx(fn, pointers: dict, constants: dict, num_warps: int) -> tuple[str, str]:
    """As a launch specialises them: pointers and every int multiple of 16 (as the strides
    and widths of these cases are); no FMA contraction, as the norm kernels launch."""
    float32 = FLOAT32_SCALARS | {"q_eps", "k_eps"}

    def kind(name: str) -> str:
        return pointers.get(name, "fp32" if name in float32 else "i32")

    aligned = [n for n in fn.arg_names if n not in constants and kind(n) != "fp32"]
    out = compile_h200(fn, kind, constants, aligned, num_warps=num_warps, enable_fp_fusion=False)
    return out.asm["ttgir"], out.asm["ptx"]


def _reduce_layouts(ttgir: str) -> set[str]:
    """The layouts the kernel's reductions run over (the order of a sum follows the layout)."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    found = re.findall(r'"tt\.reduce"\(%[^)]*\).*?\}\) : \(tensor<\w+, (#\w+)>', ttgir, re.S)
    return {aliases[a] for a in found}


@pytest.mark.parametrize(("block", "warps"), [(128, 1), (2048, 8)])
def test_fused_norm_kernels_reduce_as_rms_norm_and_fuse_no_fma(block, warps):
    """The fused kernels' norms must give ``_rms_norm_kernel``'s bits: their sums run over
    the same layout (so in the same order) and no product fuses into an add."""
    from moetrace.kernels import triton_qkv, triton_residual

    bf16 = {
        n: "*bf16"
        for n in (
            "x_ptr", "w_ptr", "out_ptr", "extra_ptr", "res_ptr", "res_out_ptr", "qkv_ptr",
            "cos_ptr", "sin_ptr", "q_weight_ptr", "k_weight_ptr", "q_out_ptr", "k_cache_ptr",
            "v_cache_ptr",
        )
    }  # fmt: skip
    bf16["slot_ptr"] = "*i64"
    norm, _ = _ttgir_and_ptx(
        triton_norm._rms_norm_kernel, bf16, {"BLOCK_D": block, "WEIGHT_IN_FLOAT32": False}, warps
    )
    want = _reduce_layouts(norm)
    assert len(want) == 1
    add = {"BLOCK_D": block, "ROWS": 8, "HAS_EXTRA": True, "STORE_RESIDUAL": True}
    add_ir, add_ptx = _ttgir_and_ptx(
        triton_residual._add_rms_norm_kernel, bf16, {**add, "WEIGHT_IN_FLOAT32": False}, warps
    )
    gpt_oss_ir, gpt_oss_ptx = _ttgir_and_ptx(
        triton_residual._add_rms_norm_kernel, bf16, {**add, "WEIGHT_IN_FLOAT32": True}, warps
    )
    heads = block // 128
    qkv = {
        "NUM_HEADS": max(heads, 4), "NUM_KV_HEADS": heads if heads > 1 else 2, "HEAD_DIM": 128,
        "GROUP": heads, "NORM": True, "PER_HEAD": False, "BLOCK_N": block, "BLOCK_G": heads,
        "BLOCK_HALF": 64, "BLOCK_D": 128, "BLOCK_SIZE": 16,
    }  # fmt: skip
    qkv_ir, qkv_ptx = _ttgir_and_ptx(triton_qkv._qkv_rope_store_kernel, bf16, qkv, warps)
    assert _reduce_layouts(add_ir) == want and _reduce_layouts(qkv_ir) == want
    assert _reduce_layouts(gpt_oss_ir) == want
    ptxs = [add_ptx, gpt_oss_ptx, qkv_ptx]
    if block == 128:  # a head's norm, four heads a program (Qwen3's): each head's row as one
        per_head = {**qkv, "NUM_HEADS": 8, "NUM_KV_HEADS": 4, "GROUP": 4, "BLOCK_G": 4}
        per_head["PER_HEAD"] = True
        head_ir, head_ptx = _ttgir_and_ptx(triton_qkv._qkv_rope_store_kernel, bf16, per_head, warps)
        assert _reduce_layouts(head_ir) == want
        ptxs.append(head_ptx)
    assert all("fma.rn.f32" not in ptx for ptx in ptxs)


def _build_cases():
    """Every kernel that rounds to bfloat16 and no other test builds, as a launch types it."""
    from moetrace.kernels import triton_moe, triton_routing

    tables = ("block_expert_ids_ptr", "num_rows_padded_ptr", "block_slots_ptr", "block_rows_ptr")
    int32 = {
        n: "*i32" for n in ("sorted_pair_ids_ptr", "ids_ptr", "work_ptr", "table_ptr", *tables)
    }
    int32.update({f"loaded_{n.split('_', 1)[1]}": "*i32" for n in tables})
    floats = {"weights_f32_ptr": "*fp32", "topk_weights_ptr": "*fp32", "s_ptr": "*u8"}
    experts = dict(
        HAS_BIAS=True, MXFP4=False, MX_NATIVE=False, A_FORMAT="bf16", BLOCK_M=32, BLOCK_N=64,
        BLOCK_K=64, GROUP_M=8, EVEN_K=True, PAIR_TABLE=True,
    )  # fmt: skip
    sinks = {
        "GROUP": 8, "BLOCK_Q": 8, "BLOCK_M": 64, "BLOCK_N": 64, "HEAD_DIM": 64, "BLOCK_D": 64,
        "BLOCK_SIZE": 16, "NUM_SPLITS": 1, "DECODE_CLASS": False, "USE_WINDOW": True,
        "DOT_PRECISION": "tf32", "HAS_SINKS": True, "PRECISE_EXP": True,
    }  # fmt: skip
    split = {**sinks, "DECODE_CLASS": True, "NUM_SPLITS": 2, "BLOCK_M": 16, "BLOCK_Q": 1}
    routing = dict(
        TOP_K=8, K_P2=8, EXPERTS_P2=128, ROWS=1, SCORING=0, RENORMALIZE=True, SCALE=False,
        CAPTURE=True, CAPTURE_WEIGHTS=True, LIBDEVICE=True, WARP=32, K_WARP=8, ALIGN=True,
        BLOCK_M=32,
    )  # fmt: skip
    return {
        "routing": (
            triton_routing._route_kernel,
            {**int32, **floats, "capture_ptr": "*i16"},
            routing,
            1,
        ),
        "experts gate/up (gpt-oss, bf16)": (
            triton_moe._gate_up_kernel,
            {**int32, **floats},
            dict(TOP_K=4, ACTIVATION="clamped_swiglu", INTERLEAVED=True, **experts),
            4,
        ),
        "experts down (bias)": (triton_moe._down_kernel, {**int32, **floats}, experts, 4),
        "rotary": (
            triton_norm._rotary_kernel,
            {"cos_ptr": "*fp32", "sin_ptr": "*fp32"},
            dict(HALF=64, BLOCK_H=32, BLOCK_HALF=64),
            4,
        ),
        "attention prefill, sinks": (triton_attention._paged_attention_kernel, None, sinks, 4),
        "attention split decode, sinks": (triton_attention._paged_attention_kernel, None, split, 4),
    }


@pytest.mark.parametrize("case", list(_build_cases()))
def test_every_kernel_that_rounds_builds_with_the_conversion(case):
    """The rounding's inline assembly builds inside each kernel that rounds to bfloat16 (the
    interpreter never runs it, so only a build shows a kernel that would not compile).
    Pointers are bf16 but where named (``None``: the attention kernel's own types)."""
    fn, pointers, constants, warps = _build_cases()[case]
    float32 = FLOAT32_SCALARS | {"scaling", "swiglu_alpha", "swiglu_limit"}

    def kind(name: str) -> str:
        if pointers is None:
            return sixteen_bit_kind(name)
        if name in pointers:
            return pointers[name]
        if name.endswith("_ptr"):
            return "*bf16"
        return "fp32" if name in float32 else "i32"

    compiled = compile_h200(fn, kind, constants, num_warps=warps, num_stages=2)
    assert "cvt.rn.bf16x2.f32" in compiled.asm["ptx"]
