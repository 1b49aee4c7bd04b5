"""The fused small kernels against the unfused sequences they replace, bit for bit.

``kernels/triton_residual.py`` (top-k sum, residual add, RMSNorm) and
``kernels/triton_qkv.py`` (q/k norm, rotary, KV store) on fresh random
inputs: odd head counts and widths, strided views, token counts that are not
a multiple of any block, a poisoned cache.  Then whole tiny models on the
kernel path, fused against unfused.  The real shapes run in
``test_gpu_fused_small.py``.

Needs CUDA, or ``TRITON_INTERPRET=1`` on the CPU.  The interpreter's cast to
bfloat16 truncates, so the norm kernel the references run is only faithful
there in float16: interpreted runs compare norms in float16 (bfloat16 where
no norm is involved); CUDA runs compare both.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support.fused_reference import (  # noqa: E402
    Counted,
    QKVCase,
    fixed_order_sum,
    residual_inputs,
    same_bits,
    two_steps,
    unfused_add_norm,
)
from support.triton import DEVICE, INTERPRET, KERNEL_TEST_MARKS  # noqa: E402

from moetrace.kernels.triton_residual import add_rms_norm  # noqa: E402

pytestmark = KERNEL_TEST_MARKS
# Dtypes whose norm the interpreter computes as the GPU does (see the module doc).
NORM_DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


# --------------------------------------------------------------- add + norm
@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hidden", "top_k", "extra", "strided"),
    [
        (1, 2048, 0, False, False),  # an attention output
        (37, 256, 0, False, True),
        (5, 72, 0, False, False),  # a width that is no power of two
        (37, 128, 8, False, False),  # MoE rows
        (19, 200, 6, True, True),  # rows plus shared experts, strided
        (3, 64, 1, False, False),  # top-1: one row, no sum
        (11, 96, 2, True, False),
        (13, 2880, 4, False, False),  # gpt-oss's width and top-k
    ],
)
@pytest.mark.parametrize("weight_in_float32", [False, True], ids=["weight-after", "weight-fp32"])
def test_add_rms_norm_equals_the_unfused_sequence(
    dtype, tokens, hidden, top_k, extra, strided, weight_in_float32
):
    case = residual_inputs(
        tokens, hidden, top_k, dtype, DEVICE, seed=tokens * 7 + hidden, extra=extra, strided=strided
    )
    ref_out, ref_residual = unfused_add_norm(**case, eps=1e-6, weight_in_float32=weight_in_float32)
    fused = dict(extra=case["extra"], weight_in_float32=weight_in_float32)
    out, residual = add_rms_norm(case["x"], case["residual"], case["weight"], 1e-6, **fused)
    assert out.is_contiguous() and residual.is_contiguous()
    assert same_bits(residual, ref_residual)
    assert same_bits(out, ref_out)
    # The final norm: no residual written, the same normed row.
    alone, none = add_rms_norm(
        case["x"], case["residual"], case["weight"], 1e-6, keep_residual=False, **fused
    )
    assert none is None and same_bits(alone, ref_out)


def test_the_two_weight_roundings_differ():
    """Weighting the rounded row and rounding the float32 product differ in many elements,
    so the test above can tell a kernel that took the wrong one."""
    case = residual_inputs(37, 2880, 4, torch.float16, DEVICE, seed=5)
    case["weight"] = case["weight"] * 1.37  # a weight that is not near one
    after, _ = add_rms_norm(case["x"], case["residual"], case["weight"], 1e-6)
    fp32, _ = add_rms_norm(
        case["x"], case["residual"], case["weight"], 1e-6, weight_in_float32=True
    )
    assert (after != fp32).float().mean() > 0.01


def test_the_top_k_sum_rounds_once():
    """Rounding after each of the k adds (summing in the model dtype) differs from the
    float32 sum rounded once in many elements: the test above can tell them apart."""
    case = residual_inputs(37, 128, 8, torch.float16, DEVICE, seed=3)
    rows = case["x"]
    each = rows[:, 0]
    for j in range(1, rows.shape[1]):
        each = each + rows[:, j]
    once = fixed_order_sum(rows)
    assert (each != once).float().mean() > 0.05
    _, residual = add_rms_norm(rows, case["residual"], case["weight"], 1e-6)
    assert same_bits(residual, case["residual"] + once)


@pytest.mark.skipif(not INTERPRET, reason="the CUDA runs compare bfloat16 norms above")
def test_add_rms_norm_rounds_the_bfloat16_residual_as_torch():
    """Interpreted bfloat16: the residual is torch's add exactly (the norm runs in float16 above)."""
    case = residual_inputs(29, 160, 4, torch.bfloat16, DEVICE, seed=9, extra=True)
    _, residual = add_rms_norm(
        case["x"], case["residual"], case["weight"], 1e-6, extra=case["extra"]
    )
    assert same_bits(residual, case["residual"] + (fixed_order_sum(case["x"]) + case["extra"]))


def test_add_rms_norm_refuses_what_it_does_not_round_like():
    x = torch.zeros(2, 8, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="16-bit"):
        add_rms_norm(x, x, x[0], 1e-6)
    h = x.half()
    with pytest.raises(ValueError, match="does not fit"):
        add_rms_norm(h, h, h[0], 1e-6, extra=h[:1])


# ----------------------------------------------------- q/k norm + rope + store
QKV_SHAPES = [
    # (tokens, q heads, kv heads, head_dim, norm)
    (1, 8, 2, 128, "head"),
    (23, 32, 4, 128, "head"),  # Qwen3-30B-A3B's heads: four a program, each its own norm
    (19, 16, 8, 32, "head"),  # eight a program
    (37, 5, 1, 64, "head"),  # odd head counts
    (13, 3, 3, 24, "head"),  # half a head (12) is no power of two
    (21, 4, 4, 128, "full"),
    (9, 3, 3, 40, "full"),  # norm width 120 in a 128 block
    (17, 6, 2, 128, None),
    (11, 64, 8, 64, None),  # gpt-oss-20b's heads, eight a program
    (7, 7, 7, 16, None),
]


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim", "norm"), QKV_SHAPES)
def test_qkv_rope_store_equals_the_unfused_sequence(dtype, tokens, heads, kv_heads, dim, norm):
    case = QKVCase(tokens, heads, kv_heads, dim, norm, dtype, DEVICE, seed=tokens + 31 * heads)
    ref_q, ref_k, ref_v = case.reference()
    q, k_cache, v_cache = case.fused()
    assert q.is_contiguous() and q.shape == (tokens, heads, dim)
    assert same_bits(q, ref_q)
    # The caches were NaN: equal bits mean the same slots written with the same values, and
    # every other entry (padding tokens' slots included) left alone.
    assert same_bits(k_cache, ref_k) and same_bits(v_cache, ref_v)
    written = case.slots[case.slots >= 0]
    assert not k_cache.view(-1, kv_heads, dim)[written].isnan().any()
    assert k_cache.isnan().sum() == k_cache.numel() - written.numel() * kv_heads * dim


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(37, 5, 1, 64), (9, 4, 2, 128)])
def test_qkv_rope_store_without_norm_in_bfloat16(tokens, heads, kv_heads, dim):
    """bfloat16 without a norm runs everywhere: the rotary kernel's roundings, the store."""
    case = QKVCase(tokens, heads, kv_heads, dim, None, torch.bfloat16, DEVICE, seed=tokens)
    ref = case.reference()
    got = case.fused()
    assert all(same_bits(a, b) for a, b in zip(got, ref, strict=True))


def test_qkv_rope_store_rounds_the_norm_before_the_rotation():
    """Rotating the unrounded normed row (one rounding fewer) differs: the test can tell."""
    case = QKVCase(37, 5, 1, 64, "head", torch.float16, DEVICE, seed=2)
    ref_q, _, _ = case.reference()
    from moetrace.kernels.triton_norm import rms_norm
    from moetrace.layers.rotary import RotaryEmbedding

    q = case.qkv[:, : 5 * 64].reshape(37, 5, 64)
    normed = rms_norm(q.float(), case.q_weight.float(), case.eps).half()  # no 16-bit roundings
    assert not same_bits(RotaryEmbedding.apply(normed, case.cos, case.sin), ref_q)


def test_qkv_rope_store_refuses_shapes_it_does_not_serve():
    from moetrace.kernels.triton_qkv import qkv_rope_store

    case = QKVCase(3, 4, 2, 16, None, torch.float16, DEVICE, seed=1)
    k, v = case.poisoned_caches()
    with pytest.raises(ValueError, match="as many q as kv heads"):
        qkv_rope_store(
            case.qkv, 4, 2, case.cos, case.sin, k, v, case.slots,
            norm="full", q_weight=case.cos[0], k_weight=case.cos[0],
        )  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):
        qkv_rope_store(case.qkv, 4, 1, case.cos, case.sin, k, v, case.slots)
    with pytest.raises(ValueError, match="16-bit"):
        qkv_rope_store(case.qkv.float(), 4, 2, case.cos.float(), case.sin.float(), k, v, case.slots)


# ------------------------------------------------------------- whole models
FAMILIES = {
    "qwen3_moe": {},
    "olmoe": {"num_key_value_heads": 4},  # OLMoE's own shape: its full-width norm fuses so
    "deepseek_v2": {},
    "qwen2_moe": {},
    "mixtral": {},
    "granitemoe": {},
    "gpt_oss": {},
    "phimoe": {},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_model_on_the_kernels_computes_the_same_fused(family, tmp_path, monkeypatch):
    """Every family's forward on the kernels, fused and not: the same hidden states and caches.

    Top-2 routing, so the fused top-k sum (two rows: no order) is torch's too.
    """
    pytest.importorskip("transformers")
    from support.hf_reference import make_tiny_checkpoint

    from moetrace.engine.model_runner import set_kernel_paths
    from moetrace.kernels import triton_qkv, triton_residual
    from moetrace.layers import residual
    from moetrace.models.loader import load_model

    dtype = torch.float16  # the interpreter's float16 norm is the GPU's (module doc)
    ckpt = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=5, dtype=dtype, **FAMILIES[family])
    model = load_model(str(ckpt), device=DEVICE, dtype="float16").model
    set_kernel_paths(model, True)
    monkeypatch.setattr(residual, "FUSED_NORMS", False)
    plain = two_steps(model, dtype, DEVICE)
    monkeypatch.setattr(residual, "FUSED_NORMS", True)
    add = Counted(triton_residual.add_rms_norm)
    qkv = Counted(triton_qkv.qkv_rope_store)
    monkeypatch.setattr(triton_residual, "add_rms_norm", add)
    monkeypatch.setattr(triton_qkv, "qkv_rope_store", qkv)
    fused = two_steps(model, dtype, DEVICE)
    for a, b in zip(fused, plain, strict=True):
        assert same_bits(a, b)
    layers = len(model.layers)
    if family == "phimoe":  # LayerNorm: the torch add
        assert add.calls == 0
    else:  # every norm but the first layer's input norm, per step
        assert add.calls == 2 * (2 * layers)
        assert add.rows == 2 * sum(block.can_keep_rows for block in model.moe_blocks())
        assert add.rows > 0 or family == "granitemoe"  # its layer scales the MoE output first
    assert qkv.calls == (0 if family == "deepseek_v2" else 2 * layers)  # MLA has its own


# ------------------------------------------------------- un-summed expert rows
def _kernel_block(dtype: torch.dtype = torch.float16):
    from support.engine import tiny_model

    model = tiny_model(dtype).to(DEVICE)
    block = model.moe_blocks()[0]
    block.experts.use_triton = True
    x = torch.randn(9, block.gate.shape[1], generator=torch.Generator().manual_seed(4))
    return block, x.to(DEVICE, dtype)


def test_experts_leave_their_rows_to_the_residual_add_only_when_asked():
    from moetrace.layers.residual import ExpertRows

    block, x = _kernel_block()
    with torch.inference_mode():
        summed = block(x)
        rows = block(x, keep_rows=True)
    assert isinstance(summed, torch.Tensor)
    assert isinstance(rows, ExpertRows) and rows.rows.shape == (9, block.top_k, x.shape[1])
    assert same_bits(rows.total(), summed)  # torch's sum of the same rows: what forward returned


def test_hooks_get_the_summed_output():
    """Forward hooks (tensor and sequence parallelism's) need the block's summed output."""
    from moetrace.models.common import feed_forward

    block, x = _kernel_block()
    seen = []
    handle = block.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.inference_mode():
        out = feed_forward(block, x)
    handle.remove()
    assert isinstance(out, torch.Tensor) and isinstance(seen[0], torch.Tensor)
    handle = block.experts.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.inference_mode():
        out = block(x, keep_rows=True)
    handle.remove()
    assert isinstance(out, torch.Tensor) and isinstance(seen[1], torch.Tensor)
    with torch.inference_mode():  # a pre-hook sees only the input: rows still fine
        handle = block.register_forward_pre_hook(lambda m, args: None)
        out = feed_forward(block, x)
        handle.remove()
    assert not isinstance(out, torch.Tensor)


def test_the_plain_path_sums_as_before():
    """Off the kernels the experts return their sum, and ``add_norm`` is ``norm(residual + x)``."""
    from moetrace.layers.norm import RMSNorm
    from moetrace.layers.residual import ExpertRows, add_norm, plus

    block, x = _kernel_block(torch.float64)
    block.experts.use_triton = False
    with torch.inference_mode():
        assert isinstance(block(x.double(), keep_rows=True), torch.Tensor)
    norm = RMSNorm(x.shape[1], 1e-6).double().to(DEVICE)
    r = torch.randn_like(x, dtype=torch.float64)
    y = torch.randn_like(r)
    out, new = add_norm(norm, y, r)
    assert torch.equal(new, r + y) and torch.equal(out, norm(r + y))
    rows = torch.randn(x.shape[0], 3, x.shape[1], dtype=torch.float64, device=DEVICE)
    out, new = add_norm(norm, plus(ExpertRows(rows), y), r)
    assert torch.equal(new, r + (rows.sum(dim=1) + y))
    first, stream = add_norm(norm, y, None)
    assert stream is y and torch.equal(first, norm(y))


# ---------------------------------------------------- the top-k weights' cast
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float16])
def test_the_down_gemm_reads_16_bit_weights_as_their_float32_widening(weights_dtype):
    """``fused_moe`` no longer casts the weights to float32 first (one launch a layer): the
    kernel widens them as it loads them, exactly, so the output is the same bits."""
    from moetrace.kernels.triton_moe import fused_moe

    gen = torch.Generator().manual_seed(0)
    tokens, experts, hidden, inter, top_k = 37, 8, 64, 32, 2
    dtype = torch.float16 if INTERPRET else torch.bfloat16  # the interpreter's bf16 dots are off
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(DEVICE, dtype)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE, weights_dtype)
    assert same_bits(
        fused_moe(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights.float(), ids)
    )


def test_only_aligned_rows_are_fused():
    """The fused norms run only on rows Triton lays out as the unfused norm does."""
    from moetrace.layers.residual import sixteen_byte_rows

    wide = torch.zeros(8, 2048 + 40, dtype=torch.bfloat16)
    assert sixteen_byte_rows(wide[:, :2048].contiguous(), None)
    assert not sixteen_byte_rows(wide[:, :2048])  # rows 2088 elements apart
    assert not sixteen_byte_rows(wide.view(-1)[8:].view(8, -1)[:, :2048])
    assert not sixteen_byte_rows(torch.zeros(4, 2048, dtype=torch.bfloat16)[:, 4:])  # offset start
    assert sixteen_byte_rows(torch.zeros(4, 8, 2048, dtype=torch.bfloat16))
