"""The MoE routing path in one Triton launch: scoring, top-k, weights, capture and grouping.

On the torch path a decode step's MoE layer runs, between the router GEMM and
the first expert GEMM: the softmax, ``topk`` (its selection and its sort),
the renormalisation's sum and division, the weights' cast to the model dtype
and the alignment: 6 to 8 launches of 2-11 us each at batch 256.  Here
``_route_kernel`` (a program per row on the GPU) does the scoring, the top-k, the
weights, their casts and the capture writes, and (``route_and_align``) groups
the pairs by expert for the GEMMs, the last program to finish labelling the
row blocks (``_group_pairs``): one launch where the separate alignment
(``kernels/triton_align.py``) takes two more.

Ids are chosen on what the torch path ranks (the float32 probabilities for
``softmax_topk``, which distinct logits can share; the logits for
``topk_softmax``) and come out in the order CUDA's ``torch.topk`` gives
them, ties included: among equal values at the k-th place the lower indices
are kept, and the k are put in the order torch's small bitonic sort leaves
them (unstable: equal values keep no index order), by running that network
(``_torch_cuda_order``).  bf16 router logits tie often, so anything less
would record other ids than the torch path on CUDA.  One difference is left:
on raw logits torch's selection ranks -0 below +0, which this ties.  Weights
follow the family's float32 rule with libdevice's ``exp`` (the CUDA math
library's ``expf``, which torch's softmax calls) and an IEEE division; only the order of the softmax's sum differs from torch's,
so weights agree to a few units in the last place (``tests/kernels/test_triton_routing.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moetrace.kernels.triton_align import AlignedRouting, check_capture_views
from moetrace.kernels.triton_rounding import round_to

# Scoring rules the kernel computes (the families' rules in ``layers/moe.py``).
SOFTMAX_TOPK = 0  # softmax over every expert, top-k, optional renormalisation
TOPK_SOFTMAX = 1  # top-k on the logits, softmax over the k
SCORINGS = {"softmax_topk": SOFTMAX_TOPK, "topk_softmax": TOPK_SOFTMAX}


class FusedRouting(NamedTuple):
    """What the experts need from the router: ids, weights, and the pairs grouped by expert."""

    weights: torch.Tensor  # [T, k] in the family's weight dtype (what the trace records)
    ids: torch.Tensor  # int32 [T, k], router order
    weights_f32: torch.Tensor  # float32 [T, k]: ``weights`` widened, what the GEMM multiplies by
    aligned: AlignedRouting


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """libdevice's ``expf`` (torch's on CUDA); numpy's in the interpreter, which lacks libdevice."""
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _narrow(w, dtype: tl.constexpr):
    """``w``, already rounded to ``dtype``'s values, in ``dtype`` (bfloat16 by its top half:
    the interpreter's cast mangles subnormals)."""
    if dtype == tl.bfloat16:
        out = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = w.to(dtype)
    return out


@triton.jit
def _warp_order_sum(e, ROWS: tl.constexpr, N: tl.constexpr, WARP: tl.constexpr):
    """Row sums of ``e [ROWS, N]`` added in the order of torch's CUDA softmax for ``N <= 1024``.

    There (``softmax_warp_forward``) lane ``l`` of a ``WARP``-wide group adds
    elements ``l, l + WARP, l + 2 WARP, ...`` in turn, then the lanes combine
    by XOR shuffles, halves first.  The same additions in the same order give
    the same float32 sum, so the probabilities match torch's bit for bit.
    """
    ITER: tl.constexpr = N // WARP
    e3 = tl.reshape(e, (ROWS, ITER, WARP))
    step = tl.arange(0, ITER)[None, :, None]
    lanes = tl.zeros([ROWS, WARP], dtype=tl.float32)
    for it in tl.static_range(ITER):
        lanes += tl.sum(tl.where(step == it, e3, 0.0), axis=1)  # one element, exactly
    # Lane l takes l ^ offset for offset = WARP/2, ..., 1; lanes < offset hold what is still needed.
    if WARP >= 32:
        lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 16)), axis=1)
    if WARP >= 16:
        lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 8)), axis=1)
    if WARP >= 8:
        lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 4)), axis=1)
    if WARP >= 4:
        lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 2)), axis=1)
    if WARP >= 2:
        lanes = tl.sum(tl.reshape(lanes, (ROWS, 2, 1)), axis=1)
    return tl.reshape(lanes, (ROWS,))


@triton.jit
def _float_order(x):
    """float32 ``x`` as int32 keys in its float order (-0 as +0, as a float compare has it)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _from_float_order(key):
    """``_float_order``'s inverse (a -0 comes back +0)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


SORT_SLOTS: tl.constexpr = tl.constexpr(32)  # torch's small bitonic sort: k <= 32 values


@triton.jit
def _bitonic_stage(packed, ROWS: tl.constexpr, SIZE: tl.constexpr, STRIDE: tl.constexpr):
    """One compare-exchange stage of torch's small bitonic sort on ``packed [ROWS, 32]``
    (key in the high 32 bits, id + 1 in the low; 0 marks an invalid slot).

    Slot ``p`` (its ``STRIDE`` bit clear) and ``p + STRIDE`` swap when ``(key[p] >
    key[p + STRIDE] and p valid) or p + STRIDE invalid`` equals the direction,
    ``p & SIZE`` (``SIZE = 0``: the last merge, false).
    """
    NB: tl.constexpr = SORT_SLOTS // (2 * STRIDE)
    pairs = tl.permute(tl.reshape(packed, (ROWS, NB, 2, STRIDE)), (0, 1, 3, 2))
    a, b = tl.split(pairs)  # [ROWS, NB, STRIDE]: slots p and p + STRIDE
    first = tl.arange(0, NB)[None, :, None] * (2 * STRIDE)
    direction = (first & SIZE) != 0
    valid_a = (a & 0xFFFFFFFF) != 0
    valid_b = (b & 0xFFFFFFFF) != 0
    swap = (((a >> 32) > (b >> 32)) & valid_a) | (~valid_b)
    exchange = swap == direction
    top = tl.where(exchange, b, a)
    bottom = tl.where(exchange, a, b)
    pairs = tl.permute(tl.join(top, bottom), (0, 1, 3, 2))
    return tl.reshape(pairs, (ROWS, SORT_SLOTS))


@triton.jit
def _torch_cuda_order(ids, values, ROWS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr):
    """Picks ``[ROWS, K_P2]`` (largest first, the lower index first among equal values)
    to the order ``torch.topk`` returns them in on CUDA.

    torch's selection writes the values above the k-th largest in index order,
    then the equal ones in index order; its sort of those k is a bitonic
    network over 32 slots, unstable, so where equal values end up depends on
    where they start.  Both are done here as torch does them
    (``tests/support/routing_cases.py`` has the model, checked against CUDA's ``topk``).
    """
    slots = tl.arange(0, K_P2)
    in_k = (slots < TOP_K)[None, :]
    kth = tl.min(tl.where(in_k, values, float("inf")), axis=1)[:, None]
    above = values > kth
    n_above = tl.sum((above & in_k).to(tl.int32), axis=1)[:, None]
    before = (
        (above[:, :, None] == above[:, None, :])
        & (ids[:, None, :] < ids[:, :, None])
        & in_k[:, None, :]
    )
    start = tl.sum(before.to(tl.int32), axis=2) + tl.where(above, 0, n_above)
    start = tl.where(in_k, start, SORT_SLOTS)  # picks past k take no slot
    # The key's float order as integers (the sort compares floats), id + 1 below.
    packed = (_float_order(values).to(tl.int64) << 32) | (ids + 1).to(tl.int64)
    net = tl.arange(0, SORT_SLOTS)
    placed = start[:, None, :] == net[None, :, None]  # [ROWS, slot, pick]
    network = tl.sum(tl.where(placed, packed[:, None, :], 0), axis=2)
    for s in tl.static_range(1, 5):  # merges of size 2, 4, 8, 16, then the last of 32
        for t in tl.static_range(s):
            network = _bitonic_stage(network, ROWS, 1 << s, 1 << (s - 1 - t))
    for t in tl.static_range(5):
        network = _bitonic_stage(network, ROWS, 0, 16 >> t)
    first = tl.reshape(network, (ROWS, SORT_SLOTS // K_P2, K_P2))
    group = tl.arange(0, SORT_SLOTS // K_P2)[None, :, None]
    first = tl.sum(tl.where(group == 0, first, 0), axis=1)  # slots 0 .. K_P2 - 1
    new_ids = (first & 0xFFFFFFFF).to(tl.int32) - 1
    # Each slot's value from its key bits (a -0 comes back +0: every weight rule
    # subtracts a maximum from it first, where the two give the same difference).
    new_values = _from_float_order((first >> 32).to(tl.int32))
    return tl.where(in_k, new_ids, ids), tl.where(in_k, new_values, values)


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "stride_logits",
        "stride_capture",
        "stride_capture_weights",
        "table_stride",
    ]
)
def _route_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    weights_f32_ptr,
    capture_ptr,
    capture_weights_ptr,
    num_tokens,
    num_experts,
    stride_logits,
    stride_capture,
    stride_capture_weights,
    scaling,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    ROWS: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    CAPTURE: tl.constexpr,
    CAPTURE_WEIGHTS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    WARP: tl.constexpr,
    K_WARP: tl.constexpr,
    work_ptr,
    table_ptr,
    block_expert_ids_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_rows_padded_ptr,
    table_stride,
    ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    loaded_expert_ids_ptr=None,
    loaded_slots_ptr=None,
    loaded_rows_ptr=None,
    loaded_rows_padded_ptr=None,
    LOADED_M: tl.constexpr = 0,
):
    """``ROWS`` tokens: pick ``TOP_K`` experts, weigh them, write ids, weights and captures.

    With ``ALIGN`` the pairs are also grouped by expert for the GEMMs (see ``_group_pairs``).
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_tokens
    cols = tl.arange(0, EXPERTS_P2)
    col_ok = cols < num_experts
    # Rows past the end re-read the last row (never stored): no -inf rows, no NaNs.
    src = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    x = tl.load(
        logits_ptr + src[:, None] * stride_logits + cols[None, :],
        mask=col_ok[None, :],
        other=float("-inf"),
    )
    x = x.to(tl.float32)
    if SCORING == 0:
        # torch ranks the float32 probabilities: distinct logits can share one (a
        # near-tie's exponentials round alike), so the picks are made on them.
        top = tl.max(x, axis=1)
        e = tl.where(col_ok[None, :], _exp(x - top[:, None], LIBDEVICE), 0.0)
        total = _warp_order_sum(e, ROWS, EXPERTS_P2, WARP)
        keys = tl.where(col_ok[None, :], tl.math.div_rn(e, total[:, None]), float("-inf"))
    else:
        keys = x

    # Top-k by repeated arg-max over one int64 per expert: the key's float order
    # as an integer above, the index below inverted, so the largest key wins
    # and the lower index among equals; a pick is struck out by its own bits,
    # so -inf or NaN logits still give k distinct ids.  Keys are compared as
    # torch's float compare does (-0 as +0; a NaN above everything).
    slots = tl.arange(0, K_P2)
    lowest = -9223372036854775807 - 1
    packed = (_float_order(keys).to(tl.int64) << 32) | (EXPERTS_P2 - 1 - cols)[None, :].to(tl.int64)
    packed = tl.where(col_ok[None, :], packed, lowest)
    picks = tl.full([ROWS, K_P2], lowest, dtype=tl.int64)
    tied = tl.zeros([ROWS], dtype=tl.int1)
    previous = tl.zeros([ROWS], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(packed, axis=1)
        packed = tl.where(packed == best[:, None], lowest, packed)
        picks = tl.where(slots[None, :] == j, best[:, None], picks)
        if j > 0:
            tied = tied | ((best >> 32) == (previous >> 32))
        previous = best
    in_k = (slots < TOP_K)[None, :]
    ids = tl.where(in_k, EXPERTS_P2 - 1 - (picks & 0xFFFFFFFF).to(tl.int32), 0)
    values = tl.where(in_k, _from_float_order((picks >> 32).to(tl.int32)), float("-inf"))
    # Distinct values come out of torch's sort largest first, as picked; only a
    # tie among the k needs its network (a program runs it when any row has one).
    if TOP_K > 1:  # noqa: SIM102 (a compile-time test: k = 1 compiles no network)
        if tl.max(tied.to(tl.int32), axis=0) > 0:
            ids, values = _torch_cuda_order(ids, values, ROWS, TOP_K, K_P2)

    if SCORING == 0:
        w = values  # the picks' shares of the softmax over every expert
    else:
        # Softmax over the k picked logits (values[:, 0] is their largest).
        e = tl.where(in_k, _exp(values - tl.max(values, axis=1)[:, None], LIBDEVICE), 0.0)
        w = tl.math.div_rn(e, _warp_order_sum(e, ROWS, K_P2, K_WARP)[:, None])
    w = tl.where(in_k, w, 0.0)
    if RENORMALIZE:
        w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None])
    if SCALE:
        w = w * scaling
    # Rounded on the bits (the interpreter's cast to bfloat16 truncates), kept in float32.
    w = round_to(w, weights_ptr.dtype.element_ty)

    ok = row_ok[:, None] & in_k
    pair = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    tl.store(ids_ptr + pair, ids, mask=ok)
    tl.store(weights_ptr + pair, _narrow(w, weights_ptr.dtype.element_ty), mask=ok)
    tl.store(weights_f32_ptr + pair, w, mask=ok)
    if CAPTURE:
        dst = capture_ptr + rows.to(tl.int64)[:, None] * stride_capture + slots[None, :]
        tl.store(dst, ids.to(capture_ptr.dtype.element_ty), mask=ok)
    if CAPTURE_WEIGHTS:
        dst = (
            capture_weights_ptr
            + rows.to(tl.int64)[:, None] * stride_capture_weights
            + slots[None, :]
        )
        tl.store(dst, w.to(capture_weights_ptr.dtype.element_ty), mask=ok)
    if ALIGN:
        _group_pairs(
            ids, pair.to(tl.int32), ok, work_ptr, table_ptr, block_expert_ids_ptr,
            block_slots_ptr, block_rows_ptr, num_rows_padded_ptr, num_experts, table_stride,
            EXPERTS_P2, BLOCK_M, loaded_expert_ids_ptr, loaded_slots_ptr, loaded_rows_ptr,
            loaded_rows_padded_ptr, LOADED_M,
        )  # fmt: skip


@triton.jit
def _group_pairs(
    ids,
    pair,
    ok,
    work_ptr,
    table_ptr,
    block_expert_ids_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_rows_padded_ptr,
    num_experts,
    table_stride,
    EXPERTS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    loaded_expert_ids_ptr,
    loaded_slots_ptr,
    loaded_rows_ptr,
    loaded_rows_padded_ptr,
    LOADED_M: tl.constexpr,
):
    """Group this program's pairs by expert; the last program to finish labels the row blocks.

    ``work`` holds a count per expert and, after them, a count of finished
    programs; it is all zero on entry and left so.  A pair's atomic bump of
    its expert's count is its slot in that expert's row of ``table``
    (``table_stride`` slots a row, the step's token count), so the pairs need
    no second pass.  The program that finishes last (its bump of the program
    count returns the grid size less one; the bumps are acquire-release, so
    every other program's slots are visible to it) takes the counts, zeroes
    them, and gives each expert ``ceil(count / BLOCK_M)`` row blocks in expert
    order: for block ``b`` its expert, its first slot in ``table`` and how many
    of its ``BLOCK_M`` rows hold pairs.  The GEMMs stop at the padded row
    count, so blocks past it are never read.  Slots within an expert's row
    follow the atomics' order, which the GEMMs' results do not depend on (each
    row is computed alone and written back by pair index).

    ``LOADED_M > 0``: an expert of more than ``BLOCK_M`` pairs takes
    ``ceil(count / LOADED_M)`` blocks of ``LOADED_M`` rows in the ``loaded_*``
    arrays instead (``AlignedRouting.loaded``), the others one ``BLOCK_M`` block.
    """
    slot = tl.atomic_add(work_ptr + ids, 1, mask=ok)
    tl.store(table_ptr + ids.to(tl.int64) * table_stride + slot, pair, mask=ok)
    tl.debug_barrier()  # every thread's slots are written before the program counts itself done
    finished = tl.atomic_add(work_ptr + EXPERTS_P2, 1)
    if finished == tl.num_programs(0) - 1:
        experts = tl.arange(0, EXPERTS_P2)
        real = experts < num_experts
        counts = tl.atomic_xchg(work_ptr + experts, tl.zeros([EXPERTS_P2], tl.int32), mask=real)
        counts = tl.where(real, counts, 0)
        if LOADED_M > 0:
            loaded = tl.where(counts > BLOCK_M, (counts + LOADED_M - 1) // LOADED_M, 0)
            _label_blocks(
                experts, counts, loaded, table_stride, loaded_expert_ids_ptr, loaded_slots_ptr,
                loaded_rows_ptr, loaded_rows_padded_ptr, LOADED_M,
            )  # fmt: skip
            blocks = ((counts > 0) & (counts <= BLOCK_M)).to(tl.int32)
        else:
            blocks = (counts + BLOCK_M - 1) // BLOCK_M
        _label_blocks(
            experts, counts, blocks, table_stride, block_expert_ids_ptr, block_slots_ptr,
            block_rows_ptr, num_rows_padded_ptr, BLOCK_M,
        )  # fmt: skip
        tl.atomic_xchg(work_ptr + EXPERTS_P2, 0)


@triton.jit
def _label_blocks(
    experts, counts, blocks, table_stride, block_expert_ids_ptr, block_slots_ptr,
    block_rows_ptr, num_rows_padded_ptr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Expert ``e``'s ``blocks[e]`` row blocks of ``BLOCK_M`` rows, in expert order: for each
    its expert, its first slot in the table and how many of its rows hold pairs."""
    first = tl.cumsum(blocks, 0) - blocks
    tl.store(num_rows_padded_ptr, tl.sum(blocks, 0) * BLOCK_M)
    for j in range(0, tl.max(blocks, 0)):
        has = j < blocks
        tl.store(block_expert_ids_ptr + first + j, experts, mask=has)
        tl.store(block_slots_ptr + first + j, experts * table_stride + j * BLOCK_M, mask=has)
        rows = tl.minimum(counts - j * BLOCK_M, BLOCK_M)
        tl.store(block_rows_ptr + first + j, rows, mask=has)


def launch_shape(experts_p2: int) -> tuple[int, int]:
    """(rows a program, warps) of ``_route_kernel`` for a power-of-two expert count.

    One row, one warp: swept on the H200 (``benchmarks/routing.py --sweep``, T=256)
    it was the fastest shape for 64 and 128 experts, 7.5 and 7.8 us against 14.2
    and 46.5 for 16 rows on 4 warps (cross-warp reductions and the sort network's
    layout changes cost barriers; one warp needs none).
    """
    return 1, max(1, experts_p2 // 128)


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    *,
    renormalize: bool = False,
    scaling: float | None = None,
    weights_dtype: torch.dtype = torch.float32,
    capture: torch.Tensor | None = None,
    capture_weights: torch.Tensor | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights in ``weights_dtype``, int32 ids, float32 weights) of ``[T, E]`` router logits.

    ``scoring``: ``"softmax_topk"`` (softmax over all experts, top-k, then
    ``renormalize`` over the k) or ``"topk_softmax"`` (softmax over the k
    largest logits).  ``scaling`` multiplies the float32 weights before the
    cast (DeepSeek's ``routed_scaling_factor``).  ``capture``/``capture_weights``,
    ``[T, k]`` views with unit column stride, receive the ids and the weights
    (from ``weights_dtype``), as the capturer's copy would write them.
    ``rows``/``num_warps`` override ``launch_shape`` (for benchmarks).
    """
    weights, ids, weights_f32, _ = _route(
        logits, top_k, scoring, renormalize=renormalize, scaling=scaling,
        weights_dtype=weights_dtype, capture=capture, capture_weights=capture_weights,
        rows=rows, num_warps=num_warps,
    )  # fmt: skip
    return weights, ids, weights_f32


def grouping_work(num_experts: int, device: torch.device) -> torch.Tensor:
    """The zeroed counters ``route_and_align`` needs (it leaves them zeroed): one a layer
    keeps for its calls saves the per-call clearing."""
    return torch.zeros(triton.next_power_of_2(num_experts) + 1, dtype=torch.int32, device=device)


def route_and_align(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    block_m: int,
    *,
    renormalize: bool = False,
    scaling: float | None = None,
    weights_dtype: torch.dtype = torch.float32,
    capture: torch.Tensor | None = None,
    capture_weights: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    loaded_block_m: int | None = None,
) -> FusedRouting:
    """``route``, and in the same launch the pairs grouped by expert in ``block_m``-row
    blocks for the GEMMs (``_group_pairs``; the layout ``AlignedRouting`` calls a table).

    ``work``: ``grouping_work``'s counters, left zeroed by every call; by default
    fresh ones each call.  Two calls must not share them at the same time.
    ``loaded_block_m``: experts of more than ``block_m`` pairs get blocks of this
    many rows of their own (``AlignedRouting.loaded``).
    """
    if work is None:
        work = grouping_work(logits.shape[1], logits.device)
    weights, ids, weights_f32, aligned = _route(
        logits, top_k, scoring, renormalize=renormalize, scaling=scaling,
        weights_dtype=weights_dtype, capture=capture, capture_weights=capture_weights,
        group=(block_m, work, loaded_block_m),
    )  # fmt: skip
    return FusedRouting(weights, ids, weights_f32, aligned)


def _loaded_args(loaded: AlignedRouting | None) -> dict:
    """The routing kernel's arguments for the loaded experts' blocks (none: not labelled)."""
    if loaded is None:
        return {}
    return dict(
        loaded_expert_ids_ptr=loaded.block_expert_ids,
        loaded_slots_ptr=loaded.block_slots,
        loaded_rows_ptr=loaded.block_rows,
        loaded_rows_padded_ptr=loaded.num_rows_padded,
        LOADED_M=loaded.block_m,
    )


def _route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    *,
    renormalize: bool,
    scaling: float | None,
    weights_dtype: torch.dtype,
    capture: torch.Tensor | None,
    capture_weights: torch.Tensor | None,
    rows: int | None = None,
    num_warps: int | None = None,
    group: tuple[int, torch.Tensor, int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AlignedRouting | None]:
    """``route``'s launch; ``group`` (block_m, work counters, loaded experts' block_m)
    also groups the pairs."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; have {sorted(SCORINGS)}")
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= min(num_experts, SORT_SLOTS):
        raise ValueError(
            f"top_k {top_k} does not fit {num_experts} experts (at most {SORT_SLOTS.value})"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    shape = (num_tokens, top_k)
    check_capture_views(shape, capture, capture_weights)
    device = logits.device
    ids = torch.empty(shape, dtype=torch.int32, device=device)
    weights = torch.empty(shape, dtype=weights_dtype, device=device)
    weights_f32 = (
        weights if weights_dtype == torch.float32 else torch.empty_like(ids, dtype=torch.float32)
    )
    experts_p2 = triton.next_power_of_2(num_experts)
    block_m, work, loaded_block_m = group if group is not None else (1, ids, None)
    aligned = None
    if group is not None:
        if work.dtype != torch.int32 or work.numel() != experts_p2 + 1 or work.device != device:
            raise ValueError(f"grouping counters must be int32 [{experts_p2 + 1}] on {device}")
        aligned = AlignedRouting.table_for(
            num_tokens, top_k, num_experts, block_m, device, loaded_block_m
        )
    if num_tokens == 0:
        if aligned is not None:
            aligned.num_rows_padded.zero_()
            if aligned.loaded is not None:
                aligned.loaded.num_rows_padded.zero_()
        return weights, ids, weights_f32, aligned
    # Triton's interpreter runs programs one by one: 16 rows a program there keeps the
    # CPU tests quick, and a row's results do not depend on its program's other rows.
    default_rows, default_warps = launch_shape(experts_p2) if logits.is_cuda else (16, 4)
    rows = rows or default_rows
    # Without grouping its pointers are never read: ``ids`` stands in for each.
    table = aligned or AlignedRouting(ids, ids, ids, block_m, ids, ids)
    _route_kernel[(triton.cdiv(num_tokens, rows),)](
        logits,
        ids,
        weights,
        weights_f32,
        ids if capture is None else capture,
        weights if capture_weights is None else capture_weights,
        num_tokens,
        num_experts,
        logits.stride(0),
        0 if capture is None else capture.stride(0),
        0 if capture_weights is None else capture_weights.stride(0),
        1.0 if scaling is None else float(scaling),
        TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        EXPERTS_P2=experts_p2,
        ROWS=rows,
        SCORING=SCORINGS[scoring],
        RENORMALIZE=renormalize,
        SCALE=scaling is not None,
        CAPTURE=capture is not None,
        CAPTURE_WEIGHTS=capture_weights is not None,
        LIBDEVICE=logits.is_cuda,
        WARP=min(experts_p2, 32),
        K_WARP=min(triton.next_power_of_2(top_k), 32),
        work_ptr=work,
        table_ptr=table.sorted_pair_ids,
        block_expert_ids_ptr=table.block_expert_ids,
        block_slots_ptr=table.block_slots,
        block_rows_ptr=table.block_rows,
        num_rows_padded_ptr=table.num_rows_padded,
        table_stride=num_tokens,
        ALIGN=group is not None,
        BLOCK_M=block_m,
        **_loaded_args(table.loaded),
        num_warps=num_warps or default_warps,
    )
    return weights, ids, weights_f32, aligned
