"""Grouping a step's (token, expert) pairs by expert for the fused-MoE GEMMs.

Each expert's pairs fill a group padded to the GEMM's ``BLOCK_M`` rows, so a
row block of the GEMM serves one expert.  Sizes are bounded statically by
``T*k + min(E, T*k) * (BLOCK_M - 1)`` rows: no host sync, CUDA-graph safe.
``align_routing`` does it in two launches: a counting program, then an
atomic scatter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class AlignedRouting(NamedTuple):
    """Pairs grouped by expert, each expert's group padded to ``block_m`` rows.

    Two layouts.  Sorted (``align_routing``): row ``r`` of the GEMMs holds pair
    ``sorted_pair_ids[r]``, ``num_pairs`` marking padding.  Table (the fused
    routing kernel, ``kernels/triton_routing.py``): ``sorted_pair_ids`` is a
    ``[E, T]`` table, expert ``e``'s pairs in its row, and row block ``b``
    holds the ``block_rows[b]`` pairs from slot ``block_slots[b]`` on.

    ``loaded`` (table layout, optional): the experts with more than ``block_m``
    pairs are not in these blocks but in ``loaded``'s, of ``loaded.block_m``
    rows over the same table, for GEMMs of their own tile (each weight decoded
    once for up to that many pairs; ``kernels/triton_moe.py``).
    """

    sorted_pair_ids: torch.Tensor  # int32 [P]: pair index t*k+j, or num_pairs for padding
    block_expert_ids: torch.Tensor  # int32 [P // block_m]: expert of each row block
    num_rows_padded: torch.Tensor  # int32 [1]: rows in use (the rest of P is unused)
    block_m: int
    block_slots: torch.Tensor | None = None  # int32 [P // block_m], table layout only
    block_rows: torch.Tensor | None = None  # int32 [P // block_m], table layout only
    loaded: AlignedRouting | None = None  # the loaded experts' blocks (see above)

    @property
    def num_blocks(self) -> int:
        """Row blocks the GEMMs launch for (those past ``num_rows_padded`` return at once)."""
        return self.block_expert_ids.numel()

    @property
    def is_table(self) -> bool:
        return self.block_slots is not None

    @property
    def table_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_slots, block_rows) as the GEMM kernels take them; in the sorted layout
        a real int32 tensor twice, never read (their ``PAIR_TABLE`` switch is off)."""
        if self.is_table:
            return self.block_slots, self.block_rows
        return self.block_expert_ids, self.block_expert_ids

    @classmethod
    def table_for(
        cls,
        num_tokens: int,
        top_k: int,
        num_experts: int,
        block_m: int,
        device: torch.device,
        loaded_block_m: int | None = None,
    ) -> AlignedRouting:
        """Uninitialised table-layout buffers for ``num_tokens`` tokens' pairs, one allocation;
        with ``loaded_block_m``, the loaded experts' blocks too (``loaded``)."""
        pairs = num_tokens * top_k
        if loaded_block_m is None:
            blocks = padded_rows_bound(pairs, num_experts, block_m) // block_m
            loaded_blocks = 0
        else:  # one block an expert of up to block_m pairs; the others' blocks apart
            blocks = min(num_experts, pairs)
            loaded = min(num_experts, pairs // (block_m + 1))
            loaded_blocks = padded_rows_bound(pairs, loaded, loaded_block_m) // loaded_block_m
        table = num_experts * num_tokens
        work = torch.empty(
            table + 3 * (blocks + loaded_blocks) + 2, dtype=torch.int32, device=device
        )
        table_ids, work = work[:table], work[table:]

        def blocks_of(n: int, m: int, rest: torch.Tensor) -> AlignedRouting:
            return cls(
                table_ids,
                rest[:n],
                rest[3 * n : 3 * n + 1],
                m,
                rest[n : 2 * n],
                rest[2 * n : 3 * n],
            )

        main = blocks_of(blocks, block_m, work)
        if loaded_block_m is None:
            return main
        rest = work[3 * blocks + 1 :]
        return main._replace(loaded=blocks_of(loaded_blocks, loaded_block_m, rest))


def padded_rows_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the padded row count: each non-empty expert adds < block_m rows."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


# The planning kernel's rows a store step, and at most how many programs share its work.
_PLAN_CHUNK = 1024
_PLAN_PROGRAMS = 8


class AlignWork(NamedTuple):
    """An alignment's outputs and its per-expert cursor, carved from one int32 allocation,
    with the arguments the planning kernel (``_align_plan_kernel``) takes."""

    ids: torch.Tensor
    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    cursor: torch.Tensor
    num_rows_padded: torch.Tensor
    num_experts: int
    block_m: int

    @classmethod
    def allocate(cls, ids: torch.Tensor, num_experts: int, block_m: int) -> AlignWork:
        rows = padded_rows_bound(ids.numel(), num_experts, block_m)
        num_blocks = rows // block_m
        experts_p2 = triton.next_power_of_2(num_experts)
        work = torch.empty(rows + num_blocks + experts_p2 + 1, dtype=torch.int32, device=ids.device)
        return cls(
            ids,
            work[:rows],
            work[rows : rows + num_blocks],
            work[rows + num_blocks : rows + num_blocks + experts_p2],
            work[-1:],
            num_experts,
            block_m,
        )

    def plan_args(self) -> tuple:
        """The planning kernels' leading arguments, in their order."""
        rows = self.sorted_pair_ids.numel()
        return (
            self.ids,
            self.cursor,
            self.block_expert_ids,
            self.num_rows_padded,
            self.sorted_pair_ids,
            self.ids.numel(),
            self.num_experts,
            rows // self.block_m,
            rows,
        )

    def plan_meta(self) -> dict:
        """The planning kernels' shared compile-time arguments and launch width."""
        experts_p2 = self.cursor.numel()
        return {
            "BLOCK_M": self.block_m,
            "EXPERTS_P2": experts_p2,
            "BLOCK_B": max(16, 8192 // experts_p2),
            "num_warps": 8,
        }

    def plan_programs(self) -> int:
        """Planning programs: one a chunk of rows to mark, up to ``_PLAN_PROGRAMS``."""
        return max(1, min(_PLAN_PROGRAMS, triton.cdiv(self.sorted_pair_ids.numel(), _PLAN_CHUNK)))

    def aligned(self) -> AlignedRouting:
        return AlignedRouting(
            self.sorted_pair_ids, self.block_expert_ids, self.num_rows_padded, self.block_m
        )


# Sizes that follow the step's token count are not specialised on (divisibility by 16,
# equality to 1): each step size would otherwise compile its own variant mid-run.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "num_rows"])
def _align_plan_kernel(
    ids_ptr,
    cursor_ptr,
    block_expert_ids_ptr,
    num_rows_padded_ptr,
    sorted_pair_ids_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    num_rows,
    BLOCK_M: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Count pairs per expert, lay out padded groups, label row blocks.

    Every program counts all pairs (at decode 2-8 K ids, cheaper than a second
    launch to share the counts) and then does its share of the rest: every
    ``num_programs``-th row block gets its expert (``num_experts`` past the
    end), every ``num_programs``-th chunk of rows the padding marker.  Program
    0 also writes each expert's first padded row to ``cursor`` (the scatter
    kernel bumps it per pair) and the used row count.
    """
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        idx = start + offs
        ok = idx < num_pairs
        e = tl.load(ids_ptr + idx, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(e, EXPERTS_P2, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if pid == 0:
        experts = tl.arange(0, EXPERTS_P2)
        tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_experts)
        tl.store(num_rows_padded_ptr, tl.sum(padded, 0))
    offs_b = tl.arange(0, BLOCK_B)
    for start in range(pid * BLOCK_B, num_blocks, programs * BLOCK_B):
        blk = start + offs_b
        # Expert of a block = how many groups end at or before its first row.
        owner = tl.sum((ends[None, :] <= (blk * BLOCK_M)[:, None]).to(tl.int32), 1)
        owner = tl.minimum(owner, num_experts)
        tl.store(block_expert_ids_ptr + blk, owner, mask=blk < num_blocks)
    for start in range(pid * CHUNK, num_rows, programs * CHUNK):
        idx = start + offs
        tl.store(
            sorted_pair_ids_ptr + idx, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=idx < num_rows
        )


@triton.jit(do_not_specialize=["num_pairs", "stride_capture", "stride_capture_weights"])
def _align_scatter_kernel(
    ids_ptr,
    cursor_ptr,
    sorted_pair_ids_ptr,
    capture_ptr,
    weights_ptr,
    capture_weights_ptr,
    num_pairs,
    stride_capture,
    stride_capture_weights,
    TOP_K: tl.constexpr,
    CAPTURE: tl.constexpr,
    CAPTURE_WEIGHTS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Each pair takes the next free row of its expert's group (atomic cursor).

    The order inside a group is therefore arbitrary, but the GEMMs compute each
    row independently and write it back by pair index, so results are
    bit-identical whatever the order.  With ``CAPTURE`` the ids it reads anyway
    also go to the routing capture buffer (``[T, k]`` rows ``stride_capture``
    apart, in its dtype), which saves the capture a launch per MoE layer; with
    ``CAPTURE_WEIGHTS`` the pairs' gate weights go to theirs the same way.
    """
    idx = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = idx < num_pairs
    e = tl.load(ids_ptr + idx, mask=ok, other=0)
    row = tl.atomic_add(cursor_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=ok)
    tl.store(sorted_pair_ids_ptr + row, idx.to(tl.int32), mask=ok)
    token = (idx // TOP_K).to(tl.int64)
    if CAPTURE:
        dst = capture_ptr + token * stride_capture + idx % TOP_K
        tl.store(dst, e.to(capture_ptr.dtype.element_ty), mask=ok)
    if CAPTURE_WEIGHTS:
        w = tl.load(weights_ptr + idx, mask=ok, other=0.0)
        dst = capture_weights_ptr + token * stride_capture_weights + idx % TOP_K
        tl.store(dst, w.to(capture_weights_ptr.dtype.element_ty), mask=ok)


def check_capture_views(
    shape: tuple[int, ...], capture: torch.Tensor | None, capture_weights: torch.Tensor | None
) -> None:
    """Capture views must be ``shape`` (the ids' ``[T, k]``) with adjacent columns."""
    for view, what in ((capture, "capture"), (capture_weights, "weights capture")):
        if view is not None and (tuple(view.shape) != tuple(shape) or view.stride(1) != 1):
            raise ValueError(f"{what} view {tuple(view.shape)} does not fit ids {tuple(shape)}")


def align_routing(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    capture: torch.Tensor | None = None,
    *,
    topk_weights: torch.Tensor | None = None,
    capture_weights: torch.Tensor | None = None,
) -> AlignedRouting:
    """Group the (token, expert) pairs by expert into ``block_m``-padded groups.

    Two Triton launches and one allocation: the torch-op version
    (``align_routing_torch``) took ~280 us of launches per call on the H200
    machine; this one 23 us eager / 14 us in a graph at T=256, and 89 us at
    T=8192 x top-8, where the single counting program dominates (the part to
    parallelise if prefill ever needs it).  Sizes depend on T, k, E and
    block_m alone, so it is CUDA-graph safe.  ``capture``, a ``[T, k]`` view
    with unit column stride, also receives the ids (see the scatter kernel);
    ``capture_weights``, likewise, receives ``topk_weights``.
    """
    ids = topk_ids.contiguous()
    check_capture_views(ids.shape, capture, capture_weights)
    if capture_weights is not None:
        if topk_weights is None or topk_weights.shape != ids.shape:
            raise ValueError("a weights capture needs the [T, k] weights")
        topk_weights = topk_weights.contiguous()
    num_pairs = ids.numel()
    work = AlignWork.allocate(ids, num_experts, block_m)
    _align_plan_kernel[(work.plan_programs(),)](
        *work.plan_args(), CHUNK=_PLAN_CHUNK, **work.plan_meta()
    )
    chunk = 256
    sorted_pair_ids = work.sorted_pair_ids
    _align_scatter_kernel[(triton.cdiv(num_pairs, chunk),)](
        ids,
        work.cursor,
        sorted_pair_ids,
        sorted_pair_ids if capture is None else capture,
        sorted_pair_ids if capture_weights is None else topk_weights,
        sorted_pair_ids if capture_weights is None else capture_weights,
        num_pairs,
        0 if capture is None else capture.stride(0),
        0 if capture_weights is None else capture_weights.stride(0),
        TOP_K=ids.shape[-1] if ids.dim() == 2 else 1,
        CAPTURE=capture is not None,
        CAPTURE_WEIGHTS=capture_weights is not None,
        CHUNK=chunk,
        num_warps=4,
    )
    return work.aligned()


def align_routing_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """The same layout from torch ops (stable: token order inside a group); for tests."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    rows = padded_rows_bound(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    count_start = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_pair_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return AlignedRouting(
        sorted_pair_ids, block_expert_ids, padded_end[-1:].to(torch.int32), block_m
    )
