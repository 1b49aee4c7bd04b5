"""Host-to-device input copies that never block the host.

A copy from ordinary (pageable) host memory makes CUDA wait for the stream
before it starts, which would stall asynchronous scheduling at every step.
Inputs are therefore packed into one pinned buffer per step and moved with a
single non-blocking copy.  The pinned buffers form a ring; a slot is reused
only after its copy has finished (its event), never while the device reads it.
"""

from __future__ import annotations

import numpy as np
import torch


class StagingRing:
    def __init__(self, capacity: int, device: torch.device, slots: int = 3) -> None:
        self.device = device
        self.capacity = capacity
        self._pinned = device.type == "cuda"
        self._host = [
            torch.empty(capacity, dtype=torch.int64, pin_memory=self._pinned) for _ in range(slots)
        ]
        self._events = [torch.cuda.Event() if self._pinned else None for _ in range(slots)]
        self._next = 0

    def stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy the arrays to the device in one go; returns int64 device views in the same order."""
        total = sum(a.size for a in arrays)
        if total > self.capacity:
            self.capacity = total
            self._host = [
                torch.empty(total, dtype=torch.int64, pin_memory=self._pinned) for _ in self._host
            ]
        slot = self._next
        self._next = (slot + 1) % len(self._host)
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        host = self._host[slot]
        view = host.numpy()
        offset = 0
        spans = []
        for a in arrays:
            view[offset : offset + a.size] = a.reshape(-1)
            spans.append((offset, a.size, a.shape))
            offset += a.size
        if not self._pinned:
            device_buffer = host[:total].clone()
        else:
            device_buffer = host[:total].to(self.device, non_blocking=True)
            event.record()
        return [device_buffer[o : o + n].view(shape) for o, n, shape in spans]
