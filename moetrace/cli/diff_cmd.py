"""``moetrace diff``: routing agreement between two traces of the same requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from moetrace.analysis.diff import diff_exit_code, diff_traces
from moetrace.analysis.views._tables import id_table
from moetrace.cli.pipes import StdoutConsole, stop_quietly
from moetrace.errors import MoetraceError
from moetrace.trace.reader import open_trace


def diff_command(
    trace_a: Path = typer.Argument(..., metavar="A", help="First trace."),
    trace_b: Path = typer.Argument(..., metavar="B", help="Second trace (same requests)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    match: str = typer.Option("id", "--match", help="Pair requests by 'id' or by input 'index'."),
    request: list[str] = typer.Option([], "--request", "-r", help="Only this request id (repeat)."),
    limit: int = typer.Option(
        10,
        "--limit",
        min=0,
        help="Requests listed in detail (0: all; JSON lists up to 50 by default).",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write per-layer mismatch charts (.png .svg .pdf .html)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --plot file."),
) -> None:
    """Compare the routing of A and B token by token: per-layer and per-token mismatch,
    Jaccard overlap of the top-k sets, first diverging layer (R3's figures).

    Where the generated tokens part ways, only the common prefix is compared.
    Two verdicts: routing (over the compared rows) and sequences (tokens,
    lengths, requests). Exit code as diff(1): 0 identical, 1 different,
    2 trouble (nothing to compare, unreadable input).
    Example: moetrace diff bf16.h5 fp32.h5
    """
    try:
        result = _diff(trace_a, trace_b, as_json, match, request, limit, plot, overwrite)
    except MoetraceError as exc:  # diff(1)'s "trouble"
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    code = diff_exit_code(result)
    # The verdict is the exit code, also for `moetrace diff a b | head -1`.
    try:
        if as_json:
            typer.echo(json.dumps(result))
            sys.stdout.flush()
        else:
            render_diff(StdoutConsole(closed_pipe_code=code), result, limit)
    except BrokenPipeError:
        stop_quietly(code)
    raise typer.Exit(code)


def _diff(
    trace_a: Path,
    trace_b: Path,
    as_json: bool,
    match: str,
    request: list[str],
    limit: int,
    plot: Path | None,
    overwrite: bool,
) -> dict:
    if plot is not None:
        from moetrace.analysis.plots import check_plot_path

        check_plot_path(plot, overwrite=overwrite, inputs=[trace_a, trace_b])
    with open_trace(trace_a) as a, open_trace(trace_b) as b:
        result = diff_traces(
            a, b, match=match, ids=request or None, detail_limit=limit if not as_json else 50
        )
    if plot is not None:
        from moetrace.analysis.plots import plot_diff

        plot_diff(
            result,
            plot,
            title=f"routing mismatch: {trace_a.name} vs {trace_b.name}",
            subtitle=f"{result['tokens']:,} tokens compared; "
            f"{_pct(result['token_mismatch'])} differ in at least one layer",
        )
    return result


def _routing_verdict(d: dict) -> str:
    """Over the rows both runs computed from the same tokens (the common prefixes)."""
    verdict, tokens = d["verdict"]["routing"], d["tokens"]
    if verdict == "nothing compared":
        return "[yellow]nothing compared[/yellow]"
    if verdict == "identical":
        return f"identical at all {tokens:,} tokens compared"
    return f"differs at {d['tokens_with_difference']:,} of the {tokens:,} tokens compared"


def _sequence_verdict(d: dict) -> str:
    req = d["requests"]
    reasons = [
        f"generated tokens diverge in {req['tokens_diverged']:,} request(s)"
        if req["tokens_diverged"]
        else "",
        f"one run is shorter in {req['one_is_shorter']:,} request(s)"
        if req["one_is_shorter"]
        else "",
        f"{req['only_in_a']:,} request(s) only in A" if req["only_in_a"] else "",
        f"{req['only_in_b']:,} only in B" if req["only_in_b"] else "",
    ]
    reasons = [r for r in reasons if r]
    if not reasons:
        return "identical (same requests, same tokens)"
    left_out = f" ({d['rows_excluded']:,} rows past the common prefix left out)"
    return "differ: " + "; ".join(reasons) + (left_out if d["rows_excluded"] else "")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def render_diff(console: Console, d: dict, limit: int) -> None:
    """The tables of a ``diff_traces`` result (``diff`` and ``replay`` print them)."""
    console.print(_summary_table(d))
    console.print(_layer_table(d["layers"]))
    console.print(_token_table(d["layers_differing_histogram"]))
    details = d["request_detail"]
    if details:
        console.print(_request_table(details[: limit or None], console.width))


def _summary_table(d: dict) -> Table:
    """Verdicts, request counts, the mismatch shares, log-prob drift and the notes."""
    req = d["requests"]
    head = Table(show_header=False, box=None, title=f"{d['a']}  vs  {d['b']}")
    head.add_row("verdict", f"[bold]{'identical' if d['identical'] else 'different'}[/bold]")
    head.add_row("routing", _routing_verdict(d))
    head.add_row("sequences", _sequence_verdict(d))
    head.add_row(
        "requests",
        f"{req['compared']:,} compared by {d['match']}; {req['only_in_a']:,} only in A, "
        f"{req['only_in_b']:,} only in B",
    )
    if req["prompts_differ"]:
        head.add_row("prompts differ", f"in {req['prompts_differ']:,} request(s)")
    head.add_row("token mismatch", f"{_pct(d['token_mismatch'])} (any layer's top-k set differs)")
    head.add_row("router mismatch", f"{_pct(d['router_mismatch'])} (token x layer sets differ)")
    head.add_row("top-1 mismatch", _pct(d["top1_mismatch"]))
    mj = d["mean_jaccard"]
    head.add_row("mean Jaccard", "-" if mj is None else f"{mj:.4f}")
    for name, part in d["by_part"].items():
        if part["tokens"]:
            head.add_row(
                f"{name} tokens",
                f"{part['tokens']:,}: token mismatch {_pct(part['token_mismatch'])}, "
                f"router mismatch {_pct(part['router_mismatch'])}",
            )
    lp = d.get("logprobs")
    if lp:
        _add_logprob_rows(head, lp)
    for w in d["warnings"]:
        head.add_row("[yellow]note[/yellow]", w)
    if req["only_in_a_ids"]:
        head.add_row("only in A", ", ".join(req["only_in_a_ids"]))
    if req["only_in_b_ids"]:
        head.add_row("only in B", ", ".join(req["only_in_b_ids"]))
    return head


def _add_logprob_rows(head: Table, lp: dict) -> None:
    """The drift of the output log-probabilities, when both traces hold them."""
    head.add_row(
        "log-probs",
        f"{lp['tokens']:,} output tokens: mean |d| {lp['mean_abs_logprob_diff']:.2e}, "
        f"max {lp['max_abs_logprob_diff']:.2e}",
    )
    head.add_row(
        "KL(A || B)",
        f"k3 {lp['kl_k3']:.3e}, k1 {lp['kl_k1']:.3e} (estimated on A's tokens)",
    )
    head.add_row(
        "ratio > 2",
        f"{_pct(lp['ratio_above_2'])} of tokens (probability changed by over 2x either way)",
    )


def _layer_table(layers: list[dict]) -> Table:
    """Per MoE layer: how often its top-k set and top-1 differ, and where tokens first differ."""
    t = Table(title="per layer", box=box.SIMPLE_HEAVY)
    for name in (
        "layer",
        "set differs",
        "share",
        "top-1 differs",
        "mean Jaccard",
        "first to differ",
    ):
        t.add_column(name, justify="right")
    for x in layers:
        t.add_row(
            str(x["layer"]),
            f"{x['set_differs']:,}",
            _pct(x["set_mismatch"]),
            _pct(x["top1_mismatch"]),
            "-" if x["mean_jaccard"] is None else f"{x['mean_jaccard']:.4f}",
            f"{x['first_differing']:,}",
        )
    return t


def _token_table(hist: list[int]) -> Table:
    """Tokens by how many layers' sets differ (rows with none left out)."""
    h = Table(title="per token", box=box.SIMPLE_HEAVY)
    h.add_column("layers differing", justify="right")
    h.add_column("tokens", justify="right")
    for n, count in enumerate(hist):
        if count:
            h.add_row(str(n), f"{count:,}")
    return h


def _request_table(details: list[dict], width: int) -> Table:
    """The requests that differ, one row each, as ``diff_traces`` details them."""
    headers = ("compared", "left out", "diverge at", "tokens differ", "first", "Jaccard")
    cells = [
        (
            x["id"],
            [
                f"{x['compared_rows']:,}",
                f"{x['excluded_rows']:,}",
                "-" if x["tokens_diverge_at"] is None else str(x["tokens_diverge_at"]),
                f"{x['tokens_with_difference']:,}",
                "-" if x["first_differing_token"] is None else str(x["first_differing_token"]),
                "-" if x["mean_jaccard"] is None else f"{x['mean_jaccard']:.4f}",
            ],
        )
        for x in details
    ]
    columns = [(h, "right") for h in headers]
    return id_table("requests that differ", width, columns, cells)
