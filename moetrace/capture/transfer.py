"""Moves a step's routing rows from the device to the host without stalling the GPU.

On CUDA the copy runs on its own stream, which waits on the compute stream
through an event, into a pinned ring slot; the host waits only on the copy's
event, and only when the scheduler stores the rows.  A slot stays held from
its copy until its rows were stored, so a step launched while an earlier
step's rows are still unread takes another slot: with asynchronous
scheduling two steps are in flight, and a ring of one slot grows to two
rather than overwrite rows nobody has read.  On the CPU it is a plain copy.
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
        dtype: torch.dtype = torch.int32,
    ) -> None:
        self.device = device
        self._shape = (max_num_tokens, num_moe_layers, top_k)
        self._dtype = dtype
        self._next = 0
        self._cuda = device.type == "cuda"
        self._ring: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event] = []
        self._held: list[bool] = []
        if self._cuda:
            for _ in range(max(1, ring_size)):
                self._add_slot()
            self._copy_stream = torch.cuda.Stream(device=device)
            self._last_copy: torch.cuda.Event | None = None

    def _add_slot(self) -> int:
        self._ring.append(torch.empty(self._shape, dtype=self._dtype, pin_memory=True))
        self._done.append(torch.cuda.Event())
        self._held.append(False)
        return len(self._ring) - 1

    def _take_slot(self) -> int:
        """The next slot whose rows were stored; a new one when every slot is still held."""
        size = len(self._ring)
        for i in range(size):
            slot = (self._next + i) % size
            if not self._held[slot]:
                break
        else:
            slot = self._add_slot()
        self._next = (slot + 1) % len(self._ring)
        self._held[slot] = True
        return slot

    def _release(self, slot: int) -> None:
        self._held[slot] = False

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
        slot = self._take_slot()
        host = self._ring[slot]
        done = self._done[slot]
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            host[:n].copy_(tensors.routing, non_blocking=True)
            done.record(self._copy_stream)
        self._last_copy = done
        return RoutedExpertsLists(
            host[:n].numpy(), slots, slot_epochs, done.synchronize, lambda: self._release(slot)
        )
