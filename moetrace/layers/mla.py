"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

The cache holds what the reference caches: per token, the normalised KV
latent (``kv_lora_rank``) and the rotated key part shared by all heads
(``qk_rope_head_dim``) — 576 values for V2/V3 instead of 2 × heads × 192 —
packed in one row of one cache tensor per layer.

On the GPU the Triton kernels (``kernels/triton_mla.py``) serve every step in
latent space (``kv_b_proj`` absorbed into the query and the output), except
that in large steps (``EXPAND_MIN_TOKENS``, mostly prompt tokens) the
sequences with prompt tokens run through keys and values expanded from their
gathered context (one expansion GEMM, then 192-wide scores instead of
576-wide) as long as their contexts fit buffers of the step's token count.
The choice depends on the step's padded size alone, so a step computes the
same eagerly and replayed from a CUDA graph.

The plain-torch path (CPU, float64, and the reference the kernels are tested
against) expands each sequence's cached latents as the reference's
``expand_kv`` does and runs eager attention with the reference's dtypes; its
decode-only steps can instead run all sequences at once in latent space (the
same attention, rounded differently), which it does on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.forward_context import AttentionMetadata, get_attention_metadata
from moetrace.layers.attention import PagedAttention
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import _yarn_mscale

Rope = Callable[[torch.Tensor], torch.Tensor]  # [tokens, heads, rope_dim] → rotated, same shape

# Bound on one score tensor (heads × queries × keys): longer prefills run in query chunks.
MAX_SCORE_ELEMENTS = 1 << 28
# Steps of this many tokens or more (padded) run prompt tokens through the expanded form: they
# are mostly prompt tokens (at most max_num_seqs decodes), so its GEMM over the step's rows is
# not spent on decodes.  Not measured yet: ``benchmarks/tune.py mla``'s prefill rows decide.
EXPAND_MIN_TOKENS = 2048


@dataclass(frozen=True)
class MLADims:
    hidden: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


def mla_softmax_scale(qk_dim: int, rope: dict) -> float:
    """``qk_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under scaled rope.

    The reference applies this for any non-default rope type with a non-zero
    ``mscale_all_dim``, so YaRN's attention factor reaches the logits twice
    (through cos/sin and through this scale).
    """
    scale = qk_dim**-0.5
    kind = rope.get("rope_type", rope.get("type", "default"))
    mscale_all_dim = rope.get("mscale_all_dim") or 0
    if kind not in ("default", None) and mscale_all_dim:
        m = _yarn_mscale(rope["factor"], mscale_all_dim)
        scale = scale * m * m
    return scale


class LatentCache(PagedAttention):
    """One layer's paged store of packed latents: ``cache [blocks, block_size, rank + rope]``."""

    def __init__(self, dims: MLADims, scale: float) -> None:
        super().__init__(dims.num_heads, 1, dims.kv_lora_rank + dims.rope_dim, scale)
        self.dims = dims
        self.cache = torch.empty(0)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, self.head_dim)]

    def bind_kv_cache(self, caches: Sequence[torch.Tensor]) -> None:
        (self.cache,) = caches

    def store(self, latent: torch.Tensor, k_rot: torch.Tensor, slots: torch.Tensor) -> None:
        """latent [T, kv_lora_rank], k_rot [T, rope_dim] into their slots."""
        packed = torch.cat([latent, k_rot], dim=-1).to(self.cache.dtype)
        self.cache.view(-1, self.head_dim).index_copy_(0, slots, packed)

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [..., rank + rope] as (latent, k_rot) views."""
        return rows.split([self.dims.kv_lora_rank, self.dims.rope_dim], dim=-1)

    def gather(self, blocks: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [s, kv_lora_rank], k_rot [s, rope_dim]) of one sequence's first s tokens."""
        return self.split_rows(self.cache[blocks].reshape(-1, self.head_dim)[:seq_len])

    def gather_batch(self, tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [B, S, kv_lora_rank], k_rot [B, S, rope_dim]) for S = max_len rounded up to
        whole blocks; positions past a sequence's length hold whatever those slots hold."""
        blocks = tables[:, : -(-max_len // self.cache.shape[1])].long()
        return self.split_rows(self.cache[blocks].reshape(blocks.shape[0], -1, self.head_dim))


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's attention: low-rank q (optional), a compressed shared KV latent, split rope.

    Submodule names follow the checkpoint (``q_proj`` or ``q_a_proj`` /
    ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``).  The two low-rank norms use eps 1e-6 whatever
    ``rms_norm_eps`` says: the reference builds them with its default.
    """

    def __init__(self, dims: MLADims, scale: float, *, bias: bool) -> None:
        super().__init__()
        self.dims = dims
        d = dims
        if d.q_lora_rank is None:
            self.q_proj = nn.Linear(d.hidden, d.num_heads * d.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d.hidden, d.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(d.q_lora_rank, d.num_heads * d.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d.hidden, d.kv_lora_rank + d.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, d.num_heads * (d.nope_dim + d.v_dim), bias=False)
        self.o_proj = nn.Linear(d.num_heads * d.v_dim, d.hidden, bias=bias)
        self.attn = LatentCache(dims, scale)
        self.absorbed_decode: bool | None = None  # plain path; None: on CUDA only
        # Kernel path: steps of at least this many tokens run the expanded form (None: never).
        self.expand_min_tokens: int | None = EXPAND_MIN_TOKENS

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        d, t = self.dims, x.shape[0]
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, d.num_heads, d.qk_dim).split([d.nope_dim, d.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = rope(k_rot.reshape(t, 1, d.rope_dim)).view(t, d.rope_dim)
        q_rot = rope(q_rot)
        meta = get_attention_metadata()
        if self.attn.use_triton and x.dtype != torch.float64:  # no float64 Triton dots
            out = self._attend_kernels(q_nope, q_rot, latent, k_rot, meta)
            return self.o_proj(out.reshape(t, d.num_heads * d.v_dim))
        query = torch.cat([q_nope, q_rot], dim=-1)
        self.attn.store(latent, k_rot, meta.slot_mapping)
        absorbed = x.is_cuda if self.absorbed_decode is None else self.absorbed_decode
        if absorbed and meta.is_decode_only:
            out = self._decode_absorbed(query, meta.block_tables, meta.seq_lens, meta.max_seq_len)
            return self.o_proj(out.reshape(t, d.num_heads * d.v_dim))
        out = torch.empty(t, d.num_heads, d.v_dim, dtype=x.dtype, device=x.device)
        starts = meta.query_start_loc_host
        for b, seq_len in enumerate(meta.seq_lens_host):
            q0, q1 = starts[b], starts[b + 1]
            blocks = meta.block_tables[b, : -(-seq_len // meta.block_size)].long()
            keys, values = self._expand(*self.attn.gather(blocks, seq_len))
            out[q0:q1] = self._attend(query[q0:q1], keys, values)
        return self.o_proj(out.reshape(t, d.num_heads * d.v_dim))

    def _attend_kernels(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention output [T, H, v_dim] through the Triton kernels.

        Latent space for every sequence, except, in a step that runs the expanded
        form (``_expands``), the multi-query sequences whose contexts fit its
        buffers: it overwrites their rows.
        """
        from moetrace.kernels import triton_mla

        d, t = self.dims, q_nope.shape[0]
        cache = self.attn.cache
        triton_mla.store_latent(latent, k_rot, cache, meta.slot_mapping)
        w = self.kv_b_proj.weight.view(d.num_heads, d.nope_dim + d.v_dim, d.kv_lora_rank)
        w_uk, w_uv = w.split([d.nope_dim, d.v_dim], dim=1)
        expansion = None
        if self._expands(meta, q_nope):
            expansion = triton_mla.expand_context(
                cache, meta, self.kv_b_proj.weight, d.num_heads, num_rows=t
            )
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, r]
        out_latent = torch.empty_like(q_latent)
        triton_mla.absorbed_attention(
            q_latent.transpose(0, 1),
            q_rot,
            cache,
            meta,
            self.attn.scale,
            out=out_latent.transpose(0, 1),
            expansion=expansion,
        )
        out = torch.bmm(out_latent, w_uv.transpose(1, 2))  # [H, T, v]
        if expansion is not None:
            triton_mla.expanded_attention(
                q_nope, q_rot, expansion, meta, self.attn.scale, out.transpose(0, 1)
            )
        return out.transpose(0, 1)

    def _expands(self, meta: AttentionMetadata, q: torch.Tensor) -> bool:
        """Whether this step runs the expanded form: by its token count alone, so a step
        runs the same kernels eagerly and replayed from a graph (where the expansion GEMM is
        captured too), and only if it may hold prompt tokens."""
        if self.expand_min_tokens is None or q.shape[0] < self.expand_min_tokens:
            return False
        return meta.max_query_len > 1

    def _expand(
        self, latent: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [H, s, qk_dim] and values [H, s, v_dim] from cached latents."""
        d, s = self.dims, latent.shape[0]
        kv = self.kv_b_proj(latent).view(s, d.num_heads, d.nope_dim + d.v_dim).transpose(0, 1)
        k_nope, values = kv.split([d.nope_dim, d.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rot[None].expand(d.num_heads, -1, -1)], dim=-1)
        return keys, values

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Causal eager attention of a sequence's last q_len queries; scores in the model
        dtype, softmax in float32 (float64 stays float64), as the reference."""
        q_len, seq_len = q.shape[0], keys.shape[1]
        heads = self.dims.num_heads
        out = torch.empty(q_len, heads, self.dims.v_dim, dtype=q.dtype, device=q.device)
        step = max(1, MAX_SCORE_ELEMENTS // max(1, heads * seq_len))
        softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        for c0 in range(0, q_len, step):
            c1 = min(q_len, c0 + step)
            scores = torch.matmul(q[c0:c1].transpose(0, 1), keys.transpose(1, 2)) * self.attn.scale
            q_pos = torch.arange(seq_len - q_len + c0, seq_len - q_len + c1, device=q.device)
            scores = scores.masked_fill(k_pos > q_pos[:, None], float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=softmax_dtype).to(values.dtype)
            out[c0:c1] = torch.matmul(probs, values).transpose(0, 1)
        return out

    def _decode_absorbed(
        self, query: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int
    ) -> torch.Tensor:
        """One query per sequence, all sequences together, attending in latent space.

        ``q_nope · (W_uk c)`` is computed as ``(q_nope W_uk) · c`` and the
        output ``Σ p (W_uv c)`` as ``W_uv Σ p c``, so no key or value is expanded.
        """
        d = self.dims
        latent, k_rot = self.attn.gather_batch(tables, max_len)  # [B, S, r], [B, S, rope]
        w = self.kv_b_proj.weight.view(d.num_heads, d.nope_dim + d.v_dim, d.kv_lora_rank)
        w_uk, w_uv = w.split([d.nope_dim, d.v_dim], dim=1)
        q_nope, q_rot = query.split([d.nope_dim, d.rope_dim], dim=-1)  # [B, H, ·]
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        scores = torch.matmul(q_latent, latent.transpose(1, 2))
        scores = (scores + torch.matmul(q_rot, k_rot.transpose(1, 2))) * self.attn.scale
        past_end = torch.arange(latent.shape[1], device=query.device)[None, :] >= seq_lens[:, None]
        latent = latent.masked_fill(past_end[..., None], 0.0)  # stale slots may hold anything
        scores = scores.masked_fill(past_end[:, None, :], float("-inf"))
        softmax_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        probs = F.softmax(scores, dim=-1, dtype=softmax_dtype).to(latent.dtype)
        out_latent = torch.matmul(probs, latent)  # [B, H, r]
        return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)
