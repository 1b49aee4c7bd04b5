"""``moetrace replay``: a trace's sequences teacher-forced through a model, compared (R3)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moetrace.cli import engine_options as opts
from moetrace.cli.diff_cmd import render_diff
from moetrace.cli.early_checks import check_before_loading
from moetrace.cli.engine_runs import trace_run_errors
from moetrace.cli.pipes import StdoutConsole
from moetrace.cli.progress_lines import DEFAULT_INTERVAL_S, ProgressLines, check_interval
from moetrace.errors import MoetraceError

if TYPE_CHECKING:  # the engine (and torch) load only when a replay runs
    from moetrace.runs.replay import Replay, ReplayResult
    from moetrace.signals import GracefulStop


@opts.with_engine_options
def replay_command(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace to replay."),
    model: str = opts.MODEL,
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write (HDF5)."),
    force_routing: bool = typer.Option(
        False,
        "--force-routing",
        help="Route every MoE layer through the recorded experts (weights from MODEL's own "
        "router scores over them), as routing replay does in training.",
    ),
    record_weights: bool = opts.RECORD_WEIGHTS,
    engine: opts.EngineArgs = None,  # the shared options (engine_options.py)
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    report: Path | None = typer.Option(None, "--report", help="Also write the report as JSON."),
    limit: int = typer.Option(10, "--limit", min=0, help="Requests listed in detail (0: all)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    log_stats_interval: float = typer.Option(
        DEFAULT_INTERVAL_S,
        "--log-stats-interval",
        help="Seconds between progress lines when standard error is no terminal (a log file).",
    ),
) -> None:
    """Teacher-force every sequence of TRACE through MODEL into OUTPUT, and compare.

    Each recorded prompt + output runs as one prefill (batched, prefix-cache
    aware, nothing sampled) under the settings given: another --dtype,
    --device, --tensor-parallel-size, checkpoint or --revision, or the same.  OUTPUT holds
    the same requests with MODEL's routing and the log-probability of every
    recorded output token.  The report gives R3's figures against TRACE:
    token and router mismatch, per layer, Jaccard, and (when TRACE has
    log-probabilities, record --logprobs) mean |delta log-prob|, a KL
    estimate and the share of tokens whose probability ratio exceeds 2.

    Example: moetrace replay bf16.h5 ~/models/Qwen3-30B-A3B --dtype float32 -o fp32.h5
    """
    check_interval(log_stats_interval)  # before the engine's imports (seconds)
    engine.check()
    check_before_loading(
        device=engine.device, dtype=engine.dtype, output=output, overwrite=overwrite
    )
    from moetrace.engine.launch import TensorParallelDriver, worker_spec
    from moetrace.runs.replay import Replay
    from moetrace.signals import GracefulStop

    parallel = engine.parallel()
    if parallel is None:  # a torchrun worker: it ran rank 0's steps
        return
    run = engine.run_options(model, parallel, capture_weights=record_weights)
    console = Console(stderr=True)
    with (
        GracefulStop() as stop,
        TensorParallelDriver(parallel, engine.device) as driver,
        trace_run_errors(),
    ):
        replay = Replay(trace_path, run, output, overwrite=overwrite, force_routing=force_routing)
        driver.start(worker_spec(replay))
        if quiet:
            result = replay.run(stop=stop)
        elif console.is_terminal:
            result = _run_with_progress(replay, console, stop)
        else:
            lines = ProgressLines("replaying", sys.stderr, log_stats_interval)
            result = replay.run(
                progress=lambda r, total: lines.update(r.requests, total, scoring=r.rows),
                stop=stop,
            )
    if report is not None:
        try:
            report.write_text(json.dumps(result.report, indent=2) + "\n")
        except OSError as exc:
            raise MoetraceError(f"cannot write {report}: {exc.strerror or exc}") from None
    if as_json:
        typer.echo(json.dumps(result.report))
        return
    _summarise(result, console)
    render_diff(StdoutConsole(), result.report, limit)


def _run_with_progress(replay: Replay, console: Console, stop: GracefulStop) -> ReplayResult:
    columns = (
        TextColumn("[bold]replaying"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TextColumn("{task.fields[scored]:>10,} tokens scored"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("replay", total=replay.total, scored=0)

        def update(result: ReplayResult, total: int) -> None:
            bar.update(task, completed=result.requests, total=total, scored=result.scored_tokens)

        return replay.run(progress=update, stop=stop)


def _summarise(result: ReplayResult, console: Console) -> None:
    info = result.report["replay"]
    forced = ", routing forced" if info["force_routing"] else ""
    console.print(
        f"[green]wrote[/green] {result.path}: {result.requests} requests replayed through "
        f"{info['model']} ({info['dtype']} on {info['device']}{forced}), {result.rows:,} rows, "
        f"{result.scored_tokens:,} output tokens scored in {result.elapsed_s:.1f} s"
        + ("" if result.complete else " (marked incomplete: the trace replayed is)"),
        highlight=False,
        soft_wrap=True,
    )
