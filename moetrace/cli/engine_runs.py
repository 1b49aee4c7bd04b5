"""What ``record``, ``serve`` and ``replay`` do alike around the engine run they start."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

from moetrace.errors import MoetraceError

if TYPE_CHECKING:
    from moetrace.distributed.state import ParallelConfig


def parallel_or_worker(
    model: str,
    *,
    tensor_parallel_size: int | None,
    enable_expert_parallel: bool,
    sequence_parallel_moe: bool,
    device: str,
    dtype: str,
) -> ParallelConfig | None:
    """The checked tensor-parallel options; None in a torchrun worker (rank > 0), which has
    then run rank 0's steps to the end and has nothing left to do (writes and prints nothing)."""
    from moetrace.engine.launch import is_torchrun_worker, prepare_parallel, run_torchrun_worker

    parallel = prepare_parallel(
        model,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        sequence_parallel_moe=sequence_parallel_moe,
        device=device,
        dtype=dtype,
    )
    if is_torchrun_worker(parallel):
        run_torchrun_worker(parallel, device)
        return None
    return parallel


@contextmanager
def trace_run_errors() -> Iterator[None]:
    """A run that writes a trace: a signal ends it with one line and 128 + its number; an
    error after HDF5 could not close the file leaves at once (a normal exit would crash)."""
    from moetrace.signals import Interrupted
    from moetrace.trace.writer import unclosed_traces

    try:
        yield
    except Interrupted as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(exc.exit_code) from None
    except MoetraceError as exc:
        if unclosed_traces():
            print(f"error: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        raise
