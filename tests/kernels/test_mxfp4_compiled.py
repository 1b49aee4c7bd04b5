"""The fragment-layout MXFP4 GEMMs as Triton compiles them for the H200, checked without a GPU.

What makes them fast shows only in the compiled code: the decoded weights must
reach the tensor-core product straight from registers (no shared-memory round
trip, no layout conversion in the K loop), the word and scale loads must be
asynchronous copies the pipeline prefetches, and the decoder must be the PTX
block.  The interpreter never runs that block, so compiling it here is also
what catches a kernel that would not build.  Runs wherever Triton is installed.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the H200: the interpreter stands in for jit", allow_module_level=True)

from support.h200_compile import compile_h200, opcode, ptxas_notes, sass, sass_loops  # noqa: E402

from moetrace.kernels import triton_moe  # noqa: E402

INT_POINTERS = {
    "sorted_pair_ids_ptr",
    "block_expert_ids_ptr",
    "num_rows_padded_ptr",
    "block_slots_ptr",
    "block_rows_ptr",
}
UNALIGNED = {"num_pairs", "num_m_blocks"}  # not specialised (do_not_specialize)


def _gpt_oss_kind(name: str) -> str:
    if name in INT_POINTERS:
        return "*i32"
    if name in ("w_ptr", "s_ptr"):
        return "*u8"
    if name == "topk_weights_ptr":
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name.startswith("swiglu") else "i32"


def compile_gpt_oss(fn, constants: dict, **options):
    """``fn`` for the H200 with gpt-oss's arguments: bf16 activations, MXFP4 bytes, float32
    routing weights; integers divisible by 16 as gpt-oss-20b's sizes and strides are."""
    aligned = [
        n
        for n in fn.arg_names
        if n not in constants and n not in UNALIGNED and not n.startswith("swiglu")
    ]
    return compile_h200(fn, _gpt_oss_kind, constants, aligned, **options)


TILE = dict(
    FAST=True, PRECISION="tf32", BLOCK_M=64, BLOCK_K=128, GROUP_M=8, EVEN_K=False, FULL_STEP=True,
    PAIR_TABLE=False, BLOCK_PARTS=1, PART=0,
)  # fmt: skip
KERNELS = {
    "gate_up": (
        triton_moe._gate_up_fragment_kernel,
        dict(TOP_K=4, ACTIVATION="clamped_swiglu", HAS_BIAS=True, BLOCK_N=64, **TILE),
    ),
    "down": (triton_moe._down_fragment_kernel, dict(HAS_BIAS=True, BLOCK_N=128, **TILE)),
}


def main_loop(ttgir: str) -> str:
    """The body of the first ``scf.for`` (the pipelined K loop)."""
    start = ttgir.index("scf.for")
    return ttgir[start : ttgir.index("scf.yield", start)]


def sass_loop(compiled) -> list[str]:
    """Opcodes of the longest backward-branch range of the SASS: the K loop."""
    ins = sass(compiled)
    lo, hi = max(sass_loops(ins), key=lambda r: r[1] - r[0])
    return [opcode(i) for a, i in ins if lo <= a <= hi]


@pytest.fixture(scope="module", params=list(KERNELS))
def compiled(request):
    fn, constants = KERNELS[request.param]
    return compile_gpt_oss(fn, constants, num_warps=4, num_stages=4)


def test_decoded_weights_feed_the_product_from_registers(compiled):
    loop = main_loop(compiled.asm["ttgir"])
    dots = re.findall(r"ttng\.warp_group_dot %\S+, %\S+, .*? : (tensor<[^>]*>>) \*", loop)
    assert dots, "no tensor-core product in the K loop"
    assert all("dot_op<{opIdx = 0" in d for d in dots), dots  # left operand in registers
    assert "ttg.local_alloc" not in loop  # nothing decoded is stored for the product
    # The joins and reshapes only relabel registers: no shared-memory stores or shuffles
    # in the loop (its copies are asynchronous, LDGSTS), and the whole loop stays near
    # the decoder's 15 instructions per 8 values (3.5 a value on this tile; the
    # checkpoint layout's bit decoder took 8.9).
    ops = sass_loop(compiled)
    assert not [o for o in ops if o.startswith(("STS", "SHFL"))], ops
    assert ops.count("HMUL2.BF16_V2") == 64  # 4 a word, 16 words a thread
    values = 128 * 128 // 128  # 128 weight rows x 128 values per step over 128 threads
    assert len(ops) / values < 4.0, len(ops)


def test_words_and_scales_are_prefetched(compiled):
    loop = main_loop(compiled.asm["ttgir"])
    copies = re.findall(r"async_copy_global_to_local %\S+, %\S+ .*?: (tensor<[^>]*>)", loop)
    kinds = " ".join(copies)
    for what in ("!tt.ptr<i32>", "!tt.ptr<i8>", "!tt.ptr<bf16>"):  # words, scales, activations
        assert what in kinds, (what, copies)
    assert "tt.load" not in loop  # no synchronous load left in the loop


def test_the_fast_decoder_is_the_ptx_block(compiled):
    ptx = compiled.asm["ptx"]
    assert "mul.rn.bf16x2" in ptx
    assert ptx.count("and.b32") >= 4


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("block_m", [32, 64])  # the decode tile's token block, and the test's
@pytest.mark.parametrize("pair_table", [False, True])  # sorted pairs, or the routing's table
def test_products_stay_in_flight_while_the_next_words_decode(name, block_m, pair_table):
    """ptxas must not serialize the loop's asynchronous products (its note C7515): each
    would then wait for the last to finish, and no decoding would overlap the tensor cores."""
    fn, constants = KERNELS[name]
    constants = {**constants, "BLOCK_M": block_m, "PAIR_TABLE": pair_table}
    compiled = compile_gpt_oss(fn, constants, num_warps=4, num_stages=3)
    assert "C7515" not in ptxas_notes(compiled)
    ops = sass_loop(compiled)
    products = sum(o.startswith("HGMMA") for o in ops)
    waits = sum(o.startswith("WARPGROUP.DEPBAR") for o in ops)
    assert products and waits < products, (products, waits)
