"""The fused routing kernels against the torch routing path they replace on CUDA.

Every scoring variant (softmax then top-k, renormalised or not, DeepSeek-V2's
scaled float32 weights, GraniteMoE's top-k then softmax) on logits with planted
ties and near-ties: ids are the current path's wherever its scores are not
tied, and always the documented rule (largest logit, lower index first);
weights are the family's float32 rule within a few units in the last place.
Needs CUDA, or ``TRITON_INTERPRET=1`` (then numpy's ``exp`` stands in for
libdevice's, hence ``MAX_ULPS`` here; the GPU test holds the kernel to 1).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from support.routing_cases import (  # noqa: E402
    VARIANTS,
    check_route,
    cuda_topk_order,
    numpy_warp_softmax,
    tricky_logits,
)
from support.triton import DEVICE, KERNEL_TEST_MARKS  # noqa: E402

from moetrace.kernels.triton_align import align_routing_torch  # noqa: E402
from moetrace.kernels.triton_routing import (  # noqa: E402
    grouping_work,
    route,
    route_and_align,
)

pytestmark = KERNEL_TEST_MARKS
MAX_ULPS = 8  # numpy's float32 exp against torch's CPU exp (Sleef), through the renormalisation


def test_torch_topk_on_cpu_does_not_put_the_lower_index_first():
    """Why ties are compared by rule, not against ``torch.topk``: on CPU its order among
    equal values is not by index (so the current path is ambiguous there)."""
    x = torch.zeros(1, 128)
    assert not torch.equal(torch.topk(x, 8).indices, torch.arange(8)[None])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
@pytest.mark.parametrize("num_experts", [8, 60, 64, 128])
def test_route_matches_the_torch_path(variant, num_tokens, num_experts):
    bf16 = VARIANTS[variant][3] != torch.float32
    logits = tricky_logits(num_tokens, num_experts, num_tokens * 1000 + num_experts, bf16=bf16)
    clear = rows = 0
    for top_k in (1, 2, 4, 6, 8):
        if top_k > num_experts:
            continue
        seen = check_route(variant, logits.to(DEVICE), top_k, route, MAX_ULPS)
        clear, rows = clear + seen["clear"], rows + seen["rows"]
    if num_tokens == 256:
        assert clear > rows // 2  # most rows are compared id for id


def test_bf16_logits_are_read_as_their_float32_values():
    logits = tricky_logits(64, 64, 3, bf16=True).to(DEVICE, torch.bfloat16)
    a = route(logits, 8, "softmax_topk", weights_dtype=torch.bfloat16)
    b = route(logits.float(), 8, "softmax_topk", weights_dtype=torch.bfloat16)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_ties_keep_the_lower_indices_in_torchs_cuda_order():
    """Among equal values at the k-th place the lower indices are kept, as ``torch.topk``
    keeps them on CUDA, and the k come out in the order its bitonic sort leaves them
    (``cuda_topk_order``, checked against CUDA's ``topk`` in ``test_gpu_routing.py``)."""
    logits = torch.zeros(3, 64)
    logits[1, [50, 3, 17, 40]] = 1.0  # four equal leaders, then 60 equal zeros
    logits[2] = torch.arange(64).float() % 4  # sixteen experts each at 3, 2, 1, 0
    _, ids, _ = route(logits.to(DEVICE), 6, "softmax_topk")
    got = ids.cpu().long()
    assert torch.equal(got, cuda_topk_order(logits, 6))
    assert [sorted(r) for r in got.tolist()] == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 3, 17, 40, 50],
        [3, 7, 11, 15, 19, 23],
    ]
    assert got[0].tolist() != sorted(got[0].tolist())  # an unstable sort: not index order


def test_softmax_sum_follows_torchs_cuda_order():
    """The kernel adds the exponentials as torch's CUDA warp softmax does (lane l sums
    l, l+32, ..., then XOR halves): with the same exp, its weights are that sum's."""
    num_experts, top_k = 128, 8
    logits = tricky_logits(16, num_experts, 9, bf16=False)
    w, ids, _ = route(logits.to(DEVICE), top_k, "softmax_topk")
    if DEVICE.type == "cpu":  # the interpreter's exp is numpy's: bit for bit
        want = numpy_warp_softmax(logits).gather(1, ids.long())
        assert torch.equal(w, want)


def test_capture_views_receive_ids_and_weights_in_their_dtypes():
    logits = tricky_logits(9, 60, 4, bf16=True).to(DEVICE)
    ids_buf = torch.full((12, 3, 4), 77, dtype=torch.uint8, device=DEVICE)
    w_buf = torch.full((12, 3, 4), 77, dtype=torch.float16, device=DEVICE)
    w, ids, _ = route(
        logits,
        4,
        "softmax_topk",
        renormalize=True,
        weights_dtype=torch.bfloat16,
        capture=ids_buf[:9, 1],
        capture_weights=w_buf[:9, 2],
    )
    assert torch.equal(ids_buf[:9, 1].long(), ids.long())
    assert torch.equal(w_buf[:9, 2], w.to(torch.float16))  # bf16 first, as the capturer's copy
    untouched = torch.ones_like(ids_buf, dtype=torch.bool)
    untouched[:9, 1] = False
    assert (ids_buf[untouched] == 77).all()
    untouched = torch.ones_like(w_buf, dtype=torch.bool)
    untouched[:9, 2] = False
    assert (w_buf[untouched] == 77).all()
    with pytest.raises(ValueError, match="does not fit"):
        route(logits, 4, "softmax_topk", capture=ids_buf[:8, 1])


def table_groups(aligned) -> list[tuple[int, list[int]]]:
    """(expert, pairs) of each row block in use of a table-layout ``AlignedRouting``."""
    used = int(aligned.num_rows_padded.item()) // aligned.block_m
    table = aligned.sorted_pair_ids.cpu()
    groups = []
    for b in range(used):
        first, rows = int(aligned.block_slots[b]), int(aligned.block_rows[b])
        assert 1 <= rows <= aligned.block_m
        groups.append((int(aligned.block_expert_ids[b]), table[first : first + rows].tolist()))
    return groups


@pytest.mark.parametrize(("num_tokens", "num_experts", "block_m"), [(7, 64, 32), (256, 60, 16)])
def test_route_and_align_groups_every_pair_once_in_expert_order(num_tokens, num_experts, block_m):
    """Each row block holds pairs of its expert only, experts in order, each pair once; the
    padded row count is the sorted layout's; the counters come back zeroed for the next call."""
    work = grouping_work(num_experts, torch.device(DEVICE))
    for seed in (2, 3):  # the second call reuses the counters the first left
        logits = tricky_logits(num_tokens, num_experts, seed, bf16=True).to(DEVICE)
        fused = route_and_align(
            logits, 8, "softmax_topk", block_m, weights_dtype=torch.bfloat16, work=work
        )
        assert fused.aligned.is_table and fused.aligned.block_m == block_m
        assert not work.any()
        ids = fused.ids.cpu().reshape(-1)
        groups = table_groups(fused.aligned)
        experts = [e for e, _ in groups]
        assert experts == sorted(experts)
        pairs = sorted(p for _, group in groups for p in group)
        assert pairs == list(range(ids.numel()))
        for expert, group in groups:
            assert (ids[group] == expert).all()
        want = align_routing_torch(fused.ids.long(), num_experts, block_m)
        assert int(fused.aligned.num_rows_padded) == int(want.num_rows_padded)
        assert experts == want.block_expert_ids[: len(experts)].tolist()


def test_route_and_align_of_no_tokens_uses_no_rows():
    logits = torch.zeros(0, 64, device=DEVICE)
    fused = route_and_align(logits, 8, "softmax_topk", 32)
    assert fused.ids.shape == (0, 8)
    assert int(fused.aligned.num_rows_padded) == 0
    fused = route_and_align(logits, 8, "softmax_topk", 32, loaded_block_m=64)
    assert int(fused.aligned.num_rows_padded) == 0
    assert int(fused.aligned.loaded.num_rows_padded) == 0


def test_experts_give_the_same_output_from_either_layout():
    """The GEMMs read a table-layout routing (fused kernel) as they read the sorted one."""
    from moetrace.kernels.triton_moe import fused_moe, fused_moe_with_config, moe_config

    gen = torch.Generator().manual_seed(5)
    tokens, experts, hidden, inter = 33, 8, 64, 32
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 6).to(torch.bfloat16)
    w13, w2 = w13.to(DEVICE), w2.to(DEVICE)
    logits = tricky_logits(tokens, experts, 9, bf16=True).to(DEVICE)
    cfg = moe_config(tokens, 2, experts)
    fused = route_and_align(logits, 2, "softmax_topk", cfg.block_m, weights_dtype=torch.bfloat16)
    sorted_out = fused_moe(x, w13, w2, fused.weights, fused.ids)
    table_out = fused_moe_with_config(
        x, w13, w2, fused.weights, fused.ids, cfg,
        aligned=fused.aligned, weights_f32=fused.weights_f32,
    )  # fmt: skip
    assert torch.equal(table_out, sorted_out)
