"""Request state as the scheduler sees it.

A request's tokens are its prompt followed by what it generated.  The engine
tracks how many of them have been run through the model
(``num_computed_tokens``); everything else (what to schedule, when to sample,
which rows exist) follows from that count and ``num_tokens``.
"""

from __future__ import annotations

import enum

from moetrace.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputes from its tokens
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    """One prompt moving through the engine."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        index: int = 0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.index = index
        self.sampling = sampling
        self.eos_token_ids = () if sampling.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = frozenset(sampling.stop_token_ids) | frozenset(self.eos_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still on the device: scheduled, not yet known on the host.
        self.num_placeholders = 0
        self.num_cached_tokens = (
            -1
        )  # prompt tokens served by the prefix cache, set on first schedule
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.status = RequestStatus.WAITING

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens including those still being sampled on the device."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def awaiting_last_token(self) -> bool:
        """Its final token is already being sampled: nothing more to schedule."""
        return self.num_output_tokens + self.num_placeholders >= self.sampling.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Mark the request finished if its last token ends it."""
        if self.num_output_tokens == 0:
            return False
        if self.token_ids[-1] in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= self.sampling.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
