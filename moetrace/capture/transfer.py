"""Moves a step's routing rows from the device to the host without stalling the GPU.

On CUDA, right after the forward, the compute stream copies the step's rows
into a device staging slot (a few kilobytes, in stream order, so the next
forward may overwrite the capture buffer at once); a dedicated copy stream
waits on that copy through an event and moves the slot into a pinned host
slot.  The host waits only on the copy's event, and only when the scheduler
stores the rows.  A slot stays held from its copy until its rows were
stored, and is reused only after that wait, so neither stream ever waits
for the other's latest work: with asynchronous scheduling two steps are in
flight, and a ring of one slot grows to two rather than overwrite rows
nobody has read.  On the CPU it is a plain copy.  Gate weights, when
captured, ride in the same slot: one more staging copy and one more D2H
copy under the same two events.

(The first version had the copy stream read the capture buffer itself and
made each forward wait for the previous step's copy; on the H200, side by
side, dropping that wait moved OLMoE-1B-7B's capture on/off ratio from
0.991 to 0.997.)
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
        weights_dtype: torch.dtype | None = None,
    ) -> None:
        self.device = device
        self._shape = (max_num_tokens, num_moe_layers, top_k)
        # What one slot holds: the ids, and the gate weights when they are captured.
        self._dtypes = [dtype] if weights_dtype is None else [dtype, weights_dtype]
        self._next = 0
        self._cuda = device.type == "cuda"
        self._ring: list[list[torch.Tensor]] = []  # pinned host slots
        self._stage: list[list[torch.Tensor]] = []  # device slots, one per host slot
        self._staged: list[torch.cuda.Event] = []
        self._done: list[torch.cuda.Event] = []
        self._held: list[bool] = []
        if self._cuda:
            for _ in range(max(1, ring_size)):
                self._add_slot()
            self._copy_stream = torch.cuda.Stream(device=device)

    def _add_slot(self) -> int:
        self._ring.append(
            [torch.empty(self._shape, dtype=d, pin_memory=True) for d in self._dtypes]
        )
        self._stage.append(
            [torch.empty(self._shape, dtype=d, device=self.device) for d in self._dtypes]
        )
        self._staged.append(torch.cuda.Event())
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

    def start(
        self, tensors: RoutedExpertsTensors, slots: np.ndarray, slot_epochs: np.ndarray
    ) -> RoutedExpertsLists:
        """Begin the copy of one step's rows; returns host views valid after ``wait()``."""
        n = tensors.num_tokens
        sources = (
            [tensors.routing] if tensors.weights is None else [tensors.routing, tensors.weights]
        )
        if len(sources) != len(self._dtypes):
            raise RuntimeError("the capturer and the transfer disagree on capturing weights")
        if not self._cuda:
            # A copy: the next step may overwrite the buffer before these rows are stored.
            host = [t.numpy().copy() for t in sources]
            return RoutedExpertsLists(
                host[0], slots, slot_epochs, _no_wait, weights=host[1] if len(host) > 1 else None
            )
        slot = self._take_slot()  # free: its last copy to the host was waited for
        stage = [t[:n] for t in self._stage[slot]]
        host = [t[:n] for t in self._ring[slot]]
        done = self._done[slot]
        for dst, src in zip(stage, sources, strict=True):
            dst.copy_(src)  # compute stream, before the next forward can overwrite
        staged = self._staged[slot]
        staged.record()
        self._copy_stream.wait_event(staged)
        with torch.cuda.stream(self._copy_stream):
            for dst, src in zip(host, stage, strict=True):
                dst.copy_(src, non_blocking=True)
            done.record(self._copy_stream)
        views = [t.numpy() for t in host]
        return RoutedExpertsLists(
            views[0],
            slots,
            slot_epochs,
            done.synchronize,
            lambda: self._release(slot),
            weights=views[1] if len(views) > 1 else None,
        )
