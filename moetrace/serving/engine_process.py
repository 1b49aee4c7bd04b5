"""The engine's own process: ``serve`` steps the engine here, away from the HTTP process's GIL.

In one process the engine thread and the event loop share the GIL, so every
millisecond of HTTP work is one the CPU-bound step loop cannot run (on the
H200 that capped serve at about 0.76x of ``record``).  Here the engine runs
in a spawned child that does nothing else: it builds the engine from the
parent's ``EngineSpec``, answers with the facts the server needs
(``Ready``), then takes adds and aborts between steps and, after each step,
hands a ``StepDone`` (finished requests with numpy arrays, new tokens of
streaming requests, the scheduler's counts, the step's timings) to a sender
thread, so the step loop never waits on the pipe.

The child ignores SIGINT and SIGTERM (the parent decides when to stop, at a
step boundary) and ends when its command pipe closes; an orphan whose parent
was killed also leaves (``exit_when_orphaned``).  Messages are tuples and
dataclasses of plain values, numpy arrays and ``FinishedRequest``s.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from moetrace.config import EngineConfig
from moetrace.engine.heap import freeze_start_up_heap
from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.engine.request import Request, TokenLogprob
from moetrace.errors import CapacityError
from moetrace.models.source import ModelSource
from moetrace.serving.engine_control import DEFAULT_VERSION, ControlResult, EngineControl
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.records import FinishedRequest

SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine the parent would have built."""

    model: ModelSource
    device: str  # resolved: "cuda" or "cpu"
    dtype: str
    load_format: str
    engine_config: EngineConfig
    metadata: bool  # the parent writes a trace: send its root attributes
    timeline: bool  # send each step's timings
    switch_interval_s: float
    weight_updates: bool = False  # take a trainer's control calls (engine_control.py)
    weight_update_timeout_s: float = 600.0


@dataclass
class Counts:
    """The scheduler's and block manager's numbers after a step (for /metrics)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass
class Ready:
    """The engine is built: what the HTTP side checks requests against."""

    pid: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    num_hidden_layers: int
    moe_layer_indices: list[int]
    num_experts: int
    top_k: int
    has_tokenizer: bool
    metadata: TraceMetadata | None  # engine_settings left empty: the parent fills them


@dataclass
class StepDone:
    """One step's results; ``tokens``: streaming requests' new tokens (and logprobs)."""

    finished: list[FinishedRequest]
    tokens: dict[str, tuple[list[int], list[TokenLogprob] | None]]
    counts: Counts
    timing: tuple | None = None  # timeline.STEP_COLUMNS, when the parent keeps a timeline
    idle: list[tuple[float, float]] = field(default_factory=list)  # waits for work before it


@dataclass
class Aborted:
    """The answer to an abort: what ended (aborted, or finished by the step it completed)."""

    finished: list[FinishedRequest]
    counts: Counts


@dataclass
class ControlDone:
    """The answer to a control call, and the counts after it."""

    result: ControlResult
    counts: Counts


@dataclass
class EngineFailed:
    """The engine raised (at load or in a step): one line; the child then exits."""

    message: str


@dataclass
class Refused:
    """The engine refused an add the parent had checked: a bug, reported, never silent."""

    request_id: str
    message: str


def child_main(spec: EngineSpec, commands: Connection, results: Connection, parent: int) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # the parent blocked them across spawn
    from moetrace.engine.launch import exit_when_orphaned

    exit_when_orphaned(parent)
    sys.setswitchinterval(spec.switch_interval_s)  # the sender thread shares this GIL
    sender = _Sender(results)
    try:
        engine, ready = _build(spec)
    except BaseException as exc:
        sender.put(EngineFailed(_one_line(exc)))
        sender.close()
        return
    sender.put(ready)
    freeze_start_up_heap()
    try:
        control = None
        if spec.weight_updates:
            control = EngineControl(engine, timeout_s=spec.weight_update_timeout_s)
        _StepLoop(engine, commands, sender, spec.timeline, control).run()
    except BaseException as exc:
        sender.put(EngineFailed(_one_line(exc)))
    sender.close()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _build(spec: EngineSpec) -> tuple[LLMEngine, Ready]:
    import torch

    from moetrace.runs.setup import load_engine, load_tokenizer, model_metadata

    run = _Run(spec, torch.device(spec.device), load_tokenizer(spec.model))
    loaded = load_engine(run)
    engine = loaded.engine
    engine.weight_version = DEFAULT_VERSION  # each token is stamped with its weights' label
    model = loaded.loaded.model
    metadata = None
    if spec.metadata:
        metadata = model_metadata(spec.model, engine, run.tokenizer, {})
    ready = Ready(
        pid=os.getpid(),
        eos_token_ids=tuple(loaded.eos_token_ids),
        max_model_len=engine.max_model_len,
        num_blocks=engine.block_manager.num_blocks,
        block_size=engine.config.block_size,
        vocab_size=model.vocab_size,
        num_hidden_layers=len(getattr(model, "layers", [])),
        moe_layer_indices=list(model.moe_layer_indices),
        num_experts=model.num_experts,
        top_k=model.top_k,
        has_tokenizer=run.tokenizer is not None,
        metadata=metadata,
    )
    return engine, ready


@dataclass
class _Run:
    """``run_setup.RunSpec`` in the child."""

    spec: EngineSpec
    device: object
    tokenizer: object

    @property
    def model(self) -> ModelSource:
        return self.spec.model

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def load_format(self) -> str:
        return self.spec.load_format

    @property
    def engine_config(self) -> EngineConfig:
        return self.spec.engine_config


class _Sender:
    """Sends from a thread of its own: a step never waits for the parent to read."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="moetrace-sender", daemon=True)
        self._thread.start()

    def put(self, message: object) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:  # the parent is gone: nobody to answer
                os._exit(0)


class _StepLoop:
    """``record``'s loop, driven by the parent's commands: adds and aborts between steps."""

    def __init__(
        self,
        engine: LLMEngine,
        commands: Connection,
        sender: _Sender,
        timeline: bool,
        control: EngineControl | None = None,
    ) -> None:
        self.engine = engine
        self.control = control
        self.commands = commands
        self.sender = sender
        self.timeline = timeline
        self.streaming: dict[str, Request] = {}
        self.sent: dict[str, int] = {}

    def run(self) -> None:
        engine = self.engine
        idle: list[tuple[float, float]] = []
        while True:
            loop_start, loop_cpu = time.monotonic(), time.thread_time()
            if not self._may_step():
                idle_start = time.monotonic()
                if not self._wait_for_command():
                    return
                idle.append((idle_start, time.monotonic()))
                loop_start, loop_cpu = time.monotonic(), time.thread_time()
            taken = self._take_commands()
            if taken is None:
                return
            if not self._may_step():
                continue
            counts = self._counts() if self.timeline else None
            step_start, step_cpu = time.monotonic(), time.thread_time()
            finished = engine.step()
            step_end, step_cpu = time.monotonic(), time.thread_time() - step_cpu
            for item in finished:
                self.streaming.pop(item.request_id, None)
                self.sent.pop(item.request_id, None)
            done = StepDone(finished, self._new_tokens(), self._counts(), idle=idle)
            idle = []
            if counts is not None:
                done.timing = (
                    loop_start,
                    step_start,
                    step_end,
                    time.monotonic(),
                    step_cpu,
                    time.thread_time() - loop_cpu,
                    counts.running,
                    counts.waiting,
                    taken,
                    len(finished),
                )
            self.sender.put(done)

    def _may_step(self) -> bool:
        """Requests to run, and no pause or memory release holding them."""
        held = self.control is not None and self.control.blocks_steps
        return self.engine.has_unfinished() and not held

    def _wait_for_command(self) -> bool:
        try:
            return self.commands.poll(None)
        except (EOFError, OSError):
            return False

    def _take_commands(self) -> int | None:
        """Apply every command waiting; None once the parent closed the pipe."""
        taken = 0
        try:
            while self.commands.poll(0):
                self._apply(self.commands.recv())
                taken += 1
        except (EOFError, OSError):
            return None
        return taken

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt, sampling, index, stream, cache_salt = command
            try:
                (request,) = self.engine.add_request(
                    request_id, prompt, sampling, index=index, cache_salt=cache_salt
                )
            except (RequestRejected, CapacityError) as exc:
                self.sender.put(Refused(request_id, _one_line(exc)))
                return
            if stream:
                self.streaming[request_id] = request
                self.sent[request_id] = 0
        elif command[0] == "control":
            if self.control is None:
                raise RuntimeError("a control call reached an engine started without them")
            result = self.control.handle(command[1])
            for item in result.finished:
                self.streaming.pop(item.request_id, None)
                self.sent.pop(item.request_id, None)
            self.sender.put(ControlDone(result, self._counts()))
        else:  # ("abort", ids)
            finished = self.engine.abort(command[1])
            for item in finished:
                self.streaming.pop(item.request_id, None)
                self.sent.pop(item.request_id, None)
            self.sender.put(Aborted(finished, self._counts()))

    def _new_tokens(self) -> dict[str, tuple[list[int], list[TokenLogprob] | None]]:
        out = {}
        for rid, request in self.streaming.items():
            n, sent = request.num_output_tokens, self.sent[rid]
            if n > sent:
                logprobs = None if request.sampling.logprobs is None else request.logprobs[sent:n]
                out[rid] = (request.output_token_ids[sent:n], logprobs)
                self.sent[rid] = n
        return out

    def _counts(self) -> Counts:
        scheduler, bm = self.engine.scheduler, self.engine.block_manager
        return Counts(
            len(scheduler.running), len(scheduler.waiting), bm.num_free_blocks, bm.num_blocks
        )
