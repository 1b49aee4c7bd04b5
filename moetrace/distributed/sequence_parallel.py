"""Sequence-parallel MoE: each rank routes a slice of the step's tokens; capture gathers them.

A step's ``T`` tokens are split ceil-div over the ``N`` ranks: rank ``r`` owns
rows ``[r*c, (r+1)*c)`` with ``c = ceil(T / N)``, the input padded with zero
rows to ``N * c``.  So the last ranks may own padding only (5 tokens over 2
ranks: 3 + 2 and one pad row; 1 token over 2: rank 1 owns nothing real).

The capturer all-gathers every rank's ids (int32), and gate weights (float32)
when they are captured, into static scratch buffers, rank after rank, and
copies the first ``T`` rows -- the padding rows dropped -- into the capture
buffers, so every rank ends with the full step's
rows in token order.  ``T`` comes from the MoE block's hook, never guessed
from shapes: with one token the local chunk looks like a whole step (the bug
vllm-ascend#15451 describes).  All ranks run the same ops on the same shapes,
so a captured graph would be the same on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrace.capture.capturer import RoutingCapturer
from moetrace.distributed.state import Collectives, SequenceParallelContext


def chunk_size(num_tokens: int, size: int) -> int:
    return -(-num_tokens // size)


def local_rows(num_tokens: int, size: int, rank: int) -> range:
    """The real (not padding) token rows rank ``rank`` routes."""
    c = chunk_size(num_tokens, size)
    start = min(rank * c, num_tokens)
    return range(start, min(start + c, num_tokens))


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (padding routes harmlessly and is dropped)."""
    missing = rows - x.shape[0]
    if missing == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, missing))


def split_rows(x: torch.Tensor, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's ``[c, ...]`` chunk, the whole input padded to ``[size * c, ...]``)."""
    c = chunk_size(x.shape[0], size)
    padded = pad_rows(x, size * c)
    return padded[rank * c : (rank + 1) * c], padded


def gather_token_rows(
    local: torch.Tensor, num_tokens: int, comm: Collectives, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """All ranks' chunks in token order, padding dropped: ``[num_tokens, ...]``.

    ``scratch`` (at least ``size * c`` rows, contiguous) receives the gather
    in place, so the result stays in one static buffer under a CUDA graph.
    """
    out = None if scratch is None else scratch[: comm.size * local.shape[0]]
    return comm.all_gather_rows(local, out)[:num_tokens]


class SequenceParallelCapturer(RoutingCapturer):
    """A capturer whose layers hand it only their rank's chunk of ids.

    Shares the buffer of the capturer it wraps (the one the model runner
    copies rows from), so nothing downstream changes.
    """

    def __init__(
        self, inner: RoutingCapturer, comm: Collectives, context: SequenceParallelContext
    ) -> None:
        # No super().__init__: the buffers are the wrapped capturer's, not new ones.
        self.buffer = inner.buffer
        self.weights = inner.weights
        self.comm = comm
        self.context = context
        max_tokens, _, top_k = self.buffer.shape
        rows = comm.size * chunk_size(max_tokens, comm.size)
        device = self.buffer.device
        self._gathered = torch.empty((rows, top_k), dtype=torch.int32, device=device)
        self._gathered_weights = (
            None
            if self.weights is None
            else torch.empty((rows, top_k), dtype=torch.float32, device=device)
        )

    def record(self, moe_layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        n = self.context.num_tokens
        rows = gather_token_rows(topk_ids.to(torch.int32), n, self.comm, self._gathered)
        self.buffer[:n, moe_layer].copy_(rows)
        if self.weights is not None:
            local = topk_weights.to(torch.float32)
            weights = gather_token_rows(local, n, self.comm, self._gathered_weights)
            self.weights[:n, moe_layer].copy_(weights)
