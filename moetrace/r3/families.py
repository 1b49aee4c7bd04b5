"""Where each transformers MoE family keeps its router, and how it weighs given experts.

Routing replay keeps the router's own scores and replaces only its choice:
the weights of the replayed experts follow the family's rule, as Megatron's
``RouterReplay`` gathers its scores at the replayed ids (docs/r3.md):
softmax over every expert then gather (renormalised where the family
renormalises), softmax over the gathered logits where the family picks
before its softmax, DeepSeek-V3's unbiased sigmoid (its correction bias only
selects), PhiMoE's sparsemixer with the replayed pair in place of its picks;
each family's scaling factor after.  The rules are moetrace's own engine
rules (``layers/moe.py``), which its parity tests hold to transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moetrace.layers.moe import sigmoid_weights, softmax_weights, topk_softmax_weights
from moetrace.models.phimoe import sparsemixer_weights

# (router module, router logits [N, E], ids [N, k]) -> weights [N, k]
WeightRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# (router module, router logits [N, E]) -> the scores it ranks experts by [N, E]
SelectionScore = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _renormalised_softmax(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    return softmax_weights(logits, ids, renormalize=bool(getattr(router, "norm_topk_prob", False)))


def _mixtral(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    return softmax_weights(logits, ids, renormalize=True)


def _deepseek_v2(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    # Transformers' DeepseekV2 ignores norm_topk_prob: softmax shares, scaled.
    return softmax_weights(logits, ids, renormalize=False) * router.routed_scaling_factor


def _deepseek_v3(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    weights = sigmoid_weights(logits, ids, renormalize=bool(router.norm_topk_prob))
    return weights * router.routed_scaling_factor


def _softmax_of_gathered(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    return topk_softmax_weights(logits, ids)


def _sparsemixer(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    return sparsemixer_weights(logits, ids, float(router.router_jitter_noise))


def _probabilities(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


def _biased_sigmoid(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits.double()) + router.e_score_correction_bias.double()


@dataclass(frozen=True)
class Family:
    """One transformers MoE family, as its modeling file (transformers 5.x) builds it."""

    model_type: str
    # Attribute path from a decoder layer to its router (dense layers have none).
    router_path: tuple[str, ...]
    router_class: str
    weights: WeightRule
    # Where the router returns its ids unsorted (``topk(sorted=False)``), the score that
    # puts a recorded row in router order (highest first); None: already sorted.
    unsorted_by: SelectionScore | None = None
    experts_attr: str = "experts"


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "qwen3_moe",
            ("mlp", "gate"),
            "Qwen3MoeTopKRouter",
            _renormalised_softmax,
        ),
        Family(
            "qwen2_moe",
            ("mlp", "gate"),
            "Qwen2MoeTopKRouter",
            _renormalised_softmax,
        ),
        Family(
            "olmoe",
            ("mlp", "gate"),
            "OlmoeTopKRouter",
            _renormalised_softmax,
        ),
        Family(
            "mixtral",
            ("mlp", "gate"),
            "MixtralTopKRouter",
            _mixtral,
        ),
        Family(
            "deepseek_v2",
            ("mlp", "gate"),
            "DeepseekV2TopkRouter",
            _deepseek_v2,
            unsorted_by=_probabilities,
        ),
        Family(
            "deepseek_v3",
            ("mlp", "gate"),
            "DeepseekV3TopkRouter",
            _deepseek_v3,
            unsorted_by=_biased_sigmoid,
        ),
        Family(
            "gpt_oss",
            ("mlp", "router"),
            "GptOssTopKRouter",
            _softmax_of_gathered,
        ),
        Family(
            "granitemoe",
            ("block_sparse_moe", "router"),
            "GraniteMoeTopKRouter",
            _softmax_of_gathered,
        ),
        Family(
            "phimoe",
            ("mlp", "router"),
            "PhimoeTopKRouter",
            _sparsemixer,
        ),
    )
}
