"""``moetrace record``: run prompts through a model and write the routing trace."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moetrace.config import EngineConfig
from moetrace.models.registry import supported_architectures
from moetrace.recording import Recording, RecordResult, SamplingDefaults

_SUPPORTED = ", ".join(supported_architectures())


def record_command(
    model: str = typer.Argument(
        ...,
        help=f"Checkpoint directory (config.json + safetensors) or 'demo'. Supported: {_SUPPORTED}.",
    ),
    prompts: str = typer.Argument(..., help="JSONL file of prompts, or '-' for standard input."),
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write (HDF5)."),
    max_tokens: int = typer.Option(
        16, "--max-tokens", help="Tokens to generate per prompt (a line's max_tokens wins)."
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 or -1: off."),
    seed: int = typer.Option(
        0, "--seed", help="Run seed; a prompt without its own seed samples from this."
    ),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Generate max_tokens even past EOS."
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="auto, bfloat16, float16, float32, float64 (auto: the checkpoint's on CUDA, float32 on CPU).",
    ),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    load_format: str = typer.Option(
        "auto", "--load-format", help="auto, safetensors or dummy (seeded random weights)."
    ),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV cache block."),
    num_kv_blocks: int | None = typer.Option(
        None, "--num-kv-blocks", help="KV cache capacity in blocks (default: sized from memory)."
    ),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most sequences in one step."),
    max_num_batched_tokens: int = typer.Option(
        8192,
        "--max-num-batched-tokens",
        help="Most tokens in one step (longer prompts are chunked).",
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Context limit (default: the model's)."
    ),
    enable_prefix_caching: bool = typer.Option(
        True, "--enable-prefix-caching/--no-enable-prefix-caching"
    ),
    gpu_memory_utilization: float = typer.Option(
        0.9,
        "--gpu-memory-utilization",
        help="Share of GPU memory for weights, activations and KV cache.",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    skip_invalid: bool = typer.Option(
        False,
        "--skip-invalid",
        help="Skip bad prompt lines (reported at the end) instead of stopping.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Run PROMPTS through MODEL and record every token's routed experts into OUTPUT.

    Example: moetrace record demo prompts.jsonl -o trace.h5
    """
    engine = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
    )
    sampling = SamplingDefaults(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        ignore_eos=ignore_eos,
    )
    _check_sampling(sampling)
    console = Console(stderr=True)
    recording = Recording(
        model,
        prompts,
        output,
        engine=engine,
        sampling=sampling,
        device=device,
        dtype=dtype,
        load_format=load_format,
        overwrite=overwrite,
        skip_invalid=skip_invalid,
    )
    if quiet:
        result = recording.run()
    else:
        result = _run_with_progress(recording, console)
    _summarise(result, console)


def _check_sampling(sampling: SamplingDefaults) -> None:
    from moetrace.errors import MoetraceError

    if sampling.max_tokens < 1:
        raise MoetraceError(f"--max-tokens must be at least 1, got {sampling.max_tokens}")
    if sampling.temperature < 0:
        raise MoetraceError(f"--temperature must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise MoetraceError(f"--top-p must be in (0, 1], got {sampling.top_p}")


def _run_with_progress(recording: Recording, console: Console) -> RecordResult:
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

        return recording.run(progress=update)


def _summarise(result: RecordResult, console: Console) -> None:
    rate = result.output_tokens / result.elapsed_s if result.elapsed_s else 0.0
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(result.finish_reasons.items()))
    console.print(
        f"[green]wrote[/green] {result.path}: {result.requests} requests ({reasons or 'none'}), "
        f"{result.rows:,} routing rows, {result.prompt_tokens:,} prompt + {result.output_tokens:,} "
        f"output tokens in {result.elapsed_s:.1f} s ({rate:,.0f} output tok/s)"
    )
    for err in result.skipped:
        console.print(f"[yellow]skipped[/yellow] {err}")
