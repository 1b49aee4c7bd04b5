"""The bfloat16 rounding as Triton compiles it for the H200, checked without a GPU.

``triton_rounding.round_to_bf16`` rounds by the conversion instruction, as
inline assembly: a cast down and back up is folded away by the compiler, so
the kernels used to round on the bits, five or six integer operations an
element in loops that are bound by their instructions (gpt-oss's attention).
This compiles a kernel that only rounds and counts what each element takes.
Runs wherever Triton is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the H200: the interpreter stands in for jit", allow_module_level=True)

import triton.language as tl  # noqa: E402
from h200_compile_helpers import compile_h200, sass  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_triton_rounding import _round_kernel  # noqa: E402

INTEGER_OPS = ("LOP3", "IADD3", "SHF", "SGXT", "IMAD.SHL", "IMAD.U32")


def test_bf16_rounding_is_a_conversion_and_a_mask_an_element():
    block, warps = 1024, 4
    pointers = {"x_ptr": "*fp32", "out_ptr": "*fp32"}
    compiled = compile_h200(
        _round_kernel,
        lambda name: pointers.get(name, "i32"),
        {"DTYPE": tl.bfloat16, "BLOCK": block},
        ["x_ptr", "out_ptr", "n"],
        num_warps=warps,
    )
    ops = [i.lstrip("@!P0123456789T ").split()[0] for _, i in sass(compiled)]
    per_thread = block // (32 * warps)
    assert sum(op.startswith("F2FP.BF16") for op in ops) == per_thread
    # One mask an element, and a couple of integer operations for the addresses.
    assert sum(op.startswith(INTEGER_OPS) for op in ops) <= per_thread + 3
