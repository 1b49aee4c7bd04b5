"""The fused-MoE alignment kernel writes the routing capture itself, gate weights too.

Checked against the copy the capturer makes on the plain path: the same ids
(and weights) land in the same rows of the same layer, nothing else in the
buffers moves, and the experts' output is unchanged.  Needs CUDA, or
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support.engine import tiny_model  # noqa: E402
from support.triton import DEVICE, INTERPRET, KERNEL_TEST_MARKS  # noqa: E402

from moetrace.capture.capturer import RoutingCapturer, capture_dtype  # noqa: E402
from moetrace.kernels.triton_align import align_routing  # noqa: E402

pytestmark = KERNEL_TEST_MARKS
UNTOUCHED = 77


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (37, 64, 8)])
def test_alignment_writes_the_ids_into_one_layer_of_the_buffer(
    dtype, num_tokens, num_experts, top_k
):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    ).to(DEVICE)
    buffer = torch.full((num_tokens + 5, 3, top_k), UNTOUCHED, dtype=dtype, device=DEVICE)
    align_routing(ids, num_experts, 16, buffer[:num_tokens, 1])
    assert torch.equal(buffer[:num_tokens, 1].long(), ids)
    others = torch.ones_like(buffer, dtype=torch.bool)
    others[:num_tokens, 1] = False
    assert (buffer[others] == UNTOUCHED).all()


@pytest.mark.parametrize("capture_dtype_", [torch.float16, torch.float32])
def test_alignment_writes_the_weights_beside_the_ids(capture_dtype_):
    num_tokens, num_experts, top_k = 13, 16, 4
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    ).to(DEVICE)
    weights = torch.rand((num_tokens, top_k), generator=gen).to(DEVICE, torch.bfloat16)
    id_buffer = torch.full((num_tokens + 3, 2, top_k), UNTOUCHED, dtype=torch.uint8, device=DEVICE)
    buffer = torch.full((num_tokens + 3, 2, top_k), UNTOUCHED, dtype=capture_dtype_, device=DEVICE)
    align_routing(
        ids,
        num_experts,
        16,
        id_buffer[:num_tokens, 0],
        topk_weights=weights,
        capture_weights=buffer[:num_tokens, 1],
    )
    assert torch.equal(id_buffer[:num_tokens, 0].long(), ids)
    assert torch.equal(buffer[:num_tokens, 1], weights.to(capture_dtype_))
    others = torch.ones_like(buffer, dtype=torch.bool)
    others[:num_tokens, 1] = False
    assert (buffer[others] == UNTOUCHED).all()
    with pytest.raises(ValueError, match="needs the"):
        align_routing(ids, num_experts, 16, capture_weights=buffer[:num_tokens, 1])


def test_alignment_refuses_a_capture_view_of_another_shape():
    ids = torch.zeros((4, 2), dtype=torch.int64, device=DEVICE)
    buffer = torch.zeros((4, 1, 3), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        align_routing(ids, 8, 16, buffer[:, 0])


@pytest.mark.parametrize("weights_dtype", [None, torch.float16, torch.float32])
def test_moe_block_capture_by_the_kernel_equals_the_capturers_copy(weights_dtype):
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    model = tiny_model(dtype).to(DEVICE)
    blocks = model.moe_blocks()
    num_tokens = 9
    capturer = RoutingCapturer(
        16, len(blocks), model.top_k, DEVICE, capture_dtype(model.num_experts), weights_dtype
    )
    model.set_capturer(capturer)
    x = torch.randn(num_tokens, blocks[0].gate.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(DEVICE, dtype)

    def run(in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        capturer.buffer.fill_(UNTOUCHED)
        if capturer.weights is not None:
            capturer.weights.fill_(UNTOUCHED)
        capturer.in_kernel = in_kernel
        for block in blocks:
            block.experts.use_triton = True
        with torch.inference_mode():
            outs = [block(x) for block in blocks]
        weights = None if capturer.weights is None else capturer.weights.clone()
        return capturer.buffer.clone(), weights, outs

    copied, copied_weights, outs_copy = run(in_kernel=False)
    written, written_weights, outs_kernel = run(in_kernel=True)
    assert (copied[:num_tokens] != UNTOUCHED).all()
    assert torch.equal(written, copied)
    if weights_dtype is None:
        assert written_weights is None
    else:
        assert (copied_weights[:num_tokens] != UNTOUCHED).all()
        assert torch.equal(written_weights, copied_weights)
    for a, b in zip(outs_kernel, outs_copy, strict=True):
        assert torch.equal(a, b)
    assert all(block.experts._capture is None for block in blocks)


def test_experts_refuse_ids_other_than_those_recorded():
    model = tiny_model(torch.float32).to(DEVICE)
    block = model.moe_blocks()[0]
    capturer = RoutingCapturer(8, len(model.moe_blocks()), model.top_k, DEVICE, torch.uint8)
    ids = torch.zeros((2, model.top_k), dtype=torch.int64, device=DEVICE)
    x = torch.zeros((2, block.gate.shape[1]), device=DEVICE)
    weights = torch.ones((2, model.top_k), device=DEVICE)
    block.experts.capture_with(ids, capturer.destination(0, 2), weights)
    with pytest.raises(RuntimeError, match="other ids"):
        block.experts(x, weights, ids.clone())
    block.experts.capture_with(ids, capturer.destination(0, 2), weights)
    with pytest.raises(RuntimeError, match="other ids"):  # weights other than recorded
        block.experts(x, weights.clone(), ids)
