"""The warp-specialized MXFP4 GEMMs of ``benchmarks/mxfp4_ws.py``, compiled for the H200 on the CPU.

That benchmark measures a design before engine code depends on it
(docs/benchmarks.md), so nothing else would notice if a Triton update broke
it.  What its figures rest on shows in the compiled code: the decoded words
reach the products straight from registers (the layout conversions are
asserted trivial inside the kernel, so a build is that check), ptxas keeps the
products in flight (no serialization note), and two programs fit a
multiprocessor (the register cap, the warpgroup's register share, shared
memory).  Runs wherever Triton with Gluon is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the H200: the interpreter stands in for jit", allow_module_level=True)

import torch  # noqa: E402
from support.h200_compile import H200, ptxas_notes  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

# benchmarks/ on the path only while importing: left there, its kernels.py would shadow
# the `kernels` package that transformers imports, for every later test in the worker.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
try:
    import mxfp4_ws  # noqa: E402
finally:
    del sys.path[0]

INT_POINTERS = {"sorted_pair_ids_ptr", "block_expert_ids_ptr", "num_rows_padded_ptr"}
MAXNREG = 128  # what the benchmark launches with
SHARED_PER_SM = 227 * 1024


def _compiled(gate_up: bool, block_m: int, ablate: int = 0):
    """One of the two GEMMs at gpt-oss-20b's widths, as the benchmark launches it."""
    rows, k = (5760 if gate_up else 2880), 2880
    words = torch.zeros(2, rows, k // 2, dtype=torch.uint8)
    scales = torch.zeros(2, k // 128 + 1, rows, 4, dtype=torch.uint8)
    tokens = torch.zeros(256, k, dtype=torch.bfloat16)
    w_desc, wt_desc = mxfp4_ws._words_descs(words, 128)
    descs = {
        "w_desc": w_desc,
        "wt_desc": wt_desc,
        "s_desc": mxfp4_ws._scales_desc(scales, 128),
        "x_desc": mxfp4_ws._tokens_desc(tokens, block_m),
    }
    constants = {
        "GATE_UP": gate_up,
        "BLOCK_M": block_m,
        "GROUP_M": 8,
        "HAS_BIAS": True,
        "STAGES": 4,
        "ABLATE": ablate,
        "num_warps": 4,
    }
    fn = mxfp4_ws._experts_kernel
    signature, constexprs = {}, {}
    for name in fn.arg_names:
        if name in descs:
            signature[name] = mangle_type(descs[name])
        elif name in constants:
            signature[name] = "constexpr"
            constexprs[(fn.arg_names.index(name),)] = constants[name]
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INT_POINTERS else "*bf16"
        else:
            signature[name] = "fp32" if name.startswith("swiglu") else "i32"
    source = GluonASTSource(fn, signature, constexprs, {})
    return triton.compile(source, target=H200, options={"num_warps": 4, "maxnreg": MAXNREG})


@pytest.mark.parametrize("gate_up", [True, False], ids=["gate_up", "down"])
@pytest.mark.parametrize("block_m", [32, 64])
def test_products_stay_in_flight_and_two_programs_fit(gate_up: bool, block_m: int) -> None:
    compiled = _compiled(gate_up, block_m)
    notes = ptxas_notes(compiled)
    assert "serialized" not in notes, notes  # C7511/C7512: wgmma waits for each product
    assert "0 bytes spill stores" in notes, notes
    ptx = compiled.asm["ptx"]
    # The decoding warpgroup takes 232 registers a thread, the copy warp's 40, within the
    # cap of 128 that leaves room for a second program.
    assert "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t40" in ptx
    assert 2 * 8 * 32 * MAXNREG <= 65536
    assert 2 * compiled.metadata.shared <= SHARED_PER_SM


def test_the_ablations_build() -> None:
    for ablate in (mxfp4_ws.COPIES_ONLY.value, mxfp4_ws.PRODUCTS_ONLY.value):
        assert "serialized" not in ptxas_notes(_compiled(True, 32, ablate))
