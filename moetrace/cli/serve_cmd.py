"""``moetrace serve``: an OpenAI-compatible (and SGLang ``/generate``) server returning routed experts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from moetrace.cli import engine_options as opts
from moetrace.cli.serve_options import GuardArgs, with_guard_options
from moetrace.errors import MoetraceError, install_extra

if TYPE_CHECKING:  # the server (and torch) load only when it starts
    from moetrace.serving.server import Server, ServeResult

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@opts.with_engine_options
@with_guard_options
def serve_command(
    model: str = opts.MODEL,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    served_model_name: list[str] = typer.Option(
        None,
        "--served-model-name",
        help="Name(s) clients use in 'model' (repeatable; default: MODEL as given).",
    ),
    enable_return_routed_experts: bool = typer.Option(
        False,
        "--enable-return-routed-experts",
        help="Return each choice's routed experts (vLLM's field and encoding; SGLang's on "
        "/generate with return_routed_experts).",
    ),
    enable_return_routed_weights: bool = typer.Option(
        False,
        "--enable-return-routed-weights",
        help="Capture gate weights too; a request with return_routed_weights gets them beside "
        "its routed experts (docs/serving.md).",
    ),
    trace_out: Path | None = typer.Option(
        None, "--trace-out", help="Also write every served request to this HDF5 trace."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --trace-out if it exists."),
    generation_config: str = typer.Option(
        "auto",
        "--generation-config",
        help="auto: sampling defaults from the checkpoint's generation_config.json; "
        "vllm: vLLM's built-in defaults.",
    ),
    shutdown_timeout: float = typer.Option(
        30.0,
        "--shutdown-timeout",
        help="Seconds requests in flight get to finish after SIGINT/SIGTERM; then they are aborted.",
    ),
    engine_process: bool = typer.Option(
        True,
        "--engine-process/--engine-in-process",
        help="Step the engine in a process of its own (the default: no GIL shared with the "
        "HTTP side; 0.97-0.98x of record's tok/s on the H200) or in a thread of the HTTP "
        "process (docs/serving.md). Tensor parallelism always steps in the HTTP process.",
    ),
    uvicorn_log_level: str = typer.Option(
        "warning", "--uvicorn-log-level", help=f"uvicorn's log level: {', '.join(LOG_LEVELS)}."
    ),
    enable_weight_updates: bool = typer.Option(
        False,
        "--enable-weight-updates",
        help="Serve an RL trainer's control routes: new weights from disk, a broadcast or "
        "tensors, pause/continue, memory release (SGLang's and vLLM's paths; they let a "
        "client replace the model, so they are off by default; docs/serving.md).",
    ),
    weight_update_timeout: float = typer.Option(
        600.0,
        "--weight-update-timeout",
        help="Seconds to wait for a trainer joining the update group or for each broadcast.",
    ),
    guard: GuardArgs = None,  # access and limits (serve_options.py)
    engine: opts.EngineArgs = None,  # the shared options (engine_options.py)
    flush_interval: float = opts.FLUSH_INTERVAL,
    flush_every: int = opts.FLUSH_EVERY,
) -> None:
    """Serve MODEL over HTTP for RL rollouts: OpenAI /v1/completions and
    /v1/chat/completions, SGLang /generate, /v1/models, /health, /metrics.

    With --enable-return-routed-experts every choice carries its routed experts
    (docs/serving.md). SIGINT or SIGTERM stops: requests in flight get
    --shutdown-timeout seconds, the trace is closed intact.

    Example: moetrace serve demo --port 8000 --enable-return-routed-experts
    """
    from moetrace.engine.launch import TensorParallelDriver, worker_spec

    _require_serve_extra()
    from moetrace.serving.server import Server

    _check_listen_options(uvicorn_log_level, port)
    access = guard.access()
    engine.check()
    parallel = engine.parallel()
    if parallel is None:  # a torchrun worker: it ran rank 0's steps
        return
    run = engine.run_options(model, parallel, capture_weights=enable_return_routed_weights)
    with TensorParallelDriver(parallel, engine.device) as driver:
        server = Server(
            run,
            host=host,
            port=port,
            served_model_names=list(served_model_name or []) or None,
            return_routed_experts=enable_return_routed_experts,
            return_routed_weights=enable_return_routed_weights,
            trace_out=trace_out,
            overwrite=overwrite,
            flush_interval_s=flush_interval,
            flush_every_requests=flush_every,
            shutdown_timeout_s=shutdown_timeout,
            generation_config=generation_config,
            log_level=uvicorn_log_level,
            # Rank 0 of a tensor-parallel group is this process (the driver joined it).
            engine_in_process=not engine_process or parallel.enabled,
            access=access,
            **guard.server_limits(),
            enable_weight_updates=enable_weight_updates,
            weight_update_timeout_s=weight_update_timeout,
        )
        driver.start(worker_spec(server))
        result = _serve(server)
    _print_served(result)


def _require_serve_extra() -> None:
    """The HTTP side's packages are an extra: say how to install them, not an ImportError."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MoetraceError(f"moetrace serve needs {exc.name}: {install_extra('serve')}") from None


def _check_listen_options(uvicorn_log_level: str, port: int) -> None:
    """uvicorn's log level and the port, refused as usage errors before the model loads."""
    if uvicorn_log_level not in LOG_LEVELS:
        raise typer.BadParameter(
            f"{uvicorn_log_level!r} is not one of {', '.join(LOG_LEVELS)}",
            param_hint="--uvicorn-log-level",
        )
    if not 0 <= port <= 65535:
        raise typer.BadParameter(f"{port} is not a port (0-65535)", param_hint="--port")


def _serve(server: Server) -> ServeResult:
    """Serve until a stop signal; an interrupt while loading, or an error that leaves HDF5
    wedged, ends the process here rather than in a traceback."""
    from moetrace.trace.writer import unclosed_traces

    try:
        return server.run()
    except KeyboardInterrupt:  # Ctrl-C while loading: nothing served yet
        print("interrupted before serving", file=sys.stderr)
        raise typer.Exit(130) from None
    except MoetraceError as exc:
        if unclosed_traces():  # HDF5 is wedged: a normal exit would crash inside it
            print(f"error: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        raise


def _print_served(result: ServeResult) -> None:
    """The closing line on standard error: why it stopped and what it served."""
    trace = f"; trace {result.trace} closed" if result.trace else ""
    print(
        f"{result.stopped_by}: served {result.requests} requests to their end "
        f"({result.output_tokens:,} output tokens) and {result.aborted} aborted "
        f"in {result.elapsed_s:.0f} s{trace}",
        file=sys.stderr,
    )
