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
cache as they were.  After an update the prefix cache is dropped (its KV
was computed by the old weights) and every token sampled from then on is
stamped with the new version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from moetrace.distributed.update_group import UpdateGroup, UpdateGroupError
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.memory_release import TAGS, WEIGHTS, MemoryRelease
from moetrace.engine.tensor_ipc import named_tensors
from moetrace.engine.weight_update import TensorSpec, WeightUpdater, parse_dtype
from moetrace.errors import MoetraceError
from moetrace.models.source import resolve_model
from moetrace.trace.records import FinishedRequest

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
class UpdateFromDisk:
    path: str
    version: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class UpdateFromTensors:
    """Tensors serialized by the trainer (CUDA IPC handles on a GPU), one payload per rank."""

    payloads: tuple[bytes, ...]
    load_format: str | None = None
    version: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class JoinGroup:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class LeaveGroup:
    group_name: str


@dataclass(frozen=True)
class UpdateFromGroup:
    """Receive ``names`` from the group's rank 0, one broadcast each (or packed), then load."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    packed: bool = False
    buffer_bytes: int = 0
    version: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class SetVersion:
    version: str
    abort_all: bool = False


@dataclass(frozen=True)
class ReleaseMemory:
    tags: tuple[str, ...] = TAGS
    keep_weights: bool = True
    abort_all: bool = False


@dataclass(frozen=True)
class ResumeMemory:
    tags: tuple[str, ...] = TAGS


UPDATES = (UpdateFromDisk, UpdateFromTensors, UpdateFromGroup)

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


class ControlRefused(MoetraceError):
    """A control call the engine cannot carry out now; nothing changed."""


class PartialUpdate(MoetraceError):
    """Reading a checkpoint failed after its checks passed: some tensors were copied."""


# ----------------------------------------------------------------------------- the engine side


class EngineControl:
    """Carries out control calls on one engine (in the thread or process that steps it)."""

    def __init__(self, engine: LLMEngine, *, timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.state = EngineState()
        self.engine.weight_version = DEFAULT_VERSION
        self._updater: WeightUpdater | None = None
        self.memory = MemoryRelease(engine)
        self.groups: dict[str, UpdateGroup] = {}

    @property
    def blocks_steps(self) -> bool:
        return self.state.holds_requests

    @property
    def updater(self) -> WeightUpdater:
        if self._updater is None:
            self._updater = WeightUpdater(self.engine.model)
        return self._updater

    def handle(self, call: ControlCall) -> ControlResult:
        """Carry out ``call``; a refusal or failure is answered (ok False), never raised."""
        start = time.perf_counter()
        finished: list[FinishedRequest] = []
        try:
            message = self._dispatch(call, finished)
            ok = True
        except (MoetraceError, RuntimeError, OSError, ValueError) as exc:
            ok, message = False, _one_line(exc)
            if isinstance(call, UPDATES) and not isinstance(exc, PartialUpdate):
                message += (
                    f"; the weights are unchanged (version {self.state.weight_version!r} "
                    "still serves)"
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
        if isinstance(call, JoinGroup):
            return self._join(call)
        if isinstance(call, LeaveGroup):
            group = self.groups.pop(call.group_name, None)
            if group is None:
                raise ControlRefused(f"no weight update group {call.group_name!r} to destroy")
            group.leave()
            self.state = replace(self.state, groups=tuple(self.groups))
            return f"Group {call.group_name!r} destroyed."
        if isinstance(call, ReleaseMemory):
            return self._release(call, finished)
        if isinstance(call, ResumeMemory):
            unknown = [t for t in call.tags if t not in TAGS]
            if unknown:
                raise ControlRefused(f"unknown memory tag {unknown[0]!r} (choose {TAGS})")
            self.memory.resume(call.tags)
            self.state = replace(self.state, released=tuple(sorted(self.memory.released)))
            return f"Memory of {', '.join(call.tags)} resumed."
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

    def _join(self, call: JoinGroup) -> str:
        if call.group_name in self.groups:
            raise ControlRefused(f"already in a weight update group named {call.group_name!r}")
        group = UpdateGroup.join(
            master_address=call.master_address,
            master_port=call.master_port,
            rank=call.rank_offset,
            world_size=call.world_size,
            group_name=call.group_name,
            backend=call.backend,
            timeout_s=self.timeout_s,
        )
        self.groups[call.group_name] = group
        self.state = replace(self.state, groups=tuple(self.groups))
        return (
            f"Joined group {call.group_name!r} as rank {group.rank} of {group.world_size} "
            f"({call.backend})."
        )

    def _release(self, call: ReleaseMemory, finished: list[FinishedRequest]) -> str:
        unknown = [t for t in call.tags if t not in TAGS]
        if unknown:
            raise ControlRefused(f"unknown memory tag {unknown[0]!r} (choose {TAGS})")
        engine = self.engine
        if call.abort_all:
            finished += engine.abort(engine.request_ids)
        if engine.has_unfinished():
            raise ControlRefused(
                f"{len(engine.request_ids)} requests are in the engine; pause (abort) first"
            )
        self.memory.release(call.tags, keep_weights=call.keep_weights)
        self.state = replace(self.state, released=tuple(sorted(self.memory.released)))
        return f"Memory of {', '.join(call.tags)} released."

    # ---------------------------------------------------------------- weights
    def _update(self, call: ControlCall, finished: list[FinishedRequest]) -> str:
        """Load new weights by ``call``'s transport; all or nothing."""
        if WEIGHTS in self.memory.released:
            raise ControlRefused("the weights' memory is released; resume it (tags weights) first")
        engine = self.engine
        if getattr(call, "abort_all", False):
            finished += engine.abort(engine.request_ids)
        finished += engine.drain()  # the step in flight finishes with the old weights
        if isinstance(call, UpdateFromDisk):
            source = resolve_model(call.path)  # a directory, a cached model id, or demo
            path = source.path
            self.updater.check_checkpoint(source)
            try:
                recapture = self.updater.load_checkpoint(path, engine.device)
            except (MoetraceError, OSError, RuntimeError) as exc:
                raise PartialUpdate(
                    f"reading {path} failed after its checks passed ({_one_line(exc)}): the "
                    "weights are partly from it; send the update again"
                ) from None
            what = f"from {path}"
        elif isinstance(call, UpdateFromGroup):
            named = self._receive(call)
            recapture = self.updater.load(named)
            what = f"{len(named)} tensors from group {call.group_name!r}"
        elif isinstance(call, UpdateFromTensors):
            named = named_tensors(call.payloads, call.load_format)
            self.updater.check([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named])
            recapture = self.updater.load(named)
            what = f"{len(named)} tensors"
        else:
            raise ControlRefused(f"unknown control call {type(call).__name__}")
        if recapture:
            engine.runner.recapture()
        engine.reset_prefix_cache()
        version = getattr(call, "version", None)
        suffix = "" if version is None else " " + self._set_version(version)
        return f"Succeeded to update model weights ({what}).{suffix}"

    def _receive(self, call: UpdateFromGroup) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the call, received before any is copied (the trainer sends them
        all anyway); a call the model cannot take is refused after the transfer."""
        group = self.groups.get(call.group_name)
        if group is None:
            raise ControlRefused(
                f"no weight update group {call.group_name!r}; call init_weights_update_group first"
            )
        if not len(call.names) == len(call.dtypes) == len(call.shapes):
            raise ControlRefused(
                f"{len(call.names)} names, {len(call.dtypes)} dtypes, {len(call.shapes)} shapes"
            )
        specs = [
            TensorSpec(name, parse_dtype(dtype), tuple(int(s) for s in shape))
            for name, dtype, shape in zip(call.names, call.dtypes, call.shapes, strict=True)
        ]
        shapes = [(spec.shape, spec.dtype) for spec in specs]
        device = self.engine.device
        try:
            if call.packed:
                tensors = group.receive_packed(shapes, device, call.buffer_bytes)
            else:
                tensors = group.receive(shapes, device)
        except UpdateGroupError:
            self.groups.pop(call.group_name, None)  # a failed collective leaves it unusable
            group.leave()
            self.state = replace(self.state, groups=tuple(self.groups))
            raise
        self.updater.check(specs)
        return [(spec.name, t) for spec, t in zip(specs, tensors, strict=True)]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
