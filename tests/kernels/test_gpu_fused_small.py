"""The fused small kernels on CUDA at the target models' shapes, bit for bit against today's.

``kernels/triton_residual.add_rms_norm`` (the top-k sum, the residual add and
the next RMSNorm) and ``kernels/triton_qkv.qkv_rope_store`` (q/k norm,
rotary, KV store) against the unfused CUDA sequences they replace
(``tests/support/fused_reference.py``), at the widths of Qwen3-30B-A3B, OLMoE-1B-7B
and DeepSeek-V2-Lite (and gpt-oss/Mixtral's heads without a norm) and T = 1,
37, 256, 2048.  The one documented difference, the float32 order of the top-k
sum, is measured against torch's ``sum(dim=1)``.  Then tiny models through
the kernels, fused and unfused, eager and replayed from a CUDA graph.

Skipped without a CUDA device (the small shapes run on the CPU in
``test_triton_fused_norms.py``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
TOKENS = [1, 37, 256, 2048]
HIDDEN = 2048  # Qwen3-30B-A3B, OLMoE-1B-7B and DeepSeek-V2-Lite alike
# (what feeds the residual add): top_k 0 = a [T, H] output; shared = DeepSeek's shared
# experts; the width; gpt-oss's norm (the weight times the float32 row)
RESIDUAL_CASES = {
    "attention": (0, False, HIDDEN, False),
    "qwen3/olmoe experts": (8, False, HIDDEN, False),
    "deepseek-v2-lite experts": (6, True, HIDDEN, False),
    "gpt-oss attention": (0, False, 2880, True),
    "gpt-oss experts": (4, False, 2880, True),
}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_is_the_unfused_cuda_sequence(tokens, case, dtype):
    from support.fused_reference import residual_inputs, same_bits, unfused_add_norm

    from moetrace.kernels.triton_residual import add_rms_norm

    top_k, shared, hidden, weight_in_float32 = RESIDUAL_CASES[case]
    for eps in (1e-6, 1e-5):  # Qwen3 / DeepSeek, OLMoE and gpt-oss
        inputs = residual_inputs(tokens, hidden, top_k, dtype, CUDA, seed=tokens, extra=shared)
        ref_out, ref_residual = unfused_add_norm(
            **inputs, eps=eps, weight_in_float32=weight_in_float32
        )
        out, residual = add_rms_norm(
            inputs["x"],
            inputs["residual"],
            inputs["weight"],
            eps,
            extra=inputs["extra"],
            weight_in_float32=weight_in_float32,
        )
        assert same_bits(residual, ref_residual)
        assert same_bits(out, ref_out)  # the norm: rms_norm's bits on the same row


@pytest.mark.parametrize("top_k", [6, 8])
def test_the_fixed_order_top_k_sum_against_torchs(top_k):
    """The documented difference: torch's CUDA ``sum(dim=1)`` adds the k rows in float32 in
    an order of its own; rounded once to bfloat16 the two agree but for rare one-unit steps."""
    from support.fused_reference import fixed_order_sum

    rows = (torch.randn(2048, top_k, HIDDEN, device=CUDA) * 0.2).to(torch.bfloat16)
    ours, torchs = fixed_order_sum(rows), rows.sum(dim=1)
    assert _ulps(ours, torchs) <= 1
    assert (ours != torchs).float().mean() < 1e-3


QKV_SHAPES = {
    # name: (q heads, kv heads, head_dim, norm)
    "qwen3-30b-a3b": (32, 4, 128, "head"),
    "olmoe-1b-7b": (16, 16, 128, "full"),
    "mixtral (no norm)": (32, 8, 128, None),
    "gpt-oss (no norm)": (64, 8, 64, None),
}


@pytest.mark.parametrize("strided", [False, True], ids=["aligned", "strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(QKV_SHAPES))
@pytest.mark.parametrize("tokens", TOKENS)
def test_qkv_rope_store_is_the_unfused_cuda_sequence(tokens, shape, dtype, strided):
    """Aligned rows (a QKV GEMM's output) give the same bits with or without a norm.

    Rows 40 elements apart are not provably aligned, and Triton then lays a
    norm's row out differently in the two kernels, so the sum of squares runs
    in another order (on the H200: 1 to 200 of 10^6..10^7 values one unit
    off).  The layers do not fuse such rows (``sixteen_byte_rows``); without a
    norm the fused kernel is exact on them too.
    """
    from support.fused_reference import QKVCase, same_bits

    from moetrace.layers.residual import sixteen_byte_rows

    heads, kv_heads, dim, norm = QKV_SHAPES[shape]
    case = QKVCase(
        tokens, heads, kv_heads, dim, norm, dtype, CUDA, seed=tokens + heads, strided=strided
    )
    assert sixteen_byte_rows(case.qkv) is not strided
    if strided and norm is not None:
        return  # the layers run the unfused kernels here: asserted just above
    ref_q, ref_k, ref_v = case.reference()
    q, k_cache, v_cache = case.fused()
    assert same_bits(q, ref_q)
    # NaN-poisoned caches: the same slots written with the same bits, nothing else touched.
    assert same_bits(k_cache, ref_k) and same_bits(v_cache, ref_v)


def test_fused_kernels_replay_in_a_cuda_graph():
    from support.fused_reference import QKVCase, residual_inputs, same_bits

    from moetrace.kernels.triton_residual import add_rms_norm

    case = QKVCase(256, 32, 4, 128, "head", torch.bfloat16, CUDA, seed=1)
    inputs = residual_inputs(256, HIDDEN, 8, torch.bfloat16, CUDA, seed=2)
    eager = case.fused(), add_rms_norm(inputs["x"], inputs["residual"], inputs["weight"], 1e-6)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = (
            case.fused(),
            add_rms_norm(inputs["x"], inputs["residual"], inputs["weight"], 1e-6),
        )
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip((*eager[0], *eager[1]), (*captured[0], *captured[1]), strict=True):
        assert same_bits(a, b)


TINY = {  # top-2 routing: the fused sum of two rows is torch's whatever the order
    "qwen3_moe": {},
    "olmoe": {"num_key_value_heads": 4},
    "deepseek_v2": {},
    "qwen2_moe": {},
}


@pytest.mark.parametrize("family", list(TINY))
def test_tiny_models_compute_the_same_fused_on_cuda(family, tmp_path, monkeypatch):
    """A family's forward on the kernels in bfloat16, fused and unfused: the same bits."""
    from support.fused_reference import Counted, same_bits, two_steps
    from support.hf_reference import make_tiny_checkpoint

    from moetrace.engine.model_runner import set_kernel_paths
    from moetrace.kernels import triton_residual
    from moetrace.layers import residual
    from moetrace.models.loader import load_model

    ckpt = make_tiny_checkpoint(
        family, tmp_path / "ckpt", seed=5, dtype=torch.bfloat16, **TINY[family]
    )
    model = load_model(str(ckpt), device=CUDA, dtype="bfloat16").model
    set_kernel_paths(model, True)
    monkeypatch.setattr(residual, "FUSED_NORMS", False)
    plain = two_steps(model, torch.bfloat16, CUDA)
    monkeypatch.setattr(residual, "FUSED_NORMS", True)
    add = Counted(triton_residual.add_rms_norm)
    monkeypatch.setattr(triton_residual, "add_rms_norm", add)
    fused = two_steps(model, torch.bfloat16, CUDA)
    assert add.rows > 0
    for a, b in zip(fused, plain, strict=True):
        assert same_bits(a, b)
