"""What an RL trainer asks of the engine between steps, carried out where the engine steps.

The trainer's control calls (pause, continue, new weights by any transport,
flush the prefix cache, free and take back memory, set the weight version)
reach the engine between two steps, in the engine's own thread or process,
as the small records below (plain values, so they cross the pipe to an
engine process).  ``EngineControl.handle`` carries one out and answers with a
``ControlResult``: whether it worked, one line saying what happened, the
requests it ended (a pause that aborts hands them back with their tokens and
routed experts so far), and the engine's state after it.

A control call never leaves the model half-updated: an update is checked
whole before any tensor is copied (``engine/weight_update.py``), tensors
that arrive over a group are all received before the first is copied, and a
refused or failed update leaves the weights, their version and the prefix
cache as they were.  The calls that touch the model are
``engine/model_control.py``'s: under tensor parallelism they reach every
rank, and the ranks agree before any copies.  After an update the prefix cache is dropped (its KV
was computed by the old weights) and every token sampled from then on is
stamped with the new version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.memory_release import TAGS, WEIGHTS
from moetrace.engine.model_control import (
    UPDATES,
    ControlRefused,
    JoinGroup,
    LeaveGroup,
    ModelControl,
    PartialUpdate,
    ReleaseMemory,
    ResumeMemory,
    UpdateFromDisk,
    UpdateFromGroup,
    UpdateFromTensors,
    one_line,
)
from moetrace.errors import MoetraceError
from moetrace.trace.records import FinishedRequest

__all__ = [  # the calls that touch every rank's model are defined with ModelControl
    "ControlRefused",
    "JoinGroup",
    "LeaveGroup",
    "PartialUpdate",
    "ReleaseMemory",
    "ResumeMemory",
    "UpdateFromDisk",
    "UpdateFromGroup",
    "UpdateFromTensors",
]

DEFAULT_VERSION = "default"  # SGLang's and vLLM's label before any update
PAUSE_MODES = ("abort", "retract", "in_place", "keep")


# ----------------------------------------------------------------------------- the calls


@dataclass(frozen=True)
class Pause:
    """Stop stepping.  ``abort``: end every request now; ``retract``: free their KV blocks,
    they recompute after ``Resume``; ``in_place``/``keep``: freeze them as they are."""

    mode: str = "abort"


@dataclass(frozen=True)
class Resume:
    """Step again (requests kept or retracted by a pause go on)."""


@dataclass(frozen=True)
class FlushCache:
    """Forget the prefix cache; ``when_idle``: refuse while requests are in the engine
    (SGLang's ``flush_cache``)."""

    when_idle: bool = True


@dataclass(frozen=True)
class SetVersion:
    version: str
    abort_all: bool = False


ControlCall = (
    Pause | Resume | FlushCache | UpdateFromDisk | UpdateFromTensors | JoinGroup | LeaveGroup
    | UpdateFromGroup | SetVersion | ReleaseMemory | ResumeMemory
)  # fmt: skip


# ----------------------------------------------------------------------------- the answers


@dataclass(frozen=True)
class EngineState:
    """What the HTTP side shows without asking the engine (``/is_paused``, versions)."""

    weight_version: str = DEFAULT_VERSION
    paused: str | None = None  # the pause mode, None while stepping
    released: tuple[str, ...] = ()  # memory given up (``weights``, ``kv_cache``)
    groups: tuple[str, ...] = ()  # update groups joined

    @property
    def holds_requests(self) -> bool:
        """New requests wait (paused, or memory given up) until this ends."""
        return self.paused is not None or bool(self.released)


@dataclass
class ControlResult:
    ok: bool
    message: str
    state: EngineState
    finished: list[FinishedRequest] = field(default_factory=list)
    seconds: float = 0.0
    num_paused_requests: int = 0


# ----------------------------------------------------------------------------- the engine side


class EngineControl:
    """Carries out control calls on one engine (in the thread or process that steps it); the
    calls that touch the model go to every tensor-parallel rank (``engine/model_control.py``)."""

    def __init__(self, engine: LLMEngine, *, timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.state = EngineState()
        self.engine.weight_version = DEFAULT_VERSION
        self.ranks = ModelControl(engine, timeout_s=timeout_s, parallel=engine.runner.parallel)

    @property
    def blocks_steps(self) -> bool:
        return self.state.holds_requests

    def handle(self, call: ControlCall) -> ControlResult:
        """Carry out ``call``; a refusal or failure is answered (ok False), never raised."""
        start = time.perf_counter()
        finished: list[FinishedRequest] = []
        try:
            message = self._dispatch(call, finished)
            ok = True
        except (MoetraceError, RuntimeError, OSError, ValueError) as exc:
            ok, message = False, one_line(exc)
            if isinstance(call, UPDATES) and not isinstance(exc, PartialUpdate):
                message += (
                    f"; the weights are unchanged (version {self.state.weight_version!r} "
                    "still serves)"
                )
        # A failed broadcast leaves its group; memory follows the call on every rank.
        self.state = replace(
            self.state,
            groups=tuple(self.ranks.groups),
            released=tuple(sorted(self.ranks.memory.released)),
        )
        paused = sum(1 for f in finished if f.finish_reason == "abort")
        return ControlResult(ok, message, self.state, finished, time.perf_counter() - start, paused)

    # ---------------------------------------------------------------- dispatch
    def _dispatch(self, call: ControlCall, finished: list[FinishedRequest]) -> str:
        engine = self.engine
        if isinstance(call, Pause):
            return self._pause(call.mode, finished)
        if isinstance(call, Resume):
            self.state = replace(self.state, paused=None)
            return "Generation continued successfully."
        if isinstance(call, FlushCache):
            if call.when_idle and engine.has_unfinished():
                raise ControlRefused(
                    f"{len(engine.request_ids)} requests are in the engine; pause or wait first"
                )
            dropped = engine.reset_prefix_cache()
            return f"Cache flushed ({dropped} blocks forgotten)."
        if isinstance(call, SetVersion):
            if call.abort_all:
                finished += engine.abort(engine.request_ids)
            finished += engine.drain()  # the step in flight keeps the label it ran under
            return self._set_version(call.version)
        if isinstance(call, (JoinGroup, LeaveGroup)):
            return self.ranks.carry_out(call)
        if isinstance(call, ReleaseMemory):
            _check_tags(call.tags)
            if call.abort_all:
                finished += engine.abort(engine.request_ids)
            if engine.has_unfinished():
                raise ControlRefused(
                    f"{len(engine.request_ids)} requests are in the engine; pause (abort) first"
                )
            return self.ranks.carry_out(call)
        if isinstance(call, ResumeMemory):
            _check_tags(call.tags)
            return self.ranks.carry_out(call)
        return self._update(call, finished)

    def _pause(self, mode: str, finished: list[FinishedRequest]) -> str:
        engine = self.engine
        if mode not in PAUSE_MODES:
            raise ControlRefused(f"pause mode {mode!r}: choose {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            finished += engine.abort(engine.request_ids)
        elif mode == "retract":
            finished += engine.retract()
        else:
            finished += engine.drain()
        self.state = replace(self.state, paused=mode)
        return "Generation paused successfully."

    def _set_version(self, version: str) -> str:
        self.engine.weight_version = version
        self.state = replace(self.state, weight_version=version)
        return f"Weight version updated to {version}."

    def _update(self, call: ControlCall, finished: list[FinishedRequest]) -> str:
        """Load new weights by ``call``'s transport, on every rank; all or nothing."""
        if not isinstance(call, UPDATES):
            raise ControlRefused(f"unknown control call {type(call).__name__}")
        if WEIGHTS in self.ranks.memory.released:
            raise ControlRefused("the weights' memory is released; resume it (tags weights) first")
        engine = self.engine
        if call.abort_all:
            finished += engine.abort(engine.request_ids)
        finished += engine.drain()  # the step in flight finishes with the old weights
        what = self.ranks.carry_out(call)
        engine.reset_prefix_cache()
        suffix = "" if call.version is None else " " + self._set_version(call.version)
        return f"Succeeded to update model weights ({what}).{suffix}"


def _check_tags(tags: tuple[str, ...]) -> None:
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ControlRefused(f"unknown memory tag {unknown[0]!r} (choose {TAGS})")
