"""One engine thread serving every connection: continuous batching behind HTTP.

The HTTP side runs on an asyncio event loop; the engine runs ``LLMEngine.step``
in a loop on its own thread, exactly as ``record`` does, so capture,
prefix-cache reuse, preemption and abort behave the same.  The two meet in
three places only:

- ``add`` and ``abort`` put work in an inbox the engine thread empties
  between steps (the engine itself is never touched from the event loop);
- after each step the engine thread hands the step's events (new tokens for
  streaming requests, finished requests) to the event loop in one
  ``call_soon_threadsafe`` call, which fills each request's queue;
- every request that ends in the engine (finished, aborted by a
  disconnect or by shutdown) also goes to the trace writer, from the engine
  thread, as in ``record``.

A trainer's control calls (``serving/engine_control.py``: pause, new weights,
memory release) go through the same inbox and run between two steps; the
requests a call ends are answered before the call itself.  While the engine
is paused or has given up its memory, new requests are held here and added
when it steps again.

Why a thread: the model's kernels and the CUDA waits release the GIL, so the
event loop parses, encodes and sends while the device works.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.engine.request import Request
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import CapacityError
from moetrace.serving.engine_control import ControlCall, ControlResult, EngineControl, EngineState
from moetrace.serving.logprobs import TokenLogprobs, from_request
from moetrace.serving.timeline import Timeline
from moetrace.trace.diskspace import is_disk_full
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter

if TYPE_CHECKING:
    from moetrace.serving.metrics import ServerMetrics
    from moetrace.serving.remote_engine import RemoteEngine


@dataclass
class NewTokens:
    """Output tokens a streaming request gained in one step (with their logprobs, if asked)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class Finished:
    """The request ended in the engine (its rows, tokens and finish reason)."""

    request: FinishedRequest


@dataclass
class Failed:
    """The engine could not run the request; ``status`` is the HTTP status to answer."""

    message: str
    status: int = 500
    field: str | None = None


Event = NewTokens | Finished | Failed


@dataclass
class EngineRequest:
    """What a handler asks the engine to run."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    cache_salt: str | None = None
    # The other ids a client holds for it (its response id, its prompt's id, the client's
    # own request id or rid): the abort routes end it by any of them (docs/serving.md).
    aliases: tuple[str, ...] = ()


class RequestHandle:
    """The event loop's side of one engine request.

    Its events go to ``queue`` as ``(index, event)``; the engine requests of
    one HTTP request share a queue, so one wait serves them all.
    """

    def __init__(self, request: EngineRequest, queue: asyncio.Queue, index: int = 0) -> None:
        self.request = request
        self.queue = queue
        self.index = index
        self.done = False  # set by the reader once Finished or Failed arrived
        self.added = 0.0  # when the loop took it (monotonic), for the latency metric

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class _Live:
    handle: RequestHandle
    request: Request | None = None
    sent: int = 0  # output tokens already handed out (streaming)


@dataclass
class LoopStats:
    requests_finished: int = 0
    requests_aborted: int = 0
    output_tokens: int = 0
    steps: int = 0
    started: float = field(default_factory=time.monotonic)


class EngineLoop:
    """Drives one ``LLMEngine`` from a thread; thread-safe ``add``/``abort``.

    ``on_fatal`` is called (from the engine thread) with a one-line message
    when the engine or the trace writer fails: the server then stops.
    """

    def __init__(
        self,
        engine: LLMEngine | RemoteEngine,
        loop: asyncio.AbstractEventLoop,
        *,
        writer: TraceWriter | None = None,
        on_fatal: Callable[[str], None] | None = None,
        timeline: Timeline | None = None,
        metrics: ServerMetrics | None = None,
        control: EngineControl | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.writer = writer
        self.on_fatal = on_fatal or (lambda message: None)
        self.stats = LoopStats()
        self.timeline = timeline
        self.metrics = metrics
        self.fatal: str | None = None
        self.fatal_error: BaseException | None = None
        self._failure = Failed("the server stopped")
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        # Ids taken by requests in flight and, with a trace, by every request written to it:
        # a second request under one of them is refused (a trace holds each id once).
        self._claimed: set[str] = set()
        self._streaming: dict[str, _Live] = {}  # the live requests that stream tokens
        self._index = 0  # arrival order: the trace's request index and the default seed
        self._stopping = False
        self._deadline = 0.0
        self._thread = threading.Thread(target=self._run, name="moetrace-engine", daemon=True)
        # An engine in another process sends tokens only for the requests that stream.
        self._remote = getattr(engine, "takes_stream_flag", False)
        self._control = control  # the engine here; a remote engine carries calls out itself
        self.state = EngineState()  # as the last control call left it (read by handlers)
        self._held: list[RequestHandle] = []  # arrived while the engine may not step
        self.holding = False  # hold new requests (a pause that waits for the running ones)
        # A control call is being carried out: the engine steps again only once it returns.
        self.controlling = False

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def claim(self, request_ids: list[str]) -> str | None:
        """Take ``request_ids`` for new requests; the first already taken, if any (then none)."""
        taken = next((rid for rid in request_ids if rid in self._claimed), None)
        if taken is None and len(set(request_ids)) < len(request_ids):
            taken = next(rid for rid in request_ids if request_ids.count(rid) > 1)
        if taken is None:
            self._claimed.update(request_ids)
        return taken

    def release(self, request_ids: list[str]) -> None:
        """Give back ids whose requests will never reach the trace."""
        self._claimed.difference_update(request_ids)

    def add(self, handle: RequestHandle) -> None:
        handle.added = time.monotonic()
        if self.timeline is not None:
            self.timeline.arrivals.append(time.monotonic())
        self._inbox.append(("add", handle))
        self._wake.set()
        if self.fatal is not None:  # no engine thread empties the inbox any more
            self._fail_inbox()

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._inbox.append(("abort", list(request_ids)))
            self._wake.set()

    def abort_named(self, ids: list[str] | None) -> asyncio.Future[int]:
        """The abort routes: end every request (held ones too) that one of ``ids`` names,
        by its trace id or an alias, or all of them (``None``).  Resolves to how many it
        ended, so a trainer is told what really stopped, not what it asked for."""
        future: asyncio.Future[int] = self.loop.create_future()
        self._inbox.append(("abort_named", (None if ids is None else set(ids), future)))
        self._wake.set()
        if self.fatal is not None:
            self._fail_inbox()
        return future

    def abort_rid(self, rid: str | None) -> asyncio.Future[int]:
        """SGLang's ``/abort_request``: the requests ``rid`` names (its samples too), or all."""
        return self.abort_named(None if rid is None else [rid])

    def control(self, call: ControlCall) -> asyncio.Future[ControlResult]:
        """Carry ``call`` out between two steps; resolves once the requests it ended
        have been answered."""
        future: asyncio.Future[ControlResult] = self.loop.create_future()
        self._inbox.append(("control", (call, future)))
        self._wake.set()
        if self.fatal is not None:
            self._fail_inbox()
        return future

    @property
    def num_live(self) -> int:
        """Requests in the engine (not those held)."""
        return len(self._live)

    def has_news(self) -> bool:
        """Adds, aborts or a stop wait for the engine thread (a remote step returns for them)."""
        return bool(self._inbox) or (self._stopping and time.monotonic() >= self._deadline)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    @property
    def failure(self) -> Failed | None:
        """What stopped the engine (a disk-full trace: 507), for requests that arrive after."""
        return self._failure if self.fatal is not None else None

    @property
    def healthy(self) -> bool:
        """The engine steps and, with a trace, its writer can still write (/health)."""
        return self.alive and (self.writer is None or self.writer.healthy)

    def drain(self, timeout_s: float) -> None:
        """Take no new request; abort what still runs after ``timeout_s`` (answered as aborts)."""
        deadline = time.monotonic() + timeout_s
        self._deadline = min(self._deadline, deadline) if self._stopping else deadline
        self._stopping = True
        self._wake.set()

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Finish what runs for up to ``timeout_s``, abort the rest, stop the thread."""
        self.drain(timeout_s)
        if self._thread.is_alive():
            self._thread.join()

    # ---------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        timeline = self.timeline
        # What the engine has to say; _deliver empties it, so what a failure interrupts is
        # still delivered (requests that ended before a trace write failed get their answers).
        events: list[tuple[RequestHandle, Event]] = []
        try:
            while True:
                if timeline is not None:
                    loop_start, loop_cpu = time.monotonic(), time.thread_time()
                    inbox = len(self._inbox)
                if self.writer is not None and not self.writer.healthy:
                    self.writer.raise_error()  # the writer died between submits: stop now
                self._take_inbox(events)
                if self._stopping and (
                    not engine.has_unfinished()
                    or self.state.holds_requests  # paused: what runs would never finish
                    or time.monotonic() >= self._deadline
                ):
                    self._abort(list(self._live), events)
                    events += [(h, Failed("the server is shutting down", 503)) for h in self._held]
                    self._held.clear()
                    self._deliver(events)
                    return
                if not engine.has_unfinished() or self.state.holds_requests:
                    self._deliver(events)
                    idle_start = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    if timeline is not None:
                        timeline.idle.append((idle_start, time.monotonic()))
                    continue
                if timeline is not None:
                    counts = len(engine.scheduler.running), len(engine.scheduler.waiting)
                    step_start, step_cpu = time.monotonic(), time.thread_time()
                finished = engine.step()
                if timeline is not None:
                    step_end, step_cpu = time.monotonic(), time.thread_time() - step_cpu
                steps = getattr(finished, "steps", 1)  # a remote engine says
                self.stats.steps += steps
                if self.metrics is not None:
                    self.metrics.stepped(steps)
                # A request that ended this step gets its last tokens with Finished instead.
                events += self._stream_tokens({f.request_id for f in finished})
                self._ended(finished, events)
                self._deliver(events)
                if timeline is not None:
                    timeline.step(
                        loop_start,
                        step_start,
                        step_end,
                        time.monotonic(),
                        step_cpu,
                        time.thread_time() - loop_cpu,
                        *counts,
                        inbox,
                        len(finished),
                    )
        except BaseException as exc:  # an engine bug or a failed trace write: stop serving
            # The server says it in one line as it stops (server.py); requests in flight and
            # any that still arrive get an error answer, never silence or a dropped connection.
            message = " ".join(str(exc).split()) or type(exc).__name__
            self.fatal_error = exc
            self._failure = Failed(
                f"the server stopped: {message}", status=507 if is_disk_full(exc) else 500
            )
            self.fatal = message
            events += [(live.handle, self._failure) for live in self._live.values()]
            self._deliver(events)
            self._live.clear()
            self._streaming.clear()
            self._fail_inbox()
            self.on_fatal(message)

    def _fail_inbox(self) -> None:
        """After the engine stopped: answer what waits in the inbox with the failure."""
        events: list[tuple[RequestHandle, Event]] = []
        while True:
            try:
                kind, item = self._inbox.popleft()
            except IndexError:
                break
            if kind == "add":
                self.release([item.request_id])  # type: ignore[union-attr]
                events.append((item, self._failure))  # type: ignore[arg-type]
            elif kind == "control":
                call, future = item  # type: ignore[misc]
                result = ControlResult(False, self._failure.message, self.state)
                self.loop.call_soon_threadsafe(_resolve, future, result)
            elif kind == "abort_named":  # the failure ended them all already
                self.loop.call_soon_threadsafe(_resolve, item[1], 0)  # type: ignore[index]
        events += [(h, self._failure) for h in self._held]
        self._held.clear()
        self._deliver(events)

    def _take_inbox(self, events: list[tuple[RequestHandle, Event]]) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                if self.state.holds_requests or self.holding:
                    self._held.append(item)  # type: ignore[arg-type]
                else:
                    events += self._add(item)  # type: ignore[arg-type]
            elif kind == "abort":
                self._abort(item, events)  # type: ignore[arg-type]
            elif kind == "abort_named":
                ids, future = item  # type: ignore[misc]
                named = [
                    h.request_id
                    for h in [live.handle for live in self._live.values()] + self._held
                    if ids is None or not ids.isdisjoint((h.request_id, *h.request.aliases))
                ]
                count = self._abort(named, events)
                self._deliver(events)  # the aborted requests are answered before the route
                self.loop.call_soon_threadsafe(_resolve, future, count)
            else:
                self._run_control(*item, events)  # type: ignore[misc]
        if self._held and not (self.state.holds_requests or self.holding):
            held, self._held = self._held, []
            for handle in held:
                events += self._add(handle)

    def _run_control(
        self, call: ControlCall, future: asyncio.Future, events: list[tuple[RequestHandle, Event]]
    ) -> None:
        """Carry a control call out here (or in the engine process); answer what it ended
        first, then the call."""
        self.controlling = True
        try:
            if self._control is not None:
                result = self._control.handle(call)
            else:
                result = self.engine.control(call)  # type: ignore[union-attr]
        finally:
            self.controlling = False
        self.state = result.state
        self._ended(result.finished, events)
        self._deliver(events)
        self.loop.call_soon_threadsafe(_resolve, future, result)

    def _add(self, handle: RequestHandle) -> list[tuple[RequestHandle, Event]]:
        req = handle.request
        if self._stopping:
            self.release([req.request_id])
            return [(handle, Failed("the server is shutting down", status=503))]
        try:
            (request,) = self.engine.add_request(  # one sample: the server fans n out itself
                req.request_id, req.prompt_token_ids, req.sampling, index=self._index,
                cache_salt=req.cache_salt, **({"stream": req.stream} if self._remote else {}),
            )  # fmt: skip
        except RequestRejected as exc:
            self.release([req.request_id])
            return [(handle, Failed(exc.problem, status=400, field=exc.field))]
        except CapacityError as exc:
            self.release([req.request_id])
            return [(handle, Failed(str(exc), status=400, field="max_tokens"))]
        self._index += 1
        live = _Live(handle, request if req.stream else None)
        self._live[req.request_id] = live
        if req.stream:
            self._streaming[req.request_id] = live
        return []

    def _abort(self, request_ids: list[str], events: list[tuple[RequestHandle, Event]]) -> int:
        """End these requests; how many it ended (not those a step had finished already)."""
        ids = set(request_ids)
        held = [h for h in self._held if h.request_id in ids]
        self._held = [h for h in self._held if h.request_id not in ids]
        for handle in held:  # never reached the engine nor the trace: its id is free again
            self.release([handle.request_id])
            events.append((handle, Failed("aborted before it started", status=503)))
        live = [rid for rid in request_ids if rid in self._live]
        if not live:
            return len(held)
        finished = self.engine.abort(live)
        self._ended(finished, events)
        return len(held) + sum(f.request_id in ids and f.finish_reason == "abort" for f in finished)

    def _stream_tokens(self, ended: set[str]) -> list[tuple[RequestHandle, Event]]:
        events: list[tuple[RequestHandle, Event]] = []
        for rid, live in self._streaming.items():
            request = live.request
            if request is None or rid in ended:
                continue
            n = request.num_output_tokens
            if n > live.sent:
                num = request.sampling.logprobs
                logprobs = (
                    None if num is None else from_request(request.logprobs[live.sent : n], num)
                )
                tokens = request.output_token_ids[live.sent : n]
                events.append((live.handle, NewTokens(tokens, logprobs)))
                live.sent = n
        return events

    def _ended(
        self, finished: list[FinishedRequest], events: list[tuple[RequestHandle, Event]]
    ) -> None:
        """Trace each ended request, then answer it: one the trace refused stays live (failed)."""
        now = time.monotonic()
        for item in finished:
            if self.writer is not None:
                if item.weight_versions:  # which weights sampled which tokens (docs/serving.md)
                    item.extra = {**item.extra, "weight_versions": item.weight_versions}
                self.writer.submit(item)
            else:
                self.release([item.request_id])
            live = self._live.pop(item.request_id, None)
            self._streaming.pop(item.request_id, None)
            if item.finish_reason == "abort":
                self.stats.requests_aborted += 1
            else:
                self.stats.requests_finished += 1
                self.stats.output_tokens += item.output_len
            if self.metrics is not None:
                self.metrics.ended(item, None if live is None else now - live.handle.added)
            if live is not None:
                events.append((live.handle, Finished(item)))

    def _deliver(self, events: list[tuple[RequestHandle, Event]]) -> None:
        """Hand ``events`` to the event loop and empty the list."""
        if events and not self.loop.is_closed():
            # The event loop may close meanwhile (shutdown): then nobody is listening.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(_put_all, list(events))
        events.clear()

    # ------------------------------------------------------------------ views
    def counts(self) -> dict[str, int]:
        """Gauges for /metrics, read without stopping the engine."""
        scheduler = self.engine.scheduler
        bm = self.engine.block_manager
        return {
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
            "kv_cache_free_blocks": bm.num_free_blocks,
            "kv_cache_total_blocks": bm.num_blocks,
        }


def _put_all(events: list[tuple[RequestHandle, Event]]) -> None:
    for handle, event in events:
        handle.queue.put_nowait((handle.index, event))


def _resolve(future: asyncio.Future, result: ControlResult | int) -> None:
    if not future.done():
        future.set_result(result)
