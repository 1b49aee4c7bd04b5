"""Sequence-parallel capture, directly: uneven ceil-div splits gathered back into token order.

Two gloo processes; each routes only its chunk of a step's tokens (padding
rows filled with a marker that must never reach the buffer), and the
capturer must leave every rank with the step's full rows, in int32, in token
order, the rows past the step untouched.  The split arithmetic is checked
without processes for more ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from moetrace.capture.capturer import RoutingCapturer
from moetrace.distributed.sequence_parallel import (
    SequenceParallelCapturer,
    chunk_size,
    gather_token_rows,
    local_rows,
    split_rows,
)

LAYERS, TOP_K, MAX_TOKENS = 3, 2, 16
PAD = 99  # ids of padding rows: must be dropped
UNTOUCHED = -7  # the buffer's rows past the step keep this


def expected_ids(num_tokens: int) -> torch.Tensor:
    """A step's ids, [T, L, k]: distinct per token, layer and rank."""
    t = torch.arange(num_tokens)[:, None, None]
    return (t * 100 + torch.arange(LAYERS)[None, :, None] * 10 + torch.arange(TOP_K)).to(
        torch.int64
    )


def _rank(rank: int, world: int, rendezvous: str) -> None:
    from moetrace.distributed.state import ParallelConfig
    from moetrace.engine.launch import init_group, leave_group

    torch.set_num_threads(1)
    state = init_group(
        ParallelConfig(world, sequence_parallel_moe=True), rank, rank, "cpu", rendezvous
    )
    try:
        comm, context = state.comm, state.sp
        for num_tokens in (1, 2, 3, 5, 8, 16):
            full = expected_ids(num_tokens)
            c = chunk_size(num_tokens, world)
            mine = local_rows(num_tokens, world, rank)
            local = torch.full((c, LAYERS, TOP_K), PAD, dtype=torch.int64)
            local[: len(mine)] = full[mine.start : mine.stop]

            # The bare gather: int32 and int64, into a scratch buffer and without one.
            for dtype in (torch.int32, torch.int64):
                rows = gather_token_rows(local[:, 0].to(dtype), num_tokens, comm)
                assert torch.equal(rows, full[:, 0].to(dtype)), (num_tokens, dtype)
            scratch = torch.empty((world * chunk_size(MAX_TOKENS, world), TOP_K), dtype=torch.int32)
            rows = gather_token_rows(local[:, 1].to(torch.int32), num_tokens, comm, scratch)
            assert rows.data_ptr() == scratch.data_ptr()
            assert torch.equal(rows, full[:, 1].to(torch.int32))

            # The capturer, as the MoE layers call it: the block hook has set the token count.
            # Gate weights (here the ids / 1000) are gathered the same way.
            for weights_dtype in (None, torch.float16):
                inner = RoutingCapturer(
                    MAX_TOKENS, LAYERS, TOP_K, torch.device("cpu"), weights_dtype=weights_dtype
                )
                inner.buffer.fill_(UNTOUCHED)
                capturer = SequenceParallelCapturer(inner, comm, context)
                context.num_tokens = num_tokens
                for layer in range(LAYERS):
                    capturer.record(layer, local[:, layer], local[:, layer] / 1000)
                assert capturer.buffer is inner.buffer
                assert inner.buffer.dtype == torch.int32
                got = inner.tensors(num_tokens)
                assert torch.equal(got.routing, full.to(torch.int32)), num_tokens
                assert (inner.buffer[num_tokens:] == UNTOUCHED).all()
                assert not (inner.buffer == PAD).any()
                if weights_dtype is None:
                    assert got.weights is None
                else:
                    assert torch.equal(got.weights, (full / 1000).to(weights_dtype)), num_tokens
    finally:
        leave_group()


def test_sequence_parallel_gather_with_uneven_splits(tmp_path):
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2)


@pytest.mark.parametrize(
    "num_tokens,world,rows",
    [
        (5, 2, [range(0, 3), range(3, 5)]),
        (1, 2, [range(0, 1), range(1, 1)]),
        (2, 4, [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]),
        (7, 3, [range(0, 3), range(3, 6), range(6, 7)]),
        (6, 3, [range(0, 2), range(2, 4), range(4, 6)]),
    ],
)
def test_split_arithmetic(num_tokens, world, rows):
    assert [local_rows(num_tokens, world, r) for r in range(world)] == rows
    x = torch.arange(num_tokens * 2, dtype=torch.float64).view(num_tokens, 2) + 1
    chunks = [split_rows(x, world, r)[0] for r in range(world)]
    c = chunk_size(num_tokens, world)
    assert all(chunk.shape == (c, 2) for chunk in chunks)
    padded = torch.cat(chunks)
    assert torch.equal(padded[:num_tokens], x) and (padded[num_tokens:] == 0).all()
