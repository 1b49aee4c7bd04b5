"""Starting a tensor-parallel group: by moetrace itself, or joining one torchrun started.

``moetrace record ... --tensor-parallel-size N`` makes the calling process
rank 0 and spawns ranks 1..N-1 (fresh interpreters, ``spawn``; rendezvous
through a temporary file).  Under ``torchrun --nproc-per-node N -m moetrace
record ...`` every process runs the command: rank 0 records, the others
become workers at once (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the
environment).  Either way a worker waits for rank 0's ``WorkerSpec`` (sent
only once rank 0 has checked its output path and prompts), loads its slice
of the model, and runs steps until rank 0 ends them.

Failure handling stays simple: a spawned worker that dies takes rank 0 down
with a one-line error (its collectives could never complete), a worker whose
parent died exits, and under torchrun a failing rank ends the whole job.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetrace import envs
from moetrace.config import EngineConfig
from moetrace.distributed.state import (
    Collectives,
    ParallelConfig,
    ParallelState,
    TensorParallelLayout,
    get_parallel_state,
    set_parallel_state,
)
from moetrace.errors import MoetraceError
from moetrace.models.source import ModelSource
from moetrace.signals import on_signal_exit


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build rank 0's engine (the scheduler's inputs stay on rank 0)."""

    model: ModelSource
    device: str  # resolved: "cuda" or "cpu"
    dtype: str
    load_format: str
    seed: int
    engine: EngineConfig


def timeout() -> timedelta:
    """How long a collective may wait: a worker loading a large checkpoint keeps rank 0 waiting."""
    return timedelta(seconds=envs.get("MOETRACE_DIST_TIMEOUT"))


def under_torchrun() -> bool:
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_group(
    parallel: ParallelConfig,
    rank: int,
    local_rank: int,
    device_type: str,
    init_method: str,
) -> ParallelState:
    """Join the process group and set this process's parallel state."""
    size = parallel.tensor_parallel_size
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # N processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timeout(),
        device_id=torch.device("cuda", local_rank) if cuda else None,  # NCCL binds at once
    )
    # Host messages never queue behind device work: a gloo group of their own.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout())
    comm = Collectives(dist.group.WORLD, cpu_group, rank, size)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    state = ParallelState(parallel, TensorParallelLayout.of(parallel, rank), comm, device)
    set_parallel_state(state)
    return state


def leave_group() -> None:
    state = get_parallel_state()
    if state is not None:
        state.comm.release()
    if dist.is_initialized():
        dist.destroy_process_group()
    set_parallel_state(None)


# ------------------------------------------------------------------ workers
def serve_worker(state: ParallelState) -> int:
    """Wait for rank 0's spec, load this rank's slice, run steps (and the control calls that
    touch the model) until told to stop."""
    from moetrace.distributed.sharding import load_model_for_rank
    from moetrace.engine.cpu_threads import configure_cpu_threads
    from moetrace.engine.llm_engine import LLMEngine
    from moetrace.engine.model_control import ModelControl
    from moetrace.engine.step_sync import serve_steps

    spec = state.comm.broadcast_object()
    if spec is None:  # rank 0 stopped before loading (bad input, existing output, ...)
        return 0
    loaded = load_model_for_rank(
        spec.model,
        device=state.device,
        dtype=spec.dtype,
        load_format=spec.load_format,
        seed=spec.seed,
    )
    configure_cpu_threads(loaded.model, state.device)  # as rank 0's Recording does
    engine = LLMEngine(loaded.model, spec.engine, state.device)
    # A server's weight updates and memory release reach this rank between steps.
    control = ModelControl(engine, parallel=state)
    return serve_steps(engine.runner, state, control.follow)


def run_torchrun_worker(parallel: ParallelConfig, device: str) -> None:
    """A torchrun rank other than 0: serve rank 0, print nothing."""
    device_type = _device_type(device)
    state = init_group(
        parallel, torchrun_rank(), int(os.environ.get("LOCAL_RANK", "0")), device_type, "env://"
    )
    try:
        serve_worker(state)
    finally:
        leave_group()


def exit_when_orphaned(parent: int) -> None:
    """Leave as soon as ``parent`` is gone: an orphan would wait in a collective until the
    timeout, or hold a device loading weights nobody will use."""

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, name="moetrace-parent-watch", daemon=True).start()


def _spawned_worker(
    parallel: ParallelConfig, rank: int, device_type: str, init_method: str, parent: int
) -> None:
    exit_when_orphaned(parent)
    # Ctrl-C reaches the whole process group: rank 0 alone decides when to stop (at a step
    # boundary, file closed), then kills the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    state = init_group(parallel, rank, rank, device_type, init_method)
    try:
        serve_worker(state)
    finally:
        leave_group()


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ------------------------------------------------------------------- driver
class TensorParallelDriver:
    """Rank 0's side of a run, as a context manager around the recording.

    ``start(spec)`` brings the workers up (spawning them unless torchrun did);
    leaving the context ends them: cleanly after a finished run, by
    termination after a failure.  For a single device it does nothing.
    """

    def __init__(self, parallel: ParallelConfig, device: str = "auto") -> None:
        self.parallel = parallel
        self.device_type = _device_type(device)
        self.torchrun = under_torchrun()
        self.state: ParallelState | None = None
        self.started = False
        self.finished = False
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._rendezvous: str | None = None
        self._forget_cleanup = lambda: None

    def __enter__(self) -> TensorParallelDriver:
        if self.parallel.enabled and self.torchrun:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.state = init_group(self.parallel, 0, local, self.device_type, "env://")
        return self

    def start(self, spec: WorkerSpec) -> None:
        if not self.parallel.enabled:
            return
        if not self.torchrun:
            self._spawn()
        assert self.state is not None
        self.state.comm.broadcast_object(spec)
        self.started = True

    def _spawn(self) -> None:
        self._rendezvous = tempfile.mkdtemp(prefix="moetrace-tp-")
        init_method = f"file://{os.path.join(self._rendezvous, 'store')}"
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, self.parallel.tensor_parallel_size):
            proc = ctx.Process(
                target=_spawned_worker,
                args=(self.parallel, rank, self.device_type, init_method, os.getpid()),
                name=f"moetrace-tp-worker-{rank}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        threading.Thread(target=self._watch_workers, name="moetrace-tp-watch", daemon=True).start()
        self._forget_cleanup = on_signal_exit(self._kill_spawned)
        self.state = init_group(self.parallel, 0, 0, self.device_type, init_method)

    def _kill_spawned(self) -> None:
        """A signal before recording starts leaves with os._exit: take the workers along."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def _dead_worker(self) -> str | None:
        for rank, proc in enumerate(self._procs, 1):
            code = proc.exitcode
            if code not in (None, 0):
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel worker {rank} {how}"
        return None

    def _watch_workers(self) -> None:
        """A dead worker can leave rank 0 blocked in a collective (NCCL waits, gloo fails fast).

        Rank 0 gets a grace period to fail on its own and close the trace;
        after it, the process ends with the worker's fate as its message.
        """
        while not self.finished:
            dead = self._dead_worker()
            if dead is not None:
                deadline = time.monotonic() + 10.0
                while not self.finished and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not self.finished:
                    print(f"error: {dead}", file=sys.stderr, flush=True)
                    os._exit(1)
                return
            time.sleep(0.2)

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.parallel.enabled:
            return
        self.finished = True
        dead = None
        if exc_type is not None and self._procs:  # a collective failed because a worker died?
            deadline = time.monotonic() + 1.0
            while (dead := self._dead_worker()) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        try:
            if self.state is not None:
                if exc_type is None and self.started:
                    from moetrace.engine.step_sync import end_steps

                    end_steps(self.state)
                elif not self.started:
                    self.state.comm.broadcast_object(None)  # torchrun workers: nothing to do
            for proc in self._procs:
                if exc_type is None:
                    proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()  # workers ignore SIGTERM (see _spawned_worker)
                    proc.join(timeout=10)
        finally:
            self._forget_cleanup()
            if get_parallel_state() is self.state:
                leave_group()
            if self._rendezvous is not None:
                shutil.rmtree(self._rendezvous, ignore_errors=True)
        if dead is not None and not isinstance(exc, MoetraceError):
            raise MoetraceError(f"{dead}; the trace is closed incomplete (--resume finishes it)")


# ---------------------------------------------------------- command line
def prepare_parallel(
    *,
    tensor_parallel_size: int | None,
    enable_expert_parallel: bool,
    sequence_parallel_moe: bool,
    device: str,
    dtype: str,
) -> ParallelConfig:
    """Resolve and check the parallel options before anything starts (guards.py); the
    model's own fit is ``check_model_shardable``'s, once rank 0 has resolved it."""
    from moetrace.distributed.guards import check_devices, resolve_parallel

    parallel = resolve_parallel(tensor_parallel_size, enable_expert_parallel, sequence_parallel_moe)
    if parallel.enabled:
        check_devices(parallel, device, dtype, torchrun=under_torchrun())
    return parallel


def is_torchrun_worker(parallel: ParallelConfig) -> bool:
    return parallel.enabled and under_torchrun() and torchrun_rank() != 0


def worker_spec(recording) -> WorkerSpec:
    """The spec of a ``Recording`` that has checked its inputs and is about to load."""
    return WorkerSpec(
        model=recording.model,
        device=recording.device.type,
        dtype=recording.dtype,
        load_format=recording.load_format,
        seed=recording.engine_config.seed,
        engine=recording.engine_config,
    )
