"""The HTTP process's handle on the engine process: the ``LLMEngine`` calls ``EngineLoop`` makes.

``EngineLoop`` drives a ``RemoteEngine`` exactly as it drives an in-process
``LLMEngine`` (engine_process.py says why the engine has a process of its
own):

- ``add_request`` checks the request as the engine would (so a refusal is
  still a 400 naming the field), sends it, and returns a stand-in
  ``Request`` that gains its tokens as the child reports them (streaming);
- ``step`` waits, with the GIL released, for the child's next step and
  returns its finished requests; it returns early (nothing finished) when
  the loop has adds or aborts to forward, so an arrival never waits a step;
- ``abort`` asks the child and waits for its answer: the aborted requests,
  plus any that steps already reported finished, as ``LLMEngine.abort``;
  ``control`` (a trainer's pause, weight update, ...) likewise;
- counts for /metrics are those of the child's last message.

The child's death (out of memory, a crash, a kill) is noticed at the next
call: pipe end-of-file, or its exit status; the call raises one line naming
how it died, which stops the server through ``EngineLoop``'s fatal path.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moetrace.engine.llm_engine import RequestRejected, refuse_request
from moetrace.engine.request import TokenLogprob
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import MoetraceError
from moetrace.serving.engine_control import ControlCall, ControlResult
from moetrace.serving.engine_process import (
    SIGNALS,
    Aborted,
    ControlDone,
    Counts,
    EngineFailed,
    EngineSpec,
    Ready,
    Refused,
    StepDone,
    child_main,
)
from moetrace.serving.timeline import Timeline
from moetrace.signals import on_signal_exit, signal_name
from moetrace.trace.records import FinishedRequest

PIPE_BYTES = 1 << 20  # a burst of finished requests is read in 1 MiB pieces, not 64 KiB
POLL_S = 0.002  # how often a waiting step() looks at the loop's inbox
STOP_S = 30.0  # how long a closing child gets to exit before it is killed


class EngineProcessDied(MoetraceError):
    """The engine process ended while the server needed it."""


@dataclass
class RemoteRequest:
    """The stand-in of a streaming request: its tokens as the child reports them."""

    request_id: str
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class StepResult(list):
    """Finished requests, and how many of the child's steps they came from (0: none yet)."""

    def __init__(self, finished: list[FinishedRequest], steps: int) -> None:
        super().__init__(finished)
        self.steps = steps


@dataclass
class _SchedulerView:
    running: range
    waiting: range


@dataclass
class _BlocksView:
    num_free_blocks: int
    num_blocks: int


@dataclass
class _ConfigView:
    block_size: int


class RemoteEngine:
    """The engine process, seen through the calls ``EngineLoop`` makes."""

    takes_stream_flag = True  # EngineLoop says which requests stream (only those send tokens)

    def __init__(self, spec: EngineSpec, timeline: Timeline | None = None) -> None:
        self.timeline = timeline
        self.has_news: Callable[[], bool] = lambda: False  # set by the server: inbox not empty
        ctx = multiprocessing.get_context("spawn")  # never fork: the parent may hold CUDA
        commands_r, self._commands = ctx.Pipe(duplex=False)
        self._results, results_w = ctx.Pipe(duplex=False)
        for conn in (commands_r, self._results):
            _widen(conn.fileno())
        self._proc = ctx.Process(
            target=child_main,
            args=(spec, commands_r, results_w, os.getpid()),
            name="moetrace-engine",
            # Not daemonic: on CUDA the engine forks Triton compile workers at start-up,
            # which a daemonic process may not (the H200 run refused it).  close() and
            # kill() end it; it also leaves by itself when its pipe or parent goes.
            daemon=False,
        )
        # Blocked across the spawn so a Ctrl-C to the process group cannot interrupt the
        # child before it ignores them; what arrives meanwhile is delivered here after.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        commands_r.close()
        results_w.close()  # the child holds the only write end: its death reads as EOF
        self._forget_cleanup = on_signal_exit(self.kill)
        self._buffer: deque[object] = deque()
        self._pending: dict[str, RemoteRequest | None] = {}
        self._uncounted = 0  # child steps whose results an abort collected
        self._counts = Counts()
        self.ready = self._wait_ready()
        self._counts.free_blocks = self._counts.total_blocks = self.ready.num_blocks
        self.max_model_len = self.ready.max_model_len
        self.config = _ConfigView(self.ready.block_size)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _wait_ready(self) -> Ready:
        try:
            message = self._receive(None)
        except BaseException:
            self.kill()
            raise
        if isinstance(message, EngineFailed):
            self.close()
            raise MoetraceError(message.message)
        assert isinstance(message, Ready), message
        return message

    # ------------------------------------------------------------ the engine's calls
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """What ``LLMEngine.check_request`` refuses, refused here with the same words."""
        refuse_request(
            prompt_token_ids,
            sampling,
            vocab_size=self.ready.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.ready.block_size,
            num_blocks=self.ready.num_blocks,
            has_tokenizer=self.ready.has_tokenizer,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        index: int = 0,
        stream: bool = False,
        cache_salt: str | None = None,
    ) -> list[RemoteRequest]:
        if request_id in self._pending:
            raise RequestRejected("id", f"duplicate request id {request_id!r}")
        self.check_request(prompt_token_ids, sampling)
        request = RemoteRequest(request_id, sampling)
        command = ("add", request_id, list(prompt_token_ids), sampling, index, stream, cache_salt)
        self._send(command)
        self._pending[request_id] = request if stream else None
        if self.timeline is not None:
            self.timeline.arrivals.append(time.monotonic())
        return [request]

    def abort(self, request_ids: list[str]) -> list[FinishedRequest]:
        ids = [rid for rid in request_ids if rid in self._pending]
        if not ids:
            return []
        self._send(("abort", ids))
        finished: list[FinishedRequest] = []
        while True:
            message = self._receive(None)
            if isinstance(message, Aborted):
                self._counts = message.counts
                return finished + self._ended(message.finished)
            if isinstance(message, StepDone):
                finished += self._apply(message)
                self._uncounted += 1

    def control(self, call: ControlCall) -> ControlResult:
        """A control call, carried out by the engine process between its steps; the
        requests that steps finished meanwhile come back with those the call ended."""
        self._send(("control", call))
        finished: list[FinishedRequest] = []
        while True:
            message = self._receive(None)
            if isinstance(message, ControlDone):
                self._counts = message.counts
                result = message.result
                result.finished = finished + self._ended(result.finished)
                return result
            if isinstance(message, StepDone):
                finished += self._apply(message)
                self._uncounted += 1

    def has_unfinished(self) -> bool:
        if self._proc.exitcode is not None and not self._buffer:
            # What the child said before it died is handed out first; then how it died.
            with contextlib.suppress(EngineProcessDied):
                while (message := self._read(0)) is not None:
                    self._buffer.append(message)
            if not self._buffer:
                self._raise_died()
        return bool(self._pending) or bool(self._buffer)

    def step(self) -> StepResult:
        while True:
            message = self._receive(POLL_S)
            if isinstance(message, StepDone):
                finished = self._apply(message)
                steps, self._uncounted = 1 + self._uncounted, 0
                return StepResult(finished, steps)
            if message is None and self.has_news():
                return StepResult([], 0)

    @property
    def scheduler(self) -> _SchedulerView:
        return _SchedulerView(range(self._counts.running), range(self._counts.waiting))

    @property
    def block_manager(self) -> _BlocksView:
        return _BlocksView(self._counts.free_blocks, self._counts.total_blocks)

    # ------------------------------------------------------------------ the pipe
    def _send(self, command: tuple) -> None:
        try:
            self._commands.send(command)
        except OSError:
            self._raise_died()

    def _receive(self, timeout: float | None) -> object | None:
        """The child's next message (None after ``timeout``); raises if the child died."""
        if self._buffer:
            return self._buffer.popleft()
        return self._read(timeout)

    def _read(self, timeout: float | None) -> object | None:
        try:
            if not self._results.poll(timeout):
                if self._proc.exitcode is not None:
                    self._raise_died()
                return None
            message = self._results.recv()
        except (EOFError, OSError):
            self._raise_died()
        if isinstance(message, EngineFailed):
            raise MoetraceError(message.message)
        if isinstance(message, Refused):
            raise MoetraceError(
                f"the engine refused request {message.request_id} the server had accepted: "
                f"{message.message}"
            )
        return message

    def _raise_died(self) -> None:
        self._proc.join(5.0)
        code = self._proc.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal_name(-code)}"
            if -code == signal.SIGKILL:
                how += " (out of memory?)"
        else:
            how = f"exited with code {code}"
        raise EngineProcessDied(f"the engine process (pid {self._proc.pid}) {how}")

    def _apply(self, done: StepDone) -> list[FinishedRequest]:
        self._counts = done.counts
        for rid, (tokens, logprobs) in done.tokens.items():
            request = self._pending.get(rid)
            if request is not None:
                request.output_token_ids += tokens
                if logprobs is not None:
                    request.logprobs += logprobs
        if self.timeline is not None:
            self.timeline.idle += done.idle
            if done.timing is not None:
                self.timeline.steps.append(done.timing)
        return self._ended(done.finished)

    def _ended(self, finished: list[FinishedRequest]) -> list[FinishedRequest]:
        for item in finished:
            self._pending.pop(item.request_id, None)
        return finished

    # ------------------------------------------------------------------ ending
    def close(self, timeout_s: float = STOP_S) -> None:
        """Close the pipes (the child ends its loop and exits); kill it if it hangs.

        Both ends first: a child blocked writing results nobody reads gets a broken pipe."""
        self._forget_cleanup()
        self._commands.close()
        self._results.close()
        self._proc.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10.0)


def _widen(fd: int) -> None:
    """Grow a pipe's buffer where the system allows it (Linux; the default is 64 KiB)."""
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setsize is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, setsize, PIPE_BYTES)
