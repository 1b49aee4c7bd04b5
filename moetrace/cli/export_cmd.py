"""``moetrace export``: requests out of a trace, for shell pipelines and other tools."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import typer

from moetrace.cli.trace_notes import note_if_being_written
from moetrace.errors import MoetraceError
from moetrace.output_files import (
    STDOUT,
    check_new_output,
    check_not_an_input,
    refuse_binary_terminal,
    replacing,
)
from moetrace.trace.reader import open_trace


def export_command(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace file."),
    fmt: str = typer.Option(
        "jsonl", "--format", "-f", help="jsonl (default), npz, npy or parquet."
    ),
    output: str = typer.Option(
        STDOUT, "-o", "--output", help="File to write; '-' (the default): standard output."
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
    layout: str = typer.Option(
        "moe",
        "--layout",
        help="moe: one entry per MoE layer; vllm: every hidden layer, dense layers zero "
        "(vLLM's array).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    no_verify_checksums: bool = typer.Option(
        False,
        "--no-verify-checksums",
        help="Do not check each request's checksum as it is read (faster; damage goes unseen).",
    ),
) -> None:
    """Write requests of TRACE as JSON Lines (one request a line), .npz, .npy or Parquet.

    Each JSON line has id, sample_index, index, finish_reason, prompt_token_ids,
    output_token_ids and routed_experts: base64 of the .npy bytes (as vLLM and
    SGLang send it), with shape and dtype.  Decode with
    np.load(io.BytesIO(base64.b64decode(line["routed_experts"]))).
    Parquet has one row per request (pandas, datasets, Arrow read it).
    Binary formats go to standard output only when it is not a terminal.

    Example: moetrace export t.h5 | head -1 | jq .shape
    """
    from moetrace.analysis.export import (
        BINARY_FORMATS,
        DTYPES,
        Layout,
        check_format,
    )
    from moetrace.analysis.load import select_positions

    if dtype not in DTYPES:
        raise MoetraceError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_format(fmt, 1)
    to_stdout = output == STDOUT
    if to_stdout:
        if fmt in BINARY_FORMATS:
            refuse_binary_terminal(fmt, sys.stdout)
    else:
        check_not_an_input(output, [("the trace being exported", trace_path)])
        check_new_output(output, overwrite=overwrite)
    with open_trace(trace_path, verify=not no_verify_checksums) as trace:
        note_if_being_written(trace)
        rows_layout = Layout.of(trace, layout)
        positions = select_positions(trace, request, request_range)
        check_format(fmt, trace.num_requests if positions is None else len(positions))
        if to_stdout:  # a closed pipe (`| head`) ends the command quietly
            _write(fmt, trace, positions, dtype, rows_layout, None)
            return
        try:
            with replacing(output) as temporary:
                _write(fmt, trace, positions, dtype, rows_layout, temporary)
        except OSError as exc:
            raise MoetraceError(f"cannot write {output}: {exc.strerror or exc}") from None


def _write(fmt: str, trace, positions, dtype: str, layout, path: Path | None) -> None:
    """One format to ``path``, or to standard output when None."""
    from moetrace.analysis.export import (
        selected_requests,
        write_jsonl,
        write_npy,
        write_npz,
        write_parquet,
    )

    if fmt == "jsonl":
        if path is None:
            write_jsonl(selected_requests(trace, positions), sys.stdout, dtype, layout)
            return
        with open(path, "w", encoding="utf-8") as f:
            write_jsonl(selected_requests(trace, positions), f, dtype, layout)
        return
    with contextlib.ExitStack() as stack:
        out = sys.stdout.buffer if path is None else stack.enter_context(open(path, "wb"))
        if fmt == "npz":
            write_npz(trace, positions, out, dtype, layout)
        elif fmt == "npy":
            write_npy(next(selected_requests(trace, positions)), out, dtype, layout)
        else:
            write_parquet(trace, positions, out, dtype, layout)
        out.flush()
