"""``moetrace export``: requests out of a trace, for shell pipelines and other tools."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import typer

from moetrace.cli.trace_notes import note_if_being_written, unchecked_read_advice
from moetrace.errors import MoetraceError
from moetrace.output_files import (
    STDOUT,
    check_new_output,
    check_not_an_input,
    refuse_binary_terminal,
    replacing,
)
from moetrace.trace.checked_rows import DamagedTraceError
from moetrace.trace.reader import open_trace


def export_command(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace file."),
    fmt: str | None = typer.Option(
        None,
        "--format",
        "-f",
        help="jsonl, npz, npy, parquet; openai-batch: the lines vllm run-batch writes; eplb "
        "(JSON) or eplb-npy: the per-layer expert load matrix DeepSeek's EPLB takes (default: "
        "from OUTPUT's extension, else jsonl).",
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
    array: str = typer.Option(
        "routed_experts",
        "--array",
        help="npy: which array of the request: routed_experts, routed_weights or token_logprobs.",
    ),
    part: str = typer.Option(
        "all", "--part", help="eplb formats: the load of all, prompt or output tokens."
    ),
    window_tokens: int | None = typer.Option(
        None,
        "--window-tokens",
        help="eplb formats: also one load matrix per N tokens, in record order.",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    no_verify_checksums: bool = typer.Option(
        False,
        "--no-verify-checksums",
        help="Do not check each request's checksum as it is read (faster; damage goes unseen).",
    ),
) -> None:
    """Write requests of TRACE as JSON Lines (one request a line), .npz, .npy or Parquet.

    Each JSON line has id, sample_index, index, finish_reason, stop_reason,
    prompt_token_ids, output_token_ids and routed_experts: base64 of the .npy
    bytes (as vLLM sends it; SGLang sends raw int32 bytes instead), with shape and dtype; and what else the trace
    holds: routed_weights (the same encoding), token_logprobs (one per output
    token) and sampling_params.  Decode with
    np.load(io.BytesIO(base64.b64decode(line["routed_experts"]))).
    npz and Parquet carry the same fields; npy one array of one request.
    Parquet has one row per request (pandas, datasets, Arrow read it).
    openai-batch writes what vllm run-batch would have (one line per input line:
    custom_id, response.body with choices[].text or .message.content,
    token_ids and routed_experts).
    eplb writes the [num_moe_layers, num_experts] token-expert counts of the
    selection (EPLB's weight) as JSON, eplb-npy as .npy ([windows, layers,
    experts] with --window-tokens).  Binary formats go to standard output only
    when it is not a terminal.

    Example: moetrace export t.h5 | head -1 | jq .shape
    """
    from moetrace.analysis.export import Layout, check_array, check_format
    from moetrace.analysis.load import select_positions

    fmt = _checked_format(fmt, output, dtype, array, part, window_tokens)
    to_stdout = output == STDOUT
    _check_output(output, fmt, trace_path, overwrite=overwrite)
    with unchecked_read_advice(), open_trace(trace_path, verify=not no_verify_checksums) as trace:
        note_if_being_written(trace)
        rows_layout = Layout.of(trace, layout)
        positions = select_positions(trace, request, request_range)
        check_format(fmt, trace.num_requests if positions is None else len(positions))
        if fmt == "npy":
            check_array(trace, array)
        what = (positions, dtype, rows_layout, part, window_tokens, array)
        if to_stdout:  # a closed pipe (`| head`) ends the command quietly
            _write(fmt, trace, what, None)
            return
        try:
            with replacing(output) as temporary:
                _write(fmt, trace, what, temporary)
        except DamagedTraceError:  # a chunk of the trace that cannot be read, not the output
            raise
        except OSError as exc:
            raise MoetraceError(f"cannot write {output}: {exc.strerror or exc}") from None


def _checked_format(
    fmt: str | None, output: str, dtype: str, array: str, part: str, window_tokens: int | None
) -> str:
    """The format (given, or from OUTPUT's name), once the options that go with it check out."""
    from moetrace.analysis.export import DTYPES, LOAD_FORMATS, check_format, format_for_output
    from moetrace.analysis.load import PARTS

    try:
        fmt = format_for_output(fmt, output)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--format'") from None
    if dtype not in DTYPES:
        raise MoetraceError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_format(fmt, 1)
    if fmt != "npy" and array != "routed_experts":
        raise typer.BadParameter(
            f"applies to --format npy (the {fmt} format holds every array)", param_hint="'--array'"
        )
    if fmt not in LOAD_FORMATS and (part != "all" or window_tokens is not None):
        raise MoetraceError("--part and --window-tokens apply to --format eplb and eplb-npy")
    if part not in PARTS:
        raise MoetraceError(f"--part must be one of {', '.join(PARTS)}, got {part!r}")
    if window_tokens is not None and window_tokens < 1:
        raise MoetraceError(f"--window-tokens must be at least 1, got {window_tokens}")
    return fmt


def _check_output(output: str, fmt: str, trace_path: Path, *, overwrite: bool) -> None:
    """Before the trace is read: binary never to a terminal, a file only as any output may be."""
    from moetrace.analysis.export import BINARY_FORMATS

    if output == STDOUT:
        if fmt in BINARY_FORMATS:
            refuse_binary_terminal(fmt, sys.stdout)
    else:
        check_not_an_input(output, [("the trace being exported", trace_path)])
        check_new_output(output, overwrite=overwrite)


def _write(fmt: str, trace, what: tuple, path: Path | None) -> None:
    """One format to ``path``, or to standard output when None."""
    from moetrace.analysis.export import selected_requests, write_jsonl, write_npy, write_npz
    from moetrace.analysis.export_parquet import write_parquet
    from moetrace.analysis.openai_batch import write_openai_batch

    positions, dtype, layout, part, window_tokens, array = what
    if fmt in ("eplb", "eplb-npy"):
        _write_load(fmt, trace, positions, part, window_tokens, path)
        return
    if fmt in ("jsonl", "openai-batch"):
        with contextlib.ExitStack() as stack:
            out = (
                sys.stdout
                if path is None
                else stack.enter_context(open(path, "w", encoding="utf-8"))
            )
            if fmt == "jsonl":
                write_jsonl(selected_requests(trace, positions), out, dtype, layout)
            else:
                write_openai_batch(trace, positions, out, dtype)
        return
    with contextlib.ExitStack() as stack:
        out = sys.stdout.buffer if path is None else stack.enter_context(open(path, "wb"))
        if fmt == "npz":
            write_npz(trace, positions, out, dtype, layout)
        elif fmt == "npy":
            write_npy(next(selected_requests(trace, positions)), out, dtype, layout, array)
        else:
            write_parquet(trace, positions, out, dtype, layout)
        out.flush()


def _write_load(
    fmt: str, trace, positions, part: str, window_tokens: int | None, path: Path | None
) -> None:
    """The selection's expert load matrix (``analysis/eplb.py``), JSON or ``.npy``."""
    import numpy as np

    from moetrace.analysis.eplb import WindowedLoad, load_document
    from moetrace.analysis.load import RowStream, Selection, run

    counter = WindowedLoad(trace.num_moe_layers, trace.num_experts, window_tokens)
    run(RowStream(trace, Selection(positions, part)), [counter])
    with contextlib.ExitStack() as stack:
        if fmt == "eplb":
            out = sys.stdout if path is None else stack.enter_context(open(path, "w"))
            doc = load_document(counter, trace.metadata, str(trace.path), part)
            out.write(json.dumps(doc) + "\n")
        else:
            out = sys.stdout.buffer if path is None else stack.enter_context(open(path, "wb"))
            np.save(out, counter.stacked(), allow_pickle=False)
        out.flush()
