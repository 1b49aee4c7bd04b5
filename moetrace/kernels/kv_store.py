"""The plain-torch write of new keys and values into the paged KV cache.

Beside the Triton kernels because it is their CPU counterpart, their fallback
and their benchmark baseline; the attention layers call it on the plain path.
"""

from __future__ import annotations

import torch


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` (``[T, Hkv, D]``) into their caches at ``slot_mapping``."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
