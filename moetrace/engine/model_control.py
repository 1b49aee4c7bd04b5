"""The trainer's control calls that change what a rank holds, carried out alike on every rank.

New weights (from a checkpoint directory, a broadcast, tensors handed over
by reference), the trainer's update group and the release of the weights'
and KV cache's memory touch the model, and under tensor parallelism each
rank holds a slice of it.  Rank 0, where the scheduler and the server's
``EngineControl`` run, sends such a call to the workers at a step boundary
as a ``ControlMessage`` in the channel of the steps (``step_sync.py``) and
carries it out beside them.  Pause, continue, the prefix cache and the
weight version are the scheduler's: rank 0's alone, never sent.

SGLang's rules under tensor parallelism: every rank joins the trainer's
group as rank ``rank_offset + tp_rank`` (so the trainer's ``world_size`` is 1
plus every rank of every server it feeds), receives each broadcast whole and
keeps its own slice (``WeightMap`` narrows it); every rank reads a
checkpoint directory and keeps its slice; tensors by reference come as one
payload per rank.

All or nothing across the ranks: each rank first gets the whole update and
checks it on its ``meta`` twin, then the ranks agree over the cpu group, and
only if every rank can take it does any rank copy.  A refusal on one rank is
the refusal of all (rank 0's answer names that rank); a group that a failed
broadcast broke is left by every rank.  On one device the same code runs,
the agreement being the rank's own verdict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from moetrace.distributed.state import ParallelState
from moetrace.distributed.update_group import UpdateGroup, UpdateGroupError
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.memory_release import TAGS, MemoryRelease
from moetrace.engine.step_sync import ControlMessage
from moetrace.engine.tensor_ipc import named_tensors
from moetrace.engine.weight_update import TensorSpec, WeightUpdater, parse_dtype
from moetrace.errors import MoetraceError
from moetrace.models.source import resolve_model

T = TypeVar("T")


# ----------------------------------------------------------------------------- the calls


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
class ReleaseMemory:
    tags: tuple[str, ...] = TAGS
    keep_weights: bool = True
    abort_all: bool = False


@dataclass(frozen=True)
class ResumeMemory:
    tags: tuple[str, ...] = TAGS


UPDATES = (UpdateFromDisk, UpdateFromTensors, UpdateFromGroup)

ModelCall = (
    UpdateFromDisk | UpdateFromTensors | JoinGroup | LeaveGroup | UpdateFromGroup | ReleaseMemory
    | ResumeMemory
)  # fmt: skip


class ControlRefused(MoetraceError):
    """A control call the engine cannot carry out now; nothing changed."""


class PartialUpdate(MoetraceError):
    """Copying new weights failed after every check passed: some tensors were copied."""


class _AgreedFailure(MoetraceError):
    """A worker's side of a failure the ranks agreed on (rank 0 answers it)."""


@dataclass(frozen=True)
class _Verdict:
    """One rank's failure, as it crosses to the other ranks."""

    kind: str  # the exception's class name
    message: str
    broke_group: bool


# ----------------------------------------------------------------------------- one rank


class ModelControl:
    """The model's control calls on this rank; rank 0's ``carry_out`` takes every
    tensor-parallel rank along (``parallel``: the group, None on one device)."""

    def __init__(
        self, engine: LLMEngine, *, timeout_s: float = 600.0, parallel: ParallelState | None = None
    ) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.parallel = parallel
        self.memory = MemoryRelease(engine)
        self.groups: dict[str, UpdateGroup] = {}
        self._updater: WeightUpdater | None = None

    @property
    def rank(self) -> int:
        return 0 if self.parallel is None else self.parallel.rank

    @property
    def size(self) -> int:
        return 1 if self.parallel is None else self.parallel.size

    @property
    def updater(self) -> WeightUpdater:
        if self._updater is None:
            self._updater = WeightUpdater(self.engine.model)
        return self._updater

    def carry_out(self, call: ModelCall) -> str:
        """Rank 0: ``call`` on every rank, at a step boundary; returns what was done and
        raises what failed on any rank."""
        if self.parallel is not None:
            self.parallel.comm.broadcast_object(ControlMessage(call, self.timeout_s))
        return self._run(call)

    def follow(self, message: ControlMessage) -> None:
        """A worker: its share of rank 0's call (a failure is answered by rank 0)."""
        self.timeout_s = message.timeout_s
        with contextlib.suppress(MoetraceError):  # raised on every rank after they agreed
            self._run(message.call)

    # ---------------------------------------------------------------- the calls
    def _run(self, call: ModelCall) -> str:
        if isinstance(call, JoinGroup):
            return self._join(call)
        if isinstance(call, LeaveGroup):
            self._phase(lambda: self._leave(call.group_name))
            return f"Group {call.group_name!r} destroyed."
        if isinstance(call, ReleaseMemory):
            self._phase(lambda: self.memory.release(call.tags, keep_weights=call.keep_weights))
            return f"Memory of {', '.join(call.tags)} released."
        if isinstance(call, ResumeMemory):
            self._phase(lambda: self.memory.resume(call.tags))
            return f"Memory of {', '.join(call.tags)} resumed."
        if isinstance(call, UpdateFromDisk):
            path = self._phase(lambda: self._check_disk(call.path))
            recapture = self._phase(lambda: self._load_disk(path), copying=True)
            what = f"from {path}"
        elif isinstance(call, UpdateFromGroup):
            named = self._phase(lambda: self._receive(call), group=call.group_name)
            recapture = self._phase(lambda: self.updater.load(named), copying=True)
            what = f"{len(named)} tensors from group {call.group_name!r}"
        elif isinstance(call, UpdateFromTensors):
            named = self._phase(lambda: self._open(call))
            recapture = self._phase(lambda: self.updater.load(named), copying=True)
            what = f"{len(named)} tensors"
        else:
            raise ControlRefused(f"unknown control call {type(call).__name__}")
        if recapture:
            self.engine.runner.recapture()
        return what

    def _join(self, call: JoinGroup) -> str:
        def join() -> UpdateGroup:
            if call.group_name in self.groups:
                raise ControlRefused(f"already in a weight update group named {call.group_name!r}")
            if call.rank_offset + self.size > call.world_size:
                raise ControlRefused(
                    f"world_size {call.world_size} leaves no rank for tensor-parallel rank "
                    f"{self.size - 1} (rank_offset {call.rank_offset} + tp_rank): the "
                    f"trainer's world_size is 1 + every server rank ({self.size} here)"
                )
            return UpdateGroup.join(
                master_address=call.master_address,
                master_port=call.master_port,
                rank=call.rank_offset + self.rank,
                world_size=call.world_size,
                group_name=call.group_name,
                backend=call.backend,
                timeout_s=self.timeout_s,
            )

        group = self._phase(join, undo=UpdateGroup.leave)
        self.groups[call.group_name] = group
        ranks = f"rank {group.rank}"
        if self.size > 1:
            ranks = f"ranks {group.rank}-{group.rank + self.size - 1}"
        return (
            f"Joined group {call.group_name!r} as {ranks} of {group.world_size} ({call.backend})."
        )

    def _leave(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is None:
            raise ControlRefused(f"no weight update group {name!r} to destroy")
        group.leave()

    def _check_disk(self, path: str) -> Path:
        source = resolve_model(path)  # a directory, a cached model id, or demo
        self.updater.check_checkpoint(source)
        return source.path

    def _load_disk(self, path: Path) -> bool:
        try:
            return self.updater.load_checkpoint(path, self.engine.device)
        except (MoetraceError, OSError, RuntimeError) as exc:
            raise PartialUpdate(
                f"reading {path} failed after its checks passed ({one_line(exc)}): the "
                "weights are partly from it; send the update again"
            ) from None

    def _receive(self, call: UpdateFromGroup) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the call, received whole before any is copied (the trainer sends
        them all anyway); a call the model cannot take is refused after the transfer."""
        group = self.groups.get(call.group_name)
        if group is None:
            raise ControlRefused(
                f"no weight update group {call.group_name!r}; join one first "
                "(init_weights_update_group, or vLLM's init_weight_transfer_engine)"
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
        if call.packed:
            tensors = group.receive_packed(shapes, device, call.buffer_bytes)
        else:
            tensors = group.receive(shapes, device)
        self.updater.check(specs)
        return [(spec.name, t) for spec, t in zip(specs, tensors, strict=True)]

    def _open(self, call: UpdateFromTensors) -> list[tuple[str, torch.Tensor]]:
        """This rank's payload (SGLang's ``serialized_named_tensors[tp_rank]``), checked."""
        if self.size > 1 and len(call.payloads) != self.size:
            raise ControlRefused(
                f"serialized_named_tensors has {len(call.payloads)} entries: this server has "
                f"{self.size} tensor-parallel ranks and takes one per rank"
            )
        named = named_tensors(call.payloads, call.load_format, self.rank)
        self.updater.check([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named])
        return named

    # ---------------------------------------------------------------- agreement
    def _phase(
        self,
        work: Callable[[], T],
        *,
        undo: Callable[[T], None] | None = None,
        group: str | None = None,
        copying: bool = False,
    ) -> T:
        """``work`` on this rank, then every rank's verdict; if any rank failed, every rank
        raises, after ``undo`` of what this one did and leaving ``group`` if a transfer over
        it failed (the group is unusable then).  ``copying``: weights were being copied, so
        a failure elsewhere leaves them partly new."""
        result: T | None = None
        error: Exception | None = None
        try:
            result = work()
        except Exception as exc:  # any failure must reach the agreement, or the ranks part
            error = exc
        mine = None
        if error is not None:
            broke = isinstance(error, UpdateGroupError)
            mine = _Verdict(type(error).__name__, one_line(error), broke)
        verdicts = [mine] if self.parallel is None else self.parallel.comm.gather_objects(mine)
        failed = [(rank, v) for rank, v in enumerate(verdicts) if v is not None]
        if not failed:
            return result  # type: ignore[return-value]
        if error is None and undo is not None:
            undo(result)  # type: ignore[arg-type]
        if group is not None and any(v.broke_group for _, v in failed):
            broken = self.groups.pop(group, None)
            if broken is not None:
                broken.leave()
        if self.rank != 0:
            raise _AgreedFailure("a rank failed; rank 0 answers")
        partly = "the ranks' weights are partly new: send the update again"
        if error is not None:  # rank 0's own words (on one device: the failure as it was)
            if copying and self.parallel is not None and not isinstance(error, PartialUpdate):
                raise PartialUpdate(f"{one_line(error)}; {partly}") from None
            raise error
        rank, verdict = failed[0]
        where = f"tensor-parallel rank {rank}: {verdict.message}"
        if copying or verdict.kind == PartialUpdate.__name__:
            raise PartialUpdate(f"{where}; {partly}")
        raise ControlRefused(where)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
