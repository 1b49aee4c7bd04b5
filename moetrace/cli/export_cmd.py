"""``moetrace export``: requests out of a trace, for shell pipelines and other tools."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from moetrace.errors import MoetraceError
from moetrace.trace.reader import open_trace


def export_command(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace file."),
    fmt: str = typer.Option("jsonl", "--format", "-f", help="jsonl (default), npz or npy."),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="File to write (jsonl: default standard output)."
    ),
    request: list[str] = typer.Option(
        [], "--request", "-r", help="Only this request id (repeat; globs work)."
    ),
    request_range: list[str] = typer.Option(
        [], "--range", help="Only records START:STOP of the request table (repeat)."
    ),
    dtype: str = typer.Option(
        "stored", "--dtype", help="Expert id dtype: stored (uint8/16/32), int32 or int64."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
) -> None:
    """Write requests of TRACE as JSON Lines (one request a line), .npz or .npy.

    Each JSON line has id, index, finish_reason, prompt_token_ids,
    output_token_ids and routed_experts: base64 of the .npy bytes (as vLLM and
    SGLang send it), with shape and dtype.  Decode with
    np.load(io.BytesIO(base64.b64decode(line["routed_experts"]))).

    Example: moetrace export t.h5 | head -1 | jq .shape
    """
    from moetrace.analysis.export import (
        DTYPES,
        check_format,
        selected_requests,
        write_jsonl,
        write_npy,
        write_npz,
    )
    from moetrace.analysis.load import select_positions

    if dtype not in DTYPES:
        raise MoetraceError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if output is not None and output.exists() and not overwrite:
        raise MoetraceError(f"{output} exists (use --overwrite to replace it)")
    with open_trace(trace_path) as trace:
        positions = select_positions(trace, request, request_range)
        count = trace.num_requests if positions is None else len(positions)
        check_format(fmt, output, count)
        try:
            if fmt == "npz":
                write_npz(trace, positions, output, dtype)
            elif fmt == "npy":
                write_npy(next(selected_requests(trace, positions)), output, dtype)
            elif output is None:  # a closed pipe (`| head`) ends the command quietly
                write_jsonl(selected_requests(trace, positions), sys.stdout, dtype)
            else:
                with open(output, "w", encoding="utf-8") as f:
                    write_jsonl(selected_requests(trace, positions), f, dtype)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise MoetraceError(
                f"cannot write {output or 'output'}: {exc.strerror or exc}"
            ) from None
