"""Writes each MoE layer's top-k ids into one static device buffer during the forward.

The buffer never moves, and each layer writes ``buffer[:n, layer]`` in place,
so a captured CUDA graph replays the writes.  Nothing here touches the host.

The buffer holds the trace's own id dtype where it can (uint8 up to 256
experts), so the copy to the host moves a quarter of the bytes and the host
stores rows without converting them.  Where the fused-MoE kernel serves a
layer, that kernel writes the ids itself (``in_kernel``): the ids it reads to
group tokens by expert go to ``destination()`` in the same launch, instead of
one extra copy kernel per layer per step.

Gate weights (``record --record-weights``) get a second buffer of the same
shape in the stored weight dtype, written the same way (by the same kernel
launch where the kernel serves); without them nothing is allocated, copied
or launched for weights.
"""

from __future__ import annotations

import numpy as np
import torch

from moetrace.capture.types import RoutedExpertsTensors
from moetrace.trace.metadata import expert_id_dtype


def weights_capture_dtype(name: str | None) -> torch.dtype | None:
    """The device dtype the gate weights are captured in: the trace's own ("float16"/"float32")."""
    return None if name is None else {"float16": torch.float16, "float32": torch.float32}[name]


def capture_dtype(num_experts: int) -> torch.dtype:
    """The trace's id dtype where it is uint8, else int32 (torch's uint16 lacks the ops a copy needs)."""
    return torch.uint8 if expert_id_dtype(num_experts) == np.uint8 else torch.int32


class RoutingCapturer:
    in_kernel = False  # set by the model runner when the fused-MoE kernels may write

    def __init__(
        self,
        max_num_tokens: int,
        num_moe_layers: int,
        top_k: int,
        device: torch.device,
        dtype: torch.dtype = torch.int32,
        weights_dtype: torch.dtype | None = None,
    ) -> None:
        shape = (max_num_tokens, num_moe_layers, top_k)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.weights = (
            None
            if weights_dtype is None
            else torch.zeros(shape, dtype=weights_dtype, device=device)
        )

    @property
    def num_moe_layers(self) -> int:
        return self.buffer.shape[1]

    def record(self, moe_layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Store one layer's selection for the step's tokens (rows in token order).

        ``topk_weights`` is what the experts' outputs are multiplied by, in the
        ids' order; kept only when the capturer has a weights buffer.
        """
        n = topk_ids.shape[0]
        self.buffer[:n, moe_layer].copy_(topk_ids)
        if self.weights is not None:
            self.weights[:n, moe_layer].copy_(topk_weights)

    def destination(self, moe_layer: int, num_tokens: int) -> torch.Tensor:
        """Where a kernel writes one layer's ``[num_tokens, top_k]`` ids."""
        return self.buffer[:num_tokens, moe_layer]

    def weights_destination(self, moe_layer: int, num_tokens: int) -> torch.Tensor | None:
        """Where a kernel writes one layer's ``[num_tokens, top_k]`` weights (None: not kept)."""
        return None if self.weights is None else self.weights[:num_tokens, moe_layer]

    def tensors(self, num_tokens: int) -> RoutedExpertsTensors:
        weights = None if self.weights is None else self.weights[:num_tokens]
        return RoutedExpertsTensors(self.buffer[:num_tokens], num_tokens, weights)
