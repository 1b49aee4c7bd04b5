"""What crosses the boundary between the forward pass and the scheduler side.

``RoutedExpertsTensors`` is the device side of one step: views into the
capturer's static buffer and the step's slot mapping.  ``RoutedExpertsLists``
is the host side: numpy arrays the scheduler may read once ``wait()`` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch


class RoutedExpertsTensors(NamedTuple):
    routing: torch.Tensor  # [num_tokens, num_moe_layers, top_k] in the capture dtype, router order
    num_tokens: int
    weights: torch.Tensor | None = None  # [num_tokens, num_moe_layers, top_k], ids' order


class RoutedExpertsLists(NamedTuple):
    routing: np.ndarray  # [num_tokens, num_moe_layers, top_k]
    slots: np.ndarray  # int64 [num_tokens]: KV slot of each token
    slot_epochs: np.ndarray  # int64 [num_tokens]: epoch of the slot's block when scheduled
    wait: Callable[[], None]  # blocks until ``routing`` holds the step's rows
    release: Callable[[], None] = lambda: None  # the rows were stored: their buffer may be reused
    weights: np.ndarray | None = None  # [num_tokens, num_moe_layers, top_k], when captured
