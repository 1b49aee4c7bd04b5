"""Writes each MoE layer's top-k ids into one static device buffer during the forward.

The buffer never moves, and each layer writes ``buffer[:n, layer]`` in place,
so a captured CUDA graph replays the writes.  Nothing here touches the host.
"""

from __future__ import annotations

import torch

from moetrace.capture.types import RoutedExpertsTensors


class RoutingCapturer:
    def __init__(
        self, max_num_tokens: int, num_moe_layers: int, top_k: int, device: torch.device
    ) -> None:
        self.buffer = torch.zeros(
            (max_num_tokens, num_moe_layers, top_k), dtype=torch.int32, device=device
        )

    @property
    def num_moe_layers(self) -> int:
        return self.buffer.shape[1]

    def record(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        """Store one layer's selection for the step's tokens (rows in token order)."""
        self.buffer[: topk_ids.shape[0], moe_layer].copy_(topk_ids)

    def tensors(self, num_tokens: int) -> RoutedExpertsTensors:
        return RoutedExpertsTensors(self.buffer[:num_tokens], num_tokens)
