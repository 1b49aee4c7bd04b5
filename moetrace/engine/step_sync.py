"""Keeping the workers in step with rank 0: one host message per step, one device broadcast.

Rank 0 owns the scheduler.  For each step it sends the workers the step's
host inputs -- the ``StepPlan`` arrays and, under asynchronous scheduling,
which input tokens come from the previous step's samples -- over the gloo
cpu group, before it launches its own forward.  Every rank runs the same
forward (the all-reduces inside pair up in the same order); rank 0 samples
and broadcasts the sampled ids on the device, where a worker's next step
picks up its placeholder tokens without a host round trip.  A ``None``
message ends the workers' loop.

Between two steps rank 0 may send a ``ControlMessage`` instead: a trainer's
call that touches every rank's model (new weights, its update group, memory
release), which each worker carries out on its own slice
(``engine/model_control.py``) before it waits for the next message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from moetrace.capture.capturer import RoutingCapturer
from moetrace.distributed.sequence_parallel import SequenceParallelCapturer
from moetrace.distributed.state import ParallelState
from moetrace.engine.staging import StagingRing
from moetrace.engine.step_plan import StepPlan
from moetrace.forward_context import AttentionMetadata, forward_context

FillIndex = tuple[np.ndarray, np.ndarray]  # (token positions in the step, rows of previous samples)


class StepRunner(Protocol):
    """What a worker's step uses of its ``ModelRunner``: the model and the input staging."""

    model: nn.Module
    device: torch.device
    fill_staging: StagingRing

    def staged_inputs(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]: ...


@dataclass
class StepMessage:
    """One step's host inputs: rank 0's plan without its requests (workers hold none)."""

    plan: StepPlan
    fill: FillIndex | None

    @classmethod
    def of(cls, plan: StepPlan, fill: FillIndex | None) -> StepMessage:
        return cls(replace(plan, sampling_requests=[], requests=[]), fill)

    @property
    def num_sampled(self) -> int:
        return int(self.plan.logits_rows.shape[0])


@dataclass(frozen=True)
class ControlMessage:
    """A control call every rank carries out at this step boundary (a plain record), and how
    long a worker waits on the trainer's group for it."""

    call: Any
    timeout_s: float


def publish_step(state: ParallelState, plan: StepPlan, fill: FillIndex | None) -> None:
    """Rank 0: send the step to the workers before launching it."""
    state.comm.broadcast_object(StepMessage.of(plan, fill))


def share_sampled(state: ParallelState, sampled: torch.Tensor) -> None:
    """Rank 0: the step's sampled ids to every rank, on the device."""
    state.comm.broadcast_(sampled)


def end_steps(state: ParallelState) -> None:
    """Rank 0: release the workers from their loop."""
    state.comm.broadcast_object(None)


def wrap_capturer(capturer: RoutingCapturer | None, state: ParallelState) -> RoutingCapturer | None:
    """The capturer the MoE layers call: under sequence parallelism it gathers every rank's ids."""
    if capturer is None or not state.layout.sequence_parallel:
        return capturer
    return SequenceParallelCapturer(capturer, state.comm, state.sp)


@torch.inference_mode()
def run_worker_step(
    runner: StepRunner,
    state: ParallelState,
    message: StepMessage,
    previous_sampled: torch.Tensor | None,
) -> torch.Tensor | None:
    """A worker's share of one step; returns the step's sampled ids (None if it sampled none).

    The forward stops at the hidden states: rank 0 alone computes logits.
    """
    input_ids, positions, meta, _rows = runner.staged_inputs(message.plan)
    if message.fill is not None:
        if previous_sampled is None:
            raise RuntimeError("a step needs tokens that no step in flight is sampling")
        dst, src = runner.fill_staging.stage(list(message.fill))
        input_ids.index_copy_(0, dst, previous_sampled.index_select(0, src))
    with forward_context(meta):
        runner.model(input_ids, positions)
    if message.num_sampled == 0:
        return None
    sampled = torch.empty(message.num_sampled, dtype=torch.int64, device=runner.device)
    return state.comm.broadcast_(sampled)


def serve_steps(
    runner: StepRunner,
    state: ParallelState,
    on_control: Callable[[ControlMessage], None] | None = None,
) -> int:
    """A worker's loop: run each step rank 0 sends until it sends ``None``, and each control
    call with ``on_control``; returns the count of steps."""
    previous: torch.Tensor | None = None
    steps = 0
    while True:
        message = state.comm.broadcast_object()
        if message is None:
            return steps
        if isinstance(message, ControlMessage):
            if on_control is None:
                raise RuntimeError("rank 0 sent a control call to a worker that takes none")
            on_control(message)
            continue
        previous = run_worker_step(runner, state, message, previous)
        steps += 1
