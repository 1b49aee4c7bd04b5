"""Moves a step's routing rows from the device to the host without stalling the GPU.

On CUDA the copy runs on its own stream, which waits on the compute stream
through an event, into a pinned ring slot; the host waits only on the copy's
event, and only when the scheduler stores the rows.  One ring slot per step in
flight, so a slot is never overwritten before its rows were stored.  On the CPU
it is a plain copy.
"""

from __future__ import annotations

import numpy as np
import torch

from moetrace.capture.types import RoutedExpertsLists, RoutedExpertsTensors


def _no_wait() -> None:
    return None


class RoutingTransfer:
    def __init__(
        self,
        max_num_tokens: int,
        num_moe_layers: int,
        top_k: int,
        device: torch.device,
        *,
        ring_size: int = 2,
    ) -> None:
        self.device = device
        self.ring_size = ring_size
        self._next = 0
        self._cuda = device.type == "cuda"
        if self._cuda:
            shape = (max_num_tokens, num_moe_layers, top_k)
            self._ring = [
                torch.empty(shape, dtype=torch.int32, pin_memory=True) for _ in range(ring_size)
            ]
            self._done = [torch.cuda.Event() for _ in range(ring_size)]
            self._copy_stream = torch.cuda.Stream(device=device)
            self._last_copy: torch.cuda.Event | None = None

    def fence_before_forward(self) -> None:
        """Make the next forward wait (on the device) until the capture buffer was read."""
        if self._cuda and self._last_copy is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_copy)

    def start(
        self, tensors: RoutedExpertsTensors, slots: np.ndarray, slot_epochs: np.ndarray
    ) -> RoutedExpertsLists:
        """Begin the copy of one step's rows; returns host views valid after ``wait()``."""
        n = tensors.num_tokens
        if not self._cuda:
            # A copy: the next step may overwrite the buffer before these rows are stored.
            return RoutedExpertsLists(tensors.routing.numpy().copy(), slots, slot_epochs, _no_wait)
        slot = self._next
        self._next = (self._next + 1) % self.ring_size
        host = self._ring[slot]
        done = self._done[slot]
        # The slot's previous copy must be consumed before it is reused.
        done.synchronize()
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            host[:n].copy_(tensors.routing, non_blocking=True)
            done.record(self._copy_stream)
        self._last_copy = done
        return RoutedExpertsLists(host[:n].numpy(), slots, slot_epochs, done.synchronize)
