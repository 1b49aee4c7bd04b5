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
import subprocess

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the H200: the interpreter stands in for jit", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moetrace.kernels import triton_attention  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024  # what the driver keeps back for each resident block
SPILL_BYTES_ALLOWED = 64  # a few values to L1-cached local memory: measured as no loss
INT32_POINTERS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "bt_stride_ptr"}
FLOAT32_POINTERS = {"part_acc_ptr", "part_ml_ptr"}
# Sizes Triton specialises as multiples of 16 in a batch-256 launch: the pointers and
# the strides (Qwen3's heads of 128, KV blocks of 16).
ALIGNED_SCALARS = {"num_heads", "num_seqs"}


def compile_decode(group: int, head_dim: int, cfg=None, block_size: int = 16):
    """The decode class of ``_paged_attention_kernel`` at ``cfg`` (by default the tile
    ``_tile_configs`` picks at batch 256) for ``group`` heads of ``head_dim`` (no sinks,
    no window, one key split)."""
    cfg = cfg or triton_attention._tile_configs(group, head_dim, False, 1)[0]
    fn = triton_attention._paged_attention_kernel
    constants = {
        "GROUP": group, "BLOCK_Q": cfg.block_m // group, "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "HEAD_DIM": head_dim, "BLOCK_D": head_dim,
        "BLOCK_SIZE": block_size, "NUM_SPLITS": 1, "DECODE_CLASS": True, "USE_WINDOW": False,
        "DOT_PRECISION": "tf32", "HAS_SINKS": False, "PRECISE_EXP": True, "HEADS_FAST": True,
        "ONE_TILE": 0, "SCORES_POOL": False,
    }  # fmt: skip
    names = fn.arg_names

    def kind(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in INT32_POINTERS:
            return "*i32"
        if name in FLOAT32_POINTERS:
            return "*fp32"
        if name == "pool_ends_ptr":
            return "*i64"
        if name.endswith("_ptr"):
            return "*bf16"
        return "fp32" if name == "score_scale" else "i32"

    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constants
        and (n.endswith("_ptr") or n.startswith("stride") or n in ALIGNED_SCALARS)
    }
    source = ASTSource(fn, {n: kind(n) for n in names}, constants, aligned)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg is not None:
        options["maxnreg"] = cfg.maxnreg
    return cfg, triton.compile(source, target=H200, options=options)


def ptxas_usage(compiled) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) that ptxas reports for the kernel's PTX."""
    path = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        pytest.skip("this Triton has no ptxas")
    base = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moetrace-attn-{os.getpid()}")
    with open(base + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    try:
        args = [path, "--gpu-name", "sm_90a", "-v", base + ".ptx", "-o", base + ".o"]
        notes = subprocess.run(args, capture_output=True, text=True, check=True).stderr
    finally:
        for ext in (".ptx", ".o"):
            if os.path.exists(base + ext):
                os.unlink(base + ext)
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


def test_the_check_tells_the_uncapped_tile_apart():
    """The same kernel on the 64-key tile without a cap (the tile before) fits four, so the
    check above is not true of any tile."""
    capped = triton_attention._tile_configs(8, 128, False, 1)[0]
    wide, compiled = compile_decode(8, 128, capped._replace(block_n=64, maxnreg=None))
    registers, _ = ptxas_usage(compiled)
    assert resident_programs(registers, 32 * wide.num_warps, compiled.metadata.shared) == 4
