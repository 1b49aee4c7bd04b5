"""Continuous batching: which requests run how many tokens in the next step.

One rule covers prefill, chunked prefill and decode: a scheduled request runs
its next ``min(tokens - num_computed_tokens, budget)`` tokens.  Running
requests go first, in arrival order; then waiting ones, while the token budget,
the sequence limit and free KV blocks allow.  When a running request cannot get
a block, the most recently admitted running request is preempted: its blocks
are freed and it later recomputes from its tokens.

``schedule`` advances ``num_computed_tokens`` at once and counts a placeholder
for each token a step will sample, so the next step can be scheduled while
this one still runs on the device (asynchronous scheduling); ``update`` fills
the placeholders in when the sampled tokens arrive.  Preemption happens only
when nothing is in flight: the engine drains first (``needs_preemption``).
So a block is offered to the prefix cache as soon as a step is scheduled to
fill it: no step that would compute it is ever dropped, and a request
admitted in the same step (a prompt's ``n`` samples) already shares it.

Before any request's blocks are freed (finish, abort, preemption) the
``before_free`` callback runs, so the routing rows in those blocks can be saved
while they are still valid.

A scoring request (``Request.scoring``: teacher forcing) follows the same rule
over its given tokens but the last, samples nothing, and ends with the step
that ran its last chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moetrace.engine.block_manager import BlockManager
from moetrace.engine.logprob_columns import StepLogprobs
from moetrace.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_before: int
    samples: bool  # this step runs the request's last known token, so it yields a new one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens computed this step (prefill and its chunks; prefix hits are not)."""
        return sum(
            max(0, min(s.num_computed_before + s.num_new_tokens, s.request.num_prompt_tokens)
                - s.num_computed_before)
            for s in self.scheduled
        )  # fmt: skip

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        before_free: Callable[[Request], None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.before_free = before_free or (lambda request: None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.tokens_appended = 0  # sampled tokens kept (not those dropped after a request ended)
        self.weight_version: str | None = None  # the weights' label, stamped on each new token

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- schedule
    def _wants(self, request: Request) -> int:
        if request.scoring is not None:
            return request.num_tokens_to_compute - request.num_computed_tokens
        if request.awaiting_last_token:
            return 0
        return request.num_scheduled_tokens - request.num_computed_tokens

    def needs_preemption(self) -> bool:
        """Whether the running requests' next tokens need more blocks than are free."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        need = 0
        for request in self.running:
            n = min(self._wants(request), budget)
            budget -= n
            need += bm.blocks_needed(request, request.num_computed_tokens + n)
        return need > bm.num_free_blocks

    def _admit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        before = request.num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        # A scoring request never samples: all its tokens are given.
        samples = request.scoring is None and before + num_new == request.num_scheduled_tokens
        out.scheduled.append(ScheduledRequest(request, num_new, before, samples))
        request.num_computed_tokens = before + num_new
        if samples:
            request.num_placeholders += 1
        # The blocks this step fills are findable now, not once it completes: a request
        # admitted later in this step (the other samples of a prompt) shares them, since each
        # layer stores the whole step's keys and values before any of its attention reads
        # them, and later steps run after this one.  Only known tokens (no placeholder) count.
        known = min(request.num_computed_tokens, request.num_tokens)
        self.block_manager.register_computed_blocks(request, known)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(self._wants(request), budget)
            if num_new == 0:
                continue
            while not bm.allocate(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            self._admit(out, request, num_new)
            budget -= num_new

        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            cached = bm.find_cached_prefix(request)
            num_cached = len(cached) * bm.block_size
            num_new = min(request.num_tokens_to_compute - num_cached, budget)
            if not bm.allocate(request, num_cached + num_new, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._admit(out, request, num_new)
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        if request.num_placeholders:
            raise RuntimeError("preempting a request with a step in flight; drain first")
        self.running.remove(request)
        self.before_free(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------- update
    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: StepLogprobs | None = None,
    ) -> list[Request]:
        """Fill in the tokens a finished step sampled; return the requests that ended.

        A request that ended at an earlier step may still appear here (the step
        was scheduled before its end was known); its token is dropped.
        ``logprobs`` holds the sampled tokens' log-probabilities, by request id.
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if item.samples:
                request.num_placeholders -= 1
            if request.status is not RequestStatus.RUNNING:
                continue
            if item.samples:
                rid = request.request_id
                request.append_token(sampled[rid], logprobs, self.weight_version)
                self.tokens_appended += 1
            known = min(request.num_computed_tokens, request.num_tokens)
            self.block_manager.register_computed_blocks(request, known)
            if item.samples and request.check_stop():
                self._release(request)
                finished.append(request)
            elif request.scoring is not None and self._ran_last_chunk(item):
                request.status = RequestStatus.FINISHED_LENGTH
                self._release(request)
                finished.append(request)
        return finished

    @staticmethod
    def _ran_last_chunk(item: ScheduledRequest) -> bool:
        """This step ran a scoring request's last tokens (a later step may already be
        scheduled with asynchronous scheduling, so the request's own count says nothing)."""
        end = item.num_computed_before + item.num_new_tokens
        return end >= item.request.num_tokens_to_compute

    def retract(self) -> list[Request]:
        """Send every running request back to the waiting queue, its blocks freed (call with
        nothing in flight): it recomputes its tokens when it runs again."""
        retracted = list(reversed(self.running))
        for request in retracted:  # most recent first, so the oldest ends up first in line
            self._preempt(request)
        return retracted

    def abort(self, request_ids: set[str]) -> list[Request]:
        """Stop these requests now (call with nothing in flight); what they computed is kept."""
        aborted: list[Request] = []
        for request in [r for r in self.running if r.request_id in request_ids]:
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request)
            aborted.append(request)
        for request in [r for r in self.waiting if r.request_id in request_ids]:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self.before_free(request)
            self.block_manager.forget(request)
            aborted.append(request)
        return aborted

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.before_free(request)
        self.block_manager.free(request)
        self.block_manager.forget(request)
