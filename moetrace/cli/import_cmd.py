"""``moetrace import``: routed experts returned by vLLM or SGLang, as a moetrace trace."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from moetrace.errors import MoetraceError

if TYPE_CHECKING:  # the importers load only when the command runs
    from moetrace.analysis.importers import Importer, ModelShape


def import_command(
    responses: list[str] = typer.Argument(
        ...,
        metavar="RESPONSES",
        help="JSON or JSON Lines files of engine responses, or '-' for standard input.",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write (HDF5)."),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Checkpoint directory (its config.json gives layers, experts, top-k) or 'demo'.",
    ),
    engine: str = typer.Option("auto", "--engine", help="auto, vllm, sglang or moetrace."),
    num_layers: int | None = typer.Option(
        None, "--num-layers", help="Decoder layers (the engines' layer axis); overrides --model."
    ),
    moe_layers: str | None = typer.Option(
        None, "--moe-layers", help="Decoder layers that route, e.g. 3-60 (default: from config)."
    ),
    num_experts: int | None = typer.Option(None, "--num-experts", help="Routed experts per layer."),
    top_k: int | None = typer.Option(None, "--top-k", help="Experts per token."),
    name: str | None = typer.Option(None, "--name", help="Model name to record in the trace."),
    dtype: str = typer.Option(
        "unknown", "--dtype", help="Compute dtype the engine ran in, for the record."
    ),
    layout: str = typer.Option(
        "auto",
        "--layout",
        help="The layer axis of the routing: vllm (every hidden layer, dense ones zero: vLLM "
        "and SGLang), moe (MoE layers only), auto (what the data allows; ambiguous is refused).",
    ),
    allow_missing_tokens: bool = typer.Option(
        False,
        "--allow-missing-tokens",
        help="Store token ids the response lacks as -1 (counts from usage).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
) -> None:
    """Turn vLLM / SGLang responses with routed experts into a trace for inspect and diff.

    vLLM: serve with --enable-return-routed-experts and request with
    return_token_ids; save each JSON response (or a batch output file).
    SGLang: --enable-return-routed-experts and return_routed_experts=true.

    Example: moetrace import vllm_out.jsonl --model ~/models/Qwen3-30B-A3B -o vllm.h5
    """
    from moetrace.analysis.importers import ENGINES, Importer, model_shape
    from moetrace.output_files import check_new_output, check_not_an_input

    if engine not in ENGINES:
        raise MoetraceError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    check_not_an_input(output, [(f"the response file {p}", p) for p in responses if p != "-"])
    check_new_output(output, overwrite=overwrite)
    shape = model_shape(
        model,
        num_layers=num_layers,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        name=name,
    )
    importer = Importer(shape, allow_missing_tokens=allow_missing_tokens, layout=layout)
    _write_trace(output, shape, dtype, importer, responses, engine)
    note = f", dropped a trailing row in {importer.trimmed}" if importer.trimmed else ""
    Console(stderr=True).print(
        f"[green]wrote[/green] {output}: {importer.count} requests from "
        f"{', '.join(sorted(importer.engines))} responses{note}",
        highlight=False,
    )


def _write_trace(
    output: Path,
    shape: ModelShape,
    dtype: str,
    importer: Importer,
    responses: list[str],
    engine: str,
) -> None:
    """Every response's sequences through ``importer`` into a trace at ``output``.

    Written beside OUTPUT and renamed over it only when every response went in: a bad
    response file must not cost the user the trace that --overwrite was to replace.
    """
    from moetrace.analysis.importers import read_values, sequences
    from moetrace.output_files import replacing
    from moetrace.trace.lock import TraceLock
    from moetrace.trace.writer import TraceWriter

    settings = {"imported_from": [str(p) for p in responses], "engine": engine}
    lock = TraceLock(output).acquire()
    try:
        with replacing(output) as temporary:
            writer = TraceWriter(temporary, shape.metadata(dtype, settings), lock=lock)
            writer.start()
            ok = False
            try:
                for where, value in read_values(responses):
                    for seq in sequences(value, where, engine):
                        writer.submit(importer.request(seq))
                if importer.count == 0:
                    raise MoetraceError("no responses found in " + ", ".join(responses))
                ok = True
            finally:
                writer.close(complete=ok)
    finally:
        lock.release()
