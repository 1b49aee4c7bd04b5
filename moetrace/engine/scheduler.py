"""Continuous batching: which requests run how many tokens in the next step.

One rule covers prefill, chunked prefill and decode: a scheduled request runs
its next ``min(num_tokens - num_computed_tokens, budget)`` tokens.  Running
requests go first, in arrival order; then waiting ones, while the token budget,
the sequence limit and free KV blocks allow.  When a running request cannot get
a block, the most recently admitted running request is preempted: its blocks
are freed and it later recomputes from its tokens.

Before any request's blocks are freed (finish, abort, preemption) the
``before_free`` callback runs, so the routing rows in those blocks can be saved
while they are still valid.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moetrace.engine.block_manager import BlockManager
from moetrace.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_before: int

    @property
    def samples(self) -> bool:
        """True when this step runs the request's last known token, so it yields a new one."""
        return self.num_computed_before + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

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

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        scheduled_running: list[Request] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted to make room earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not bm.allocate(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
            scheduled_running.append(request)
            budget -= num_new

        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            cached = bm.find_cached_prefix(request)
            num_cached = len(cached) * bm.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not bm.allocate(request, num_cached + num_new, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, num_cached))
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.before_free(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by the step's tokens; return those that finished.

        ``sampled`` maps request id to the token sampled for each request whose
        step ``samples``.
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.num_computed_before + item.num_new_tokens
            self.block_manager.register_computed_blocks(request)
            if item.samples:
                request.append_token(sampled[request.request_id])
                if request.check_stop():
                    self._release(request)
                    finished.append(request)
        return finished

    def abort(self, request_ids: set[str]) -> list[Request]:
        """Stop these requests now; what they computed so far is kept."""
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
