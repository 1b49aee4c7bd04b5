"""Routed experts: router selection functions and the experts' computation.

Selection functions return ``(weights, ids)`` with ids in router order
(descending score), exactly as the reference implementation of each family
picks them; the ids are what the trace records.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then top-k (Qwen-MoE, OLMoE, DeepSeek-V2 greedy)."""
    probs = F.softmax(
        router_logits,
        dim=-1,
        dtype=torch.float32 if router_logits.dtype != torch.float64 else torch.float64,
    )
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


class MoEExperts(nn.Module):
    """Expert weights stacked per layer: gate and up fused, then down.

    ``w13[e]`` is ``[gate; up]`` of expert ``e`` (``2 * intermediate`` rows),
    ``w2[e]`` its down projection.  The plain path loops over the experts that
    got tokens; on CUDA the fused kernel serves.
    """

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.activation = activation
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.use_triton = False

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from moetrace.kernels.triton_moe import moe_forward

            return moe_forward(x, self.w13, self.w2, weights, ids, activation=self.activation)
        return self.forward_torch(x, weights, ids)

    def forward_torch(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        act = ACTIVATIONS[self.activation]
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            h = F.linear(act(gate) * up, self.w2[expert])
            out.index_add_(0, tokens, h * weight_of[start : start + count, None].to(h.dtype))
            start += count
        return out
