"""The decode attention tile as Triton compiles it for the H200, checked without a GPU.

Qwen3-30B-A3B's decode attention at batch 256 is 1,024 programs (sequences x KV
heads).  Its tile (``triton_attention._tile_configs``) is chosen so that eight
fit a multiprocessor and the launch runs in one wave of the H200's 132, not
two (docs/benchmarks.md).  That rests on the compiled kernel's registers and
shared memory, which a change to the kernel can move without changing a
result: this compiles the tile and checks the fit.  Runs wherever Triton is
installed.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the H200: the interpreter stands in for jit", allow_module_level=True)

from support.h200_compile import (  # noqa: E402
    compile_h200,
    opcode,
    ptxas_notes,
    sass,
    sass_loops,
    sixteen_bit_kind,
)

from moetrace.kernels import triton_attention  # noqa: E402

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024  # what the driver keeps back for each resident block
SPILL_BYTES_ALLOWED = 64  # a few values to L1-cached local memory: measured as no loss
LOCAL_ACCESSES = ("LDL", "STL")  # the opcodes of spill loads and stores
# Sizes Triton specialises as multiples of 16 in a batch-256 launch: the pointers and
# the strides (Qwen3's heads of 128, KV blocks of 16).
ALIGNED_SCALARS = {"num_heads", "num_seqs"}


def compile_decode(
    group: int,
    head_dim: int,
    cfg=None,
    block_size: int = 16,
    sinks: bool = False,
    reciprocal: bool = False,
    keep_exps: bool = False,
):
    """The decode class of ``_paged_attention_kernel`` at ``cfg`` (by default the tile
    ``_tile_configs`` picks at batch 256) for ``group`` heads of ``head_dim`` (no window,
    one key split; ``sinks``: a full layer's sinks through the scores pool, its softmax
    by the ``reciprocal`` and with the exponentials kept, ``keep_exps``, as asked)."""
    cfg = cfg or triton_attention._tile_configs(group, head_dim, sinks, 256 * 4, 132)[0]
    fn = triton_attention._paged_attention_kernel
    constants = {
        "GROUP": group, "BLOCK_Q": cfg.block_m // (group * cfg.pack), "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "HEAD_DIM": head_dim, "BLOCK_D": head_dim * cfg.pack,
        "BLOCK_SIZE": block_size, "NUM_SPLITS": 1, "DECODE_CLASS": True, "USE_WINDOW": False,
        "DOT_PRECISION": "tf32", "HAS_SINKS": sinks, "PRECISE_EXP": True, "HEADS_FAST": True,
        "ONE_TILE": 0, "SCORES_POOL": sinks, "PACK": cfg.pack, "RECIPROCAL": reciprocal,
        "KEEP_EXPS": keep_exps,
    }  # fmt: skip
    aligned = [
        n
        for n in fn.arg_names
        if n not in constants
        and (n.endswith("_ptr") or n.startswith("stride") or n in ALIGNED_SCALARS)
    ]
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg is not None:
        options["maxnreg"] = cfg.maxnreg

    def kind(name: str) -> str:
        return "*fp32" if name == "scores_ptr" and keep_exps else sixteen_bit_kind(name)

    return cfg, compile_h200(fn, kind, constants, aligned, **options)


def ptxas_usage(compiled) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) that ptxas reports for the kernel's PTX."""
    notes = ptxas_notes(compiled)
    registers = int(re.search(r"Used (\d+) registers", notes).group(1))
    spills = re.search(r"(\d+) bytes spill stores", notes)
    return registers, int(spills.group(1)) if spills else 0


def resident_programs(registers: int, threads: int, shared: int) -> int:
    """Programs of one kernel a multiprocessor holds at once, by registers and shared memory."""
    by_registers = REGISTERS_PER_SM // (registers * threads)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED_PER_PROGRAM)
    return min(by_registers, by_shared)


def test_qwen3_decode_attention_fits_one_wave_at_batch_256():
    """Eight programs a multiprocessor: 1,024 programs in the H200's 1,056 places."""
    cfg, compiled = compile_decode(group=8, head_dim=128)
    registers, spills = ptxas_usage(compiled)
    shared = compiled.metadata.shared
    resident = resident_programs(registers, 32 * cfg.num_warps, shared)
    assert resident * 132 >= 256 * 4, (registers, shared, resident)
    assert spills <= SPILL_BYTES_ALLOWED, f"{spills} bytes spilled"
    # A spill is cheap only outside the key loop: paid once a program, not once a tile.
    assert loop_ops(compiled, LOCAL_ACCESSES) == 0


def test_the_loop_check_tells_spills_in_the_loop():
    """Eight registers fewer than the tile's cap, and the spills reach the key loop (seven
    local accesses a tile compiled with Triton 3.6): the check above can fail."""
    capped = triton_attention._tile_configs(8, 128, False, 256 * 4, 132)[0]
    _, compiled = compile_decode(8, 128, capped._replace(maxnreg=capped.maxnreg - 8))
    assert loop_ops(compiled, LOCAL_ACCESSES) > 0


def test_the_check_tells_the_uncapped_tile_apart():
    """The same kernel on the 64-key tile without a cap (the tile before) fits fewer than
    eight (four when the cap was chosen, five since the block arithmetic went unsigned),
    so the check above is not true of any tile."""
    capped = triton_attention._tile_configs(8, 128, False, 256 * 4, 132)[0]
    wide, compiled = compile_decode(8, 128, capped._replace(block_n=64, maxnreg=None))
    registers, _ = ptxas_usage(compiled)
    assert resident_programs(registers, 32 * wide.num_warps, compiled.metadata.shared) < 8


def loop_instructions(compiled, first_loops: int | None = None) -> int:
    """Instructions in the kernel's loops (16 bytes each), or in its ``first_loops``: one pass
    of each over a key tile."""
    loops = sass_loops(sass(compiled))[:first_loops]
    return sum((last - first) // 16 + 1 for first, last in loops)


def test_packed_kv_heads_cut_the_sink_loops_per_head():
    """gpt-oss-20b's decode tile (8 heads of 64 a KV head, sinks) spends its key loops'
    instructions on 16 rows, 8 of them padding.  Two KV heads a program fill the rows:
    the loops then take at most three quarters of the instructions a head (35% fewer
    compiled for sm_90a), without spills, and four programs still fit a multiprocessor,
    so half as many programs need no more waves."""
    single_cfg = triton_attention._tile_configs(8, 64, True, 256 * 8, 132)[0]
    single_cfg = single_cfg._replace(pack=1)
    _, single = compile_decode(8, 64, single_cfg, sinks=True)
    packed_cfg, packed = compile_decode(8, 64, single_cfg._replace(pack=2), sinks=True)
    per_head_single = loop_instructions(single) / 8
    per_head_packed = loop_instructions(packed) / 16
    assert per_head_packed < 0.75 * per_head_single, (per_head_packed, per_head_single)
    registers, spills = ptxas_usage(packed)
    assert spills == 0
    resident = resident_programs(registers, 32 * packed_cfg.num_warps, packed.metadata.shared)
    assert resident >= 4, (registers, packed.metadata.shared)


def loop_ops(compiled, op: str | tuple[str, ...]) -> int:
    """How many of the kernel's loop instructions are ``op`` (or any of several; predicated
    or not)."""
    ins = sass(compiled)
    return sum(
        1
        for first, last in sass_loops(ins)
        for addr, i in ins
        if first <= addr <= last and opcode(i).startswith(op)
    )


def pool_loop_instructions(compiled) -> int:
    """Instructions in the scores pool's three key loops: the pool's branch comes first in
    the kernel, and its loops first in the code."""
    return loop_instructions(compiled, first_loops=3)


def test_the_faster_sink_softmax_leaves_its_loops_no_division_and_one_exp_fewer():
    """gpt-oss-20b's packed decode tile with the sinks' softmax by each row's reciprocal
    and the exponentials kept in the pool: no per-key reciprocal (the IEEE division's)
    left in any key loop, the pool's values loop computing no exponential, the pool's
    loops at most 85% of their instructions (80% compiled with Triton 3.6), and no more
    registers: five programs a multiprocessor, as for the plain softmax."""
    cfg = triton_attention._tile_configs(8, 64, True, 256 * 8, 132)[0]._replace(pack=2)
    _, plain = compile_decode(8, 64, cfg, sinks=True)
    _, faster = compile_decode(8, 64, cfg, sinks=True, reciprocal=True, keep_exps=True)
    assert loop_ops(plain, "MUFU.RCP") > 0
    assert loop_ops(faster, "MUFU.RCP") == 0
    assert loop_ops(faster, "MUFU.EX2") < loop_ops(plain, "MUFU.EX2")
    assert pool_loop_instructions(faster) <= 0.85 * pool_loop_instructions(plain)
    registers, spills = ptxas_usage(faster)
    assert spills == 0
    resident = resident_programs(registers, 32 * cfg.num_warps, faster.metadata.shared)
    assert resident >= 5, (registers, faster.metadata.shared)
