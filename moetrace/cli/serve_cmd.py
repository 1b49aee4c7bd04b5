"""``moetrace serve``: an OpenAI-compatible (and SGLang ``/generate``) server returning routed experts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from moetrace.cli import engine_options as opts
from moetrace.cli.engine_runs import parallel_or_worker
from moetrace.errors import MoetraceError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    weights_dtype: opts.WeightsDtype = opts.WEIGHTS_DTYPE,
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
    seed: int = opts.SEED,
    dtype: str = opts.DTYPE,
    device: str = opts.DEVICE,
    load_format: str = opts.LOAD_FORMAT,
    block_size: int = opts.BLOCK_SIZE,
    num_kv_blocks: int | None = opts.NUM_KV_BLOCKS,
    max_num_seqs: int = opts.MAX_NUM_SEQS,
    max_num_batched_tokens: int = opts.MAX_NUM_BATCHED_TOKENS,
    max_model_len: int | None = opts.MAX_MODEL_LEN,
    enable_prefix_caching: bool = opts.ENABLE_PREFIX_CACHING,
    gpu_memory_utilization: float = opts.GPU_MEMORY_UTILIZATION,
    pipeline_parallel_size: int = opts.PIPELINE_PARALLEL_SIZE,
    cpu_offload_gb: float = opts.CPU_OFFLOAD_GB,
    enforce_eager: bool = opts.ENFORCE_EAGER,
    max_cudagraph_capture_size: int = opts.MAX_CUDAGRAPH_CAPTURE_SIZE,
    flush_interval: float = opts.FLUSH_INTERVAL,
    flush_every: int = opts.FLUSH_EVERY,
    tensor_parallel_size: int | None = opts.TENSOR_PARALLEL_SIZE,
    enable_expert_parallel: bool = opts.ENABLE_EXPERT_PARALLEL,
    sequence_parallel_moe: bool = opts.SEQUENCE_PARALLEL_MOE,
) -> None:
    """Serve MODEL over HTTP for RL rollouts: OpenAI /v1/completions and
    /v1/chat/completions, SGLang /generate, /v1/models, /health, /metrics.

    With --enable-return-routed-experts every choice carries its routed experts
    (docs/serving.md). SIGINT or SIGTERM stops: requests in flight get
    --shutdown-timeout seconds, the trace is closed intact.

    Example: moetrace serve demo --port 8000 --enable-return-routed-experts
    """
    from moetrace.engine.launch import TensorParallelDriver, parallel_settings, worker_spec

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MoetraceError(
            f"moetrace serve needs {exc.name}: pip install 'moetrace[serve]'"
        ) from None
    from moetrace.runs.setup import check_supported
    from moetrace.serving.server import Server
    from moetrace.trace.writer import unclosed_traces

    if uvicorn_log_level not in LOG_LEVELS:
        raise typer.BadParameter(
            f"{uvicorn_log_level!r} is not one of {', '.join(LOG_LEVELS)}",
            param_hint="--uvicorn-log-level",
        )
    if not 0 <= port <= 65535:
        raise typer.BadParameter(f"{port} is not a port (0-65535)", param_hint="--port")
    check_supported(pipeline_parallel_size=pipeline_parallel_size, cpu_offload_gb=cpu_offload_gb)
    if enable_weight_updates and (tensor_parallel_size or 1) > 1:
        raise MoetraceError(
            "--enable-weight-updates with --tensor-parallel-size above 1 is not supported yet: "
            "the worker ranks would have to join the trainer's group too"
        )
    parallel = parallel_or_worker(
        model,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        sequence_parallel_moe=sequence_parallel_moe,
        device=device,
        dtype=dtype,
    )
    if parallel is None:  # a torchrun worker: it ran rank 0's steps
        return
    engine = opts.engine_config(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        enforce_eager=enforce_eager or parallel.enabled,
        max_cudagraph_capture_size=max_cudagraph_capture_size,
        capture_weights=weights_dtype.value if enable_return_routed_weights else None,
    )
    with TensorParallelDriver(parallel, device) as driver:
        server = Server(
            model,
            engine=engine,
            device=device,
            dtype=dtype,
            load_format=load_format,
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
            extra_settings=parallel_settings(parallel),
            # Rank 0 of a tensor-parallel group is this process (the driver joined it).
            engine_in_process=not engine_process or parallel.enabled,
            enable_weight_updates=enable_weight_updates,
            weight_update_timeout_s=weight_update_timeout,
        )
        driver.start(worker_spec(server))
        try:
            result = server.run()
        except KeyboardInterrupt:  # Ctrl-C while loading: nothing served yet
            print("interrupted before serving", file=sys.stderr)
            raise typer.Exit(130) from None
        except MoetraceError as exc:
            if unclosed_traces():  # HDF5 is wedged: a normal exit would crash inside it
                print(f"error: {exc}", file=sys.stderr, flush=True)
                os._exit(1)
            raise
    trace = f"; trace {result.trace} closed" if result.trace else ""
    print(
        f"{result.stopped_by}: served {result.requests} requests ({result.output_tokens:,} output "
        f"tokens, {result.aborted} aborted) in {result.elapsed_s:.0f} s{trace}",
        file=sys.stderr,
    )
