"""Per-step forward context: what attention needs to find each token's KV.

The model runner builds one ``AttentionMetadata`` per step and installs it with
``forward_context``; attention layers and kernels read it with
``get_attention_metadata`` instead of having it threaded through every module
call.  All device tensors are built before the forward so that nothing inside
it needs the host.

It sits at the bottom of the package, beside nothing it depends on, so that
the layers and kernels that read it never import the engine that fills it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where the step's tokens sit in the paged KV cache.

    Tokens of all scheduled sequences are packed one after another
    (``query_start_loc`` gives each sequence's range).  A sequence's new tokens
    are its last ``q_len`` tokens: query ``i`` of sequence ``b`` is at position
    ``seq_lens[b] - q_len_b + i`` and attends to keys ``0..that position``.
    """

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]: tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0 (row stride: below)
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, for the plain-torch path (never read inside a CUDA graph).
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # The shortest query in the step (1 when unknown, as in a captured graph).
    min_query_len: int = 1
    # int32 [1] on the device: the block tables' row stride, when the step packs
    # them at a width of its own (padded steps); None means block_tables.stride(0).
    block_table_stride: torch.Tensor | None = None
    # Device tensors a kernel derives from the step's own tensors once per forward (the
    # first layer to need one computes it, inside the graph when captured); by name.
    derived: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Make ``meta`` visible to attention layers for the duration of one forward."""
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside a forward_context")
    return _current
