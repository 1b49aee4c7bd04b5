"""Per-sequence routing as Megatron-LM's ``RouterReplay.set_replay_data`` takes it.

Megatron replays one ``[tokens, top_k]`` int64 tensor per MoE router, in the
order its routers were built, over the tokens of the micro-batch as the
router sees them.  For a packed (THD) batch those are the sequences one
after another, each padded to Megatron's alignment (the tensor-parallel
size with sequence parallelism, ``2 * TP * CP`` with context parallelism).
Rows the engines do not return (the last token's) and the padding repeat the
sequence's last row: a set the router accepts, whose output reaches only
positions the loss never reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moetrace.errors import MoetraceError
from moetrace.r3.layouts import as_sequences


def router_replay_indices(
    sequences: Sequence[object],
    *,
    num_tokens: Sequence[int] | None = None,
    pad_to_multiple: int = 1,
    moe_layer_indices: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """One ``[packed_tokens, top_k]`` int64 tensor per MoE layer for ``RouterReplay.set_replay_data``.

    ``sequences``: ``(rows, layers, top_k)`` arrays or trace requests, in the
    packed batch's order.  ``num_tokens``: each sequence's token count in the
    batch (default: its rows + 1, as engines return one row fewer).
    ``moe_layer_indices``: given with vLLM's layout (every hidden layer, dense
    ones zero), the layers to keep.  ``pad_to_multiple``: Megatron's per-sequence
    alignment of the packed batch.
    """
    if pad_to_multiple < 1:
        raise MoetraceError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    arrays = as_sequences(sequences)
    if not arrays:
        raise MoetraceError("router_replay_indices: no sequences")
    if num_tokens is not None and len(num_tokens) != len(arrays):
        raise MoetraceError(f"{len(num_tokens)} token counts for {len(arrays)} sequences")
    parts = []
    for i, rows in enumerate(arrays):
        if rows.ndim != 3 or rows.shape[0] == 0:
            raise MoetraceError(f"sequences[{i}]: expected (rows, layers, top_k), got {rows.shape}")
        if moe_layer_indices is not None and rows.shape[1] != len(moe_layer_indices):
            rows = rows[:, list(moe_layer_indices)]
        if parts and rows.shape[1:] != parts[0].shape[1:]:
            raise MoetraceError(f"sequences[{i}]: shape {rows.shape} unlike the first's")
        if rows.min() < 0:
            raise MoetraceError(f"sequences[{i}]: negative expert ids (missing rows)")
        tokens = rows.shape[0] + 1 if num_tokens is None else int(num_tokens[i])
        if not rows.shape[0] <= tokens <= rows.shape[0] + 1:
            raise MoetraceError(
                f"sequences[{i}]: {rows.shape[0]} rows for {tokens} tokens "
                "(want a row per token, or one fewer)"
            )
        padded = -(-tokens // pad_to_multiple) * pad_to_multiple
        fill = np.repeat(rows[-1:], padded - rows.shape[0], axis=0)
        parts.append(np.concatenate([rows, fill]))
    packed = torch.from_numpy(np.concatenate(parts).astype(np.int64))  # [tokens, layers, k]
    return [packed[:, layer].contiguous() for layer in range(packed.shape[1])]
