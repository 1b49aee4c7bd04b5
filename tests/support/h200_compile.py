"""Kernels compiled for the H200 on the CPU, for the tests that read the compiled code.

Triton builds for a named GPU without one, so the ``*_compiled`` tests check
registers, spills and instructions wherever Triton is installed.  Import this
after ``pytest.importorskip("triton")``.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Collection

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)

# Pointer arguments of the attention kernels that are not 16-bit tensors, and the
# float32 scalars of the attention and norm kernels (every other scalar an int32).
FLOAT32_POINTERS = {"part_acc_ptr", "part_ml_ptr"}
INT32_POINTERS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "bt_stride_ptr"}
INT64_POINTERS = {"pool_ends_ptr"}
FLOAT32_SCALARS = {"eps", "inv_dim", "score_scale"}


def sixteen_bit_kind(name: str) -> str:
    """An attention or norm kernel argument's type: 16-bit tensors, int32 scalars but for the
    pointers and scalars named above."""
    if name in FLOAT32_POINTERS:
        return "*fp32"
    if name in INT32_POINTERS:
        return "*i32"
    if name in INT64_POINTERS:
        return "*i64"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in FLOAT32_SCALARS else "i32"


def compile_h200(
    fn,
    kind: Callable[[str], str],
    constants: dict,
    aligned: Collection[str] = (),
    **options,
):
    """``fn`` built for the H200: each argument typed by ``kind(name)`` but the ``constants``
    (compile-time arguments not given take their defaults, as at a launch), and those
    named in ``aligned`` specialised as multiples of 16, as Triton specialises such
    values when it launches a kernel."""
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constants = {**defaults, **constants}
    names = fn.arg_names
    types = {n: "constexpr" if n in constants else kind(n) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn, types, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(source, target=H200, options=options)


def tool(name: str) -> str:
    """The path of one of the CUDA tools Triton ships (``ptxas``, ``cuobjdump``)."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        pytest.skip(f"this Triton has no {name}")
    return path


def ptxas_notes(compiled) -> str:
    """What ptxas says (``-v``) compiling the kernel's PTX for the H200."""
    base = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moetrace-{os.getpid()}")
    with open(base + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    try:
        args = [tool("ptxas"), "--gpu-name", "sm_90a", "-v", base + ".ptx", "-o", base + ".o"]
        return subprocess.run(args, capture_output=True, text=True, check=True).stderr
    finally:
        for ext in (".ptx", ".o"):
            if os.path.exists(base + ext):
                os.unlink(base + ext)


def sass(compiled) -> list[tuple[int, str]]:
    """The kernel's SASS (``cuobjdump -sass``) as (address, instruction) pairs."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moetrace-{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run(
            [tool("cuobjdump"), "-sass", path], capture_output=True, text=True
        ).stdout
    finally:
        os.unlink(path)
    return [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", text)]


def opcode(instruction: str) -> str:
    """A SASS instruction's opcode, without its predicate (``@P0``, ``@!UP1``, ``@PT``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def sass_loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """Each loop of ``sass(...)`` as (first, last) address: the ranges of backward branches,
    in the order their branches come."""
    return [
        (int(m.group(1), 16), addr)
        for addr, i in ins
        if (m := re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", i)) and int(m.group(1), 16) < addr
    ]
