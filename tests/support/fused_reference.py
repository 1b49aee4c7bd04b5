"""The unfused kernel sequences the fused small kernels replace, and inputs to check them on.

Shared by ``test_triton_fused_norms.py`` (CPU interpreter or CUDA, small
shapes) and ``test_gpu_fused_small.py`` (CUDA, the target models' shapes).
Each reference runs exactly what the layers ran before the fusion: torch's
add, ``rms_norm`` (the Triton norm), the rotary kernel (bfloat16) or the
torch expression (float16), ``store_kv``.
"""

from __future__ import annotations

import torch

from moetrace.forward_context import AttentionMetadata, forward_context
from moetrace.kernels.triton_attention import store_kv
from moetrace.kernels.triton_norm import rms_norm, rotary
from moetrace.layers.rotary import RotaryEmbedding


def fixed_order_sum(rows: torch.Tensor) -> torch.Tensor:
    """``rows [T, k, H]`` added in float32 in row order, rounded once: the fused sum's rule."""
    acc = rows[:, 0].float()
    for j in range(1, rows.shape[1]):
        acc = acc + rows[:, j].float()
    return acc.to(rows.dtype)


def unfused_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    extra: torch.Tensor | None = None,
    weight_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual): the top-k sum (in the fused kernel's order), ``+ extra``,
    torch's add, ``rms_norm`` (gpt-oss's with ``weight_in_float32``)."""
    out = x if x.dim() == 2 else fixed_order_sum(x)
    if extra is not None:
        out = out + extra
    new_residual = residual + out
    normed = rms_norm(new_residual, weight, eps, weight_in_float32=weight_in_float32)
    return normed, new_residual


def unfused_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norm: str | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """``FusedQKVAttention``'s kernel path before the fusion: norms, rotary, KV store; q back."""
    t, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    if norm == "full":
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q = q.reshape(t, num_heads, d)
    k = k.reshape(t, num_kv_heads, d)
    v = v.reshape(t, num_kv_heads, d)
    if norm == "head":
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    if qkv.dtype == torch.bfloat16:
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    else:
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slots)
    return q


def residual_inputs(
    tokens: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int,
    extra: bool = False,
    strided: bool = False,
) -> dict:
    """Random ``x`` (``[T, H]`` for top_k 0, else rows ``[T, k, H]``), residual, weight, extra.

    ``strided``: every tensor is a view with a row stride wider than its row.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        wide = (*shape[:-1], shape[-1] + (24 if strided else 0))
        full = (torch.randn(wide, generator=gen) * scale).to(device, dtype)
        return full[..., : shape[-1]]

    x = rand(tokens, hidden, scale=0.5) if top_k == 0 else rand(tokens, top_k, hidden, scale=0.2)
    return {
        "x": x,
        "residual": rand(tokens, hidden, scale=4.0),
        "weight": (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype),
        "extra": rand(tokens, hidden, scale=0.3) if extra else None,
    }


class QKVCase:
    """A fused projection, rotary angles and a poisoned paged cache with scattered slots."""

    def __init__(
        self,
        tokens: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        norm: str | None,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        seed: int,
        block_size: int = 16,
        strided: bool = True,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.norm = num_heads, num_kv_heads, norm
        width = (num_heads + 2 * num_kv_heads) * head_dim
        wide = torch.randn(tokens, width + (40 if strided else 0), generator=gen) * 2
        self.qkv = wide.to(device, dtype)[:, :width]
        rope = RotaryEmbedding(head_dim, 1_000_000.0).to(device)
        positions = torch.randint(0, 40_000, (tokens,), generator=gen).to(device)
        self.cos, self.sin = rope.cos_sin(positions, dtype)
        blocks = tokens // block_size + 3
        self.cache_shape = (blocks, block_size, num_kv_heads, head_dim)
        # Distinct slots anywhere in the cache; every fifth token is padding (-1).
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        slots[::5] = -1
        self.slots = slots.to(device)
        group = num_heads * head_dim if norm == "full" else head_dim
        kv_group = num_kv_heads * head_dim if norm == "full" else head_dim
        self.q_weight = self.k_weight = None
        if norm is not None:
            self.q_weight = (torch.rand(group, generator=gen) + 0.5).to(device, dtype)
            self.k_weight = (torch.rand(kv_group, generator=gen) + 0.5).to(device, dtype)
        self.eps = 1e-6
        self.device, self.dtype = device, dtype

    def poisoned_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches full of NaN: a slot written shows, one left alone stays NaN."""
        nan = torch.full(self.cache_shape, float("nan"), dtype=self.dtype, device=self.device)
        return nan, nan.clone()

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.poisoned_caches()
        q = unfused_qkv(
            self.qkv, self.num_heads, self.num_kv_heads, self.cos, self.sin,
            k_cache, v_cache, self.slots, self.norm, self.q_weight, self.k_weight, self.eps,
        )  # fmt: skip
        return q, k_cache, v_cache

    def fused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from moetrace.kernels.triton_qkv import qkv_rope_store

        k_cache, v_cache = self.poisoned_caches()
        norms = {}
        if self.norm is not None:
            norms = {
                "norm": self.norm,
                "q_weight": self.q_weight,
                "k_weight": self.k_weight,
                "q_eps": self.eps,
                "k_eps": self.eps,
            }
        q = qkv_rope_store(
            self.qkv, self.num_heads, self.num_kv_heads, self.cos, self.sin,
            k_cache, v_cache, self.slots, **norms,
        )  # fmt: skip
        return q, k_cache, v_cache


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two 16-bit tensors (NaN included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Counted:
    """Wraps a kernel launcher and counts its calls (and those given expert rows)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.rows = fn, 0, 0

    def __call__(self, x, *args, **kwargs):
        self.calls += 1
        self.rows += x.dim() == 3
        return self.fn(x, *args, **kwargs)


def two_steps(
    model, dtype: torch.dtype, device: torch.device | str, block_size: int = 4
) -> list[torch.Tensor]:
    """A 6-token prefill, then one decode token, over fresh paged caches: hidden states and
    caches, in order."""
    caches = []
    for layer in model.attention_layers():
        shapes = layer.kv_cache_shapes(8, block_size)
        bound = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        layer.bind_kv_cache(bound)
        caches += bound
    table = torch.tensor([[3, 1, 6, 0]], dtype=torch.int32, device=device)
    outs = []
    for start, count in ((0, 6), (6, 1)):
        pos = torch.arange(start, start + count, device=device)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([start + count], dtype=torch.int32, device=device),
            block_tables=table,
            max_query_len=count,
            max_seq_len=start + count,
            block_size=block_size,
            query_start_loc_host=[0, count],
            seq_lens_host=[start + count],
            min_query_len=count,
        )
        ids = (torch.arange(start, start + count, device=device) * 7 + 3) % model.vocab_size
        with torch.inference_mode(), forward_context(meta):
            outs.append(model(ids, pos))
    return outs + [c.clone() for c in caches]
