"""On CUDA: the fused routing kernels against torch's CUDA routing ops, and in a model.

The CPU test (``test_triton_routing.py``) runs the kernels in the interpreter,
whose ``exp`` is numpy's; here the kernel's libdevice ``exp`` and its
torch-ordered softmax sum meet torch's own CUDA softmax, so the weights are
held to 1 unit in the last place (2 after renormalisation, whose k-term sum
order is torch's reduction's).  Ids: exactly CUDA ``torch.topk``'s on every
row, tied values included, and the model of its tie order
(``routing_cases.cuda_topk_order``) is checked against it first.
"""

from __future__ import annotations

import pytest
import torch
from support.routing_cases import VARIANTS, check_route, cuda_topk_order, tricky_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# OLMoE, Qwen3/Qwen2-57B, Mixtral, DeepSeek-V2-Lite, Qwen1.5-MoE, GraniteMoE-style shapes.
SHAPES = [(64, 8), (128, 8), (8, 2), (64, 6), (60, 4), (40, 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_experts", "top_k"), [*SHAPES, (32, 4), (128, 32), (16, 16)])
def test_the_tie_order_model_is_cudas_topk(num_experts, top_k, dtype):
    """``cuda_topk_order`` (what the kernel computes) against CUDA's ``torch.topk`` on
    probabilities and raw logits with ties everywhere: few distinct values, and the
    planted ties of ``tricky_logits``."""
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k)
    few = torch.randint(0, 5, (1000, num_experts), generator=gen).float()
    for logits in (few, tricky_logits(256, num_experts, top_k, bf16=True)):
        logits = logits.cuda().to(dtype)
        for scores in (torch.softmax(logits.float(), -1), logits):
            want = torch.topk(scores, top_k, dim=-1).indices.cpu()
            assert torch.equal(cuda_topk_order(scores, top_k), want)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 512])
@pytest.mark.parametrize(("num_experts", "top_k"), SHAPES)
def test_fused_routing_matches_torchs_cuda_ops(variant, num_tokens, num_experts, top_k):
    from moetrace.kernels.triton_routing import route

    bf16 = VARIANTS[variant][3] != torch.float32
    logits = tricky_logits(num_tokens, num_experts, num_tokens + num_experts, bf16=bf16).cuda()
    max_ulps = 2 if VARIANTS[variant][1] else 1
    check_route(variant, logits, top_k, route, max_ulps)


def test_fused_routing_replays_in_a_cuda_graph():
    from moetrace.kernels.triton_routing import route_and_align

    logits = tricky_logits(256, 64, 1, bf16=True).cuda()
    eager = route_and_align(logits, 8, "softmax_topk", 64, weights_dtype=torch.bfloat16)
    static = logits.clone()
    route_and_align(static, 8, "softmax_topk", 64, weights_dtype=torch.bfloat16)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_and_align(static, 8, "softmax_topk", 64, weights_dtype=torch.bfloat16)
    static.copy_(logits.flip(0))
    graph.replay()
    again = route_and_align(logits.flip(0), 8, "softmax_topk", 64, weights_dtype=torch.bfloat16)
    assert torch.equal(out.ids, again.ids)
    assert torch.equal(out.weights, again.weights)
    assert not torch.equal(out.ids, eager.ids)
    assert int(out.aligned.num_rows_padded) == int(again.aligned.num_rows_padded)


@pytest.mark.parametrize("num_tokens", [7, 256, 3000])
def test_moe_block_fused_routing_equals_the_torch_path(num_tokens, monkeypatch):
    """A bf16 softmax-top-k block, eager, kernels on: the fused path's captured ids and
    weights and its output equal the same block's with fused routing turned off, at
    decode sizes and at a prefill chunk's (larger row blocks, several an expert)."""
    from support.engine import tiny_model

    from moetrace.capture.capturer import RoutingCapturer, capture_dtype
    from moetrace.layers import moe

    model = tiny_model(torch.bfloat16).cuda()
    blocks = model.moe_blocks()
    capturer = RoutingCapturer(
        max(512, num_tokens), len(blocks), model.top_k, torch.device("cuda"), capture_dtype(model.num_experts),
        torch.float32,
    )  # fmt: skip
    capturer.in_kernel = True
    model.set_capturer(capturer)
    for block in blocks:
        block.experts.use_triton = True
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, blocks[0].gate.shape[1], generator=gen).cuda().bfloat16()

    def run(max_tokens: int):
        monkeypatch.setattr(moe, "FUSED_ROUTING_MAX_TOKENS", max_tokens)
        capturer.buffer.zero_()
        capturer.weights.zero_()
        with torch.inference_mode():
            outs = [block(x) for block in blocks]
        return capturer.buffer.clone(), capturer.weights.clone(), outs

    ids_t, w_t, out_t = run(0)
    ids_f, w_f, out_f = run(num_tokens)
    for layer in range(len(blocks)):
        # bf16 logits tie often: the fused kernel orders ties as CUDA's torch.topk does.
        assert torch.equal(ids_f[:num_tokens, layer], ids_t[:num_tokens, layer])
        assert torch.equal(w_f[:num_tokens, layer], w_t[:num_tokens, layer])
        assert torch.equal(out_f[layer], out_t[layer])
