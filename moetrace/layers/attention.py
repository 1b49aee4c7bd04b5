"""Attention over the paged KV cache.

New keys and values are written to their slots first; then each query reads
every key of its sequence up to its own position through the block table.  On
CUDA the Triton kernels do both; elsewhere a plain-torch path does, one
sequence at a time, as the reference the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.forward_context import AttentionMetadata, get_attention_metadata
from moetrace.kernels.kv_store import store_kv_torch


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries over their sequences' cached keys.

    Matches the reference models' eager attention: scores in the model dtype,
    softmax in float32 (float64 stays float64).  With sinks (gpt-oss) it rounds
    as that family's eager attention does: the row max, sink included, is
    subtracted in the model dtype and the softmax returns the model dtype.
    """
    num_heads = query.shape[1]
    kv_heads, head_dim = k_cache.shape[-2:]
    group = num_heads // kv_heads
    block_size = meta.block_size
    out = torch.empty_like(query)
    starts = meta.query_start_loc_host
    for b, seq_len in enumerate(meta.seq_lens_host):
        q0, q1 = starts[b], starts[b + 1]
        q_len = q1 - q0
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[b, :num_blocks].long()
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len]
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len]
        q = query[q0:q1].transpose(0, 1)  # [H, q, D]
        k = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, s, D]
        v = values.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q, s]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        softmax_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        if sinks is not None:
            sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q_len, 1)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.amax(dim=-1, keepdim=True)
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        else:
            probs = F.softmax(scores, dim=-1, dtype=softmax_dtype)
        out[q0:q1] = torch.matmul(probs.to(v.dtype), v).transpose(0, 1)
    return out


class PagedAttention(nn.Module):
    """The attention core of one layer: owns nothing but a view of its KV cache."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.sinks: torch.Tensor | None = None  # [num_heads] logits (gpt-oss), set by the family
        self.use_triton = False  # set by the model runner when the kernels serve this layer

    def kv_cache_shape(self) -> tuple[int, int]:
        """Per token: (KV heads, head dim) of the K cache and of the V cache."""
        return self.num_kv_heads, self.head_dim

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The cache tensors this layer keeps, which the engine allocates: K and V."""
        shape = (num_blocks, block_size, *self.kv_cache_shape())
        return [shape, shape]

    def bind_kv_cache(self, caches: Sequence[torch.Tensor]) -> None:
        """Point the layer at tensors of ``kv_cache_shapes`` (in that order)."""
        self.k_cache, self.v_cache = caches

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] → [T, H, D]."""
        meta = get_attention_metadata()
        if self.use_triton:
            from moetrace.kernels.triton_attention import store_kv
        else:
            store_kv = store_kv_torch
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D] → [T, H, D], the step's keys and values already in the cache
        (``forward`` stores them; a fused kernel may have, ``kernels/triton_qkv.py``)."""
        meta = get_attention_metadata()
        if self.use_triton:
            from moetrace.kernels.triton_attention import paged_attention as attend
        else:
            attend = paged_attention_torch
        return attend(
            q,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
        )
