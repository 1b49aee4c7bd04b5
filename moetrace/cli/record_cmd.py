"""``moetrace record``: run prompts through a model and write the routing trace."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moetrace.cli import engine_options as opts
from moetrace.cli.early_checks import check_before_loading
from moetrace.cli.engine_runs import trace_run_errors
from moetrace.cli.progress_lines import DEFAULT_INTERVAL_S, ProgressLines, check_interval
from moetrace.errors import MoetraceError

if TYPE_CHECKING:  # the engine (and torch) load only when a recording runs
    from moetrace.distributed.state import ParallelConfig
    from moetrace.runs.recording import Recording, RecordResult, SamplingDefaults
    from moetrace.signals import GracefulStop


@opts.with_engine_options
def record_command(
    model: str = opts.MODEL,
    prompts: str = typer.Argument(
        ..., metavar="PROMPTS", help="JSONL file of prompts, or '-' for standard input."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write (HDF5)."),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        help="Tokens to generate per prompt (a line's max_tokens wins; default: the generation "
        "config's max_new_tokens, else 16).",
    ),
    temperature: float | None = typer.Option(
        None, "--temperature", help="0 is greedy (default: the generation config's, else 0)."
    ),
    top_p: float | None = typer.Option(None, "--top-p", help="Default: the generation config's."),
    top_k: int | None = typer.Option(
        None, "--top-k", help="0 or -1: off (default: the generation config's)."
    ),
    generation_config: str = opts.GENERATION_CONFIG,
    ignore_unknown_fields: bool = typer.Option(
        False,
        "--ignore-unknown-fields",
        help="Warn about prompt-line fields moetrace does not know and go on (default: refuse).",
    ),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Generate max_tokens even past EOS."
    ),
    logprobs: bool = typer.Option(
        False,
        "--logprobs",
        help="Also store each output token's log-probability under the model (vLLM's logprobs).",
    ),
    record_weights: bool = opts.RECORD_WEIGHTS,
    engine: opts.EngineArgs = None,  # the shared options (engine_options.py)
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue OUTPUT: skip the request ids it holds, append the rest "
        "(model and sampling settings must match).",
    ),
    skip_invalid: bool = typer.Option(
        False,
        "--skip-invalid",
        help="Skip bad prompt lines (reported at the end and in the trace) instead of stopping.",
    ),
    flush_interval: float = opts.FLUSH_INTERVAL,
    flush_every: int = opts.FLUSH_EVERY,
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress bar, no start-up breakdown: the result line only."
    ),
    log_stats_interval: float = typer.Option(
        DEFAULT_INTERVAL_S,
        "--log-stats-interval",
        help="Seconds between progress lines when standard error is no terminal (a log file).",
    ),
    num_shards: int = typer.Option(
        1, "--num-shards", help="Data-parallel shards of the prompts (one run per shard)."
    ),
    shard_index: int = typer.Option(
        0, "--shard-index", help="Which shard this run records: prompts with index % K == i."
    ),
) -> None:
    """Run PROMPTS through MODEL and record every token's routed experts into OUTPUT.

    Ctrl-C or SIGTERM stops early: finished requests are kept, the trace is
    closed (marked incomplete) and --resume finishes it later.

    Example: moetrace record demo prompts.jsonl -o trace.h5
    """
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    _check_options(engine, given, log_stats_interval, output, overwrite=overwrite, resume=resume)
    from moetrace.inputs.shards import check_shard_args
    from moetrace.runs.recording import Recording

    check_shard_args(num_shards, shard_index)
    parallel = engine.parallel()
    if parallel is None:  # a torchrun worker: it ran rank 0's steps
        return
    run = engine.run_options(model, parallel, capture_weights=record_weights)
    sampling = _sampling(run.model, generation_config, given, ignore_eos, logprobs)
    new_recording = functools.partial(
        Recording,
        run,
        prompts,
        output,
        sampling=sampling,
        overwrite=overwrite,
        skip_invalid=skip_invalid,
        resume=resume,
        flush_interval_s=flush_interval,
        flush_every_requests=flush_every,
        num_shards=num_shards,
        shard_index=shard_index,
        ignore_unknown_fields=ignore_unknown_fields,
    )
    console = Console(stderr=True)
    recording, result, stop = _record(
        new_recording, parallel, engine.device, console, quiet, log_stats_interval
    )
    _report(recording, result, sampling, console, quiet=quiet)
    _exit_if_stopped(stop, output)


def _check_options(
    engine: opts.EngineArgs,
    given: dict,
    log_stats_interval: float,
    output: Path,
    *,
    overwrite: bool,
    resume: bool,
) -> None:
    """What the options alone refuse, before the engine's imports (seconds) are paid."""
    check_interval(log_stats_interval)
    engine.check()
    _check_sampling(given, engine.seed)
    check_before_loading(
        device=engine.device, dtype=engine.dtype, output=output, overwrite=overwrite, resume=resume
    )


def _sampling(
    model: str, generation_config: str, given: dict, ignore_eos: bool, logprobs: bool
) -> SamplingDefaults:
    """The options given over the model's generation config: what a line without its own gets."""
    from moetrace.runs.recording import SamplingDefaults
    from moetrace.runs.setup import generation_defaults

    defaults, defaults_file = generation_defaults(model, generation_config)
    return SamplingDefaults.resolve(
        given, defaults, defaults_file, ignore_eos=ignore_eos, logprobs=logprobs
    )


def _record(
    new_recording: Callable[[], Recording],
    parallel: ParallelConfig,
    device: str,
    console: Console,
    quiet: bool,
    log_stats_interval: float,
) -> tuple[Recording, RecordResult, GracefulStop]:
    """Make the recording and run it to the end, under the signal guard and beside any
    tensor-parallel workers; a stop signal ends it early with the trace closed."""
    from moetrace.engine.launch import TensorParallelDriver, worker_spec
    from moetrace.signals import GracefulStop, set_exit_context

    with (
        GracefulStop() as stop,
        TensorParallelDriver(parallel, device) as driver,
        trace_run_errors(),
    ):
        recording = new_recording()
        driver.start(worker_spec(recording))  # tensor parallel: workers load beside rank 0
        if quiet:
            result = recording.run(stop=stop)
        elif console.is_terminal:
            result = _run_with_progress(recording, console, stop)
        else:
            result = _run_with_lines(recording, log_stats_interval, stop)
        set_exit_context(_after_written(recording.output))
    return recording, result, stop


def _report(
    recording: Recording,
    result: RecordResult,
    sampling: SamplingDefaults,
    console: Console,
    *,
    quiet: bool,
) -> None:
    """The result line; unless quiet, the start-up breakdown and the sampling used; notes."""
    _summarise(result, console, startup=not quiet)
    if not quiet:
        console.print(sampling.describe(), highlight=False, soft_wrap=True)
    _ignored_fields(recording.prompt_reader.ignored_fields, recording.source, console)
    if recording.logprobs_not_kept:
        console.print(
            f"[yellow]note[/yellow] {recording.logprobs_not_kept:,} line(s) of standard input "
            "asked for logprobs; a trace made from standard input keeps them only with --logprobs",
            highlight=False,
            soft_wrap=True,
        )


def _exit_if_stopped(stop: GracefulStop, output: Path) -> None:
    """A signal that came after the last request was written: nothing lost, but exit as it asks."""
    from moetrace.signals import signal_name

    if stop.signum is not None:
        print(
            f"error: interrupted by {signal_name(stop.signum)} {_after_written(output)}",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(128 + stop.signum)


def _after_written(output: Path) -> str:
    """When a late signal came: the trace is whole, so the message says so."""
    return f"after {output} was written and closed (it is complete)"


def _check_sampling(given: dict, seed: int) -> None:
    """The rules a prompt line's own fields are checked against, for the options given."""
    from moetrace.engine.sampling import sampling_problem

    values = {**{k: v for k, v in given.items() if v is not None}, "seed": seed}
    for name, value in values.items():
        problem = sampling_problem(name, value)
        if problem is not None:
            raise MoetraceError(f"--{name.replace('_', '-')}: {problem}, got {value}")


def _ignored_fields(ignored: dict[str, list[int]], source: str, console: Console) -> None:
    """--ignore-unknown-fields: each field passed over, once, with where it first appeared."""
    for name, lines in sorted(ignored.items()):
        console.print(
            f"[yellow]ignored[/yellow] unknown field {escape(repr(name))} on {len(lines):,} "
            f"line(s) of {escape(source)} (first: line {lines[0]})",
            highlight=False,
            soft_wrap=True,
        )


def _run_with_progress(recording: Recording, console: Console, stop: GracefulStop) -> RecordResult:
    columns = (
        TextColumn("[bold]recording"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TextColumn("{task.fields[rate]:>8.0f} tok/s"),
        TextColumn("{task.fields[rows]:>10,} rows"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("record", total=recording.total, rate=0.0, rows=0)

        def update(result: RecordResult, total: int | None) -> None:
            rate = result.output_tokens / result.elapsed_s if result.elapsed_s else 0.0
            bar.update(task, completed=result.requests, total=total, rate=rate, rows=result.rows)

        return recording.run(progress=update, stop=stop)


def _run_with_lines(recording: Recording, interval_s: float, stop: GracefulStop) -> RecordResult:
    lines = ProgressLines("recording", sys.stderr, interval_s)

    def update(result: RecordResult, total: int | None) -> None:
        lines.update(
            result.requests,
            total,
            prompt=result.prompt_tokens_computed,
            generation=result.tokens_generated,
        )

    return recording.run(progress=update, stop=stop)


def _summarise(result: RecordResult, console: Console, *, startup: bool) -> None:
    rate = result.output_tokens / result.elapsed_s if result.elapsed_s else 0.0
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(result.finish_reasons.items()))
    kept = f" (after {result.kept} kept from before)" if result.kept else ""
    console.print(
        f"[green]wrote[/green] {escape(str(result.path))}: {result.requests} requests{kept} "
        f"({reasons or 'none'}), {result.rows:,} routing rows, {result.prompt_tokens:,} prompt + "
        f"{result.output_tokens:,} output tokens in {result.elapsed_s:.1f} s "
        f"({rate:,.0f} output tok/s)",
        highlight=False,
        soft_wrap=True,
    )
    if startup and result.startup:
        parts = ", ".join(
            f"{name.replace('_', ' ')} {seconds:.1f}"
            for name, seconds in result.startup.items()
            if seconds >= 0.05
        )
        variants = (
            f"; {result.kernel_variants} kernel variants compiled or loaded ahead"
            if result.kernel_variants
            else ""
        )
        if result.late_compiles:
            variants += f", {result.late_compiles} compiled one by one"
        console.print(
            f"start-up {sum(result.startup.values()):.1f} s: {parts}{variants}",
            highlight=False,
            soft_wrap=True,
        )
    for err in result.skipped:
        console.print(
            f"[yellow]skipped[/yellow] {escape(str(err))}", highlight=False, soft_wrap=True
        )
    if result.skipped:
        console.print(
            f"[yellow]{len(result.skipped)} invalid line(s) skipped[/yellow] "
            "(listed in the trace's skipped_inputs attribute)",
            highlight=False,
            soft_wrap=True,
        )
