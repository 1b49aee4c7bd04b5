"""``moetrace inspect``: what a trace holds and how it routes (views in moetrace.analysis)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console

from moetrace.analysis.views import registry
from moetrace.cli.pipes import StdoutConsole
from moetrace.cli.trace_notes import note_if_being_written, unchecked_read_advice
from moetrace.trace.reader import open_trace

VIEW_HELP = "; ".join(f"{v.name}: {v.help}" for v in registry())
ALL_HELP = ", ".join(v.name for v in registry() if v.in_all and not v.default)
DEFAULT_HELP = " and ".join(v.name for v in registry() if v.default)


def inspect_command(
    trace_path: Path = typer.Argument(
        ..., metavar="TRACE", help="Trace file written by 'moetrace record'."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    view: list[str] = typer.Option(
        [],
        "--view",
        "-v",
        help=f"{VIEW_HELP} (repeat; default: {DEFAULT_HELP}).",
    ),
    all_views: bool = typer.Option(False, "--all", help=f"Add {ALL_HELP}."),
    request: list[str] = typer.Option(
        [], "--request", "-r", help="Only this request id (repeat; globs work); shows its tokens."
    ),
    request_range: list[str] = typer.Option(
        [], "--range", help="Only records START:STOP of the request table (repeat)."
    ),
    part: str = typer.Option("all", "--part", help="all, prompt or output tokens."),
    layer: list[int] = typer.Option(
        [], "--layer", help="Only this MoE layer (decoder index; repeat)."
    ),
    ep_size: int | None = typer.Option(
        None, "--ep-size", min=1, help="Expert-parallel ranks: adds the ep view."
    ),
    ep_placement: str = typer.Option(
        "contiguous", "--ep-placement", help="contiguous (vLLM linear) or round-robin."
    ),
    redundant_experts: int = typer.Option(
        0,
        "--redundant-experts",
        help="With --ep-size: replicate this many experts, placed by balanced packing (EPLB's "
        "idea), and show the ranks' imbalance before and after.",
    ),
    ep_map: Path | None = typer.Option(
        None, "--ep-map", help="JSON expert->rank list (or one list per MoE layer)."
    ),
    expert: list[str] = typer.Option(
        [], "--expert", help="LAYER:EXPERT: the tokens routed to it most (repeat)."
    ),
    token: list[str] = typer.Option([], "--token", help="Token id: its usual experts (repeat)."),
    token_text: list[str] = typer.Option(
        [], "--token-text", help="Like --token, by text (must be one token)."
    ),
    top: int = typer.Option(5, "--top", help="Pairs or tokens listed per layer."),
    rank_by: str = typer.Option("count", "--rank-by", help="Order pairs by count or lift."),
    limit: int = typer.Option(20, "--limit", min=0, help="Requests in per-request views (0: all)."),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="tokenizer.json to decode tokens (default: the trace's)."
    ),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="Write a layer x expert heatmap + imbalance chart (.png .svg .pdf .html).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --plot file."),
    chunk_rows: int = typer.Option(16384, "--chunk-rows", help="Rows read at a time.", hidden=True),
    no_verify_checksums: bool = typer.Option(
        False,
        "--no-verify-checksums",
        help="Do not check each request's checksum as it is read (faster; damage goes unseen).",
    ),
) -> None:
    """Show what TRACE holds and how it routes: load, EP balance, locality, pairs, tokens.

    Examples: moetrace inspect t.h5 --all --ep-size 4;
    moetrace inspect t.h5 --request q1 --layer 1;
    moetrace inspect t.h5 --expert 2:7 --token-text e --plot load.png
    """
    from moetrace.analysis.report import InspectOptions, inspect_report
    from moetrace.analysis.views import render_report

    opts = InspectOptions(
        views=view,
        all_views=all_views,
        request_ids=request,
        ranges=request_range,
        part=part,
        layers=layer,
        ep_size=ep_size,
        ep_placement=ep_placement,
        ep_map=ep_map,
        redundant_experts=redundant_experts,
        experts=expert,
        tokens=token,
        token_texts=token_text,
        top=top,
        rank_by=rank_by,
        limit=limit,
        chunk_rows=chunk_rows,
        tokenizer=tokenizer,
    )
    if plot is not None:
        from moetrace.analysis.plots import check_plot_path

        check_plot_path(plot, overwrite=overwrite, inputs=[trace_path])
        if "load" not in (opts.views or ["load"]):
            opts.views = [*opts.views, "load"]
    with unchecked_read_advice(), open_trace(trace_path, verify=not no_verify_checksums) as trace:
        note_if_being_written(trace)
        report = inspect_report(trace, opts)
    if plot is not None:
        _plot(report, plot)
    if as_json:
        typer.echo(json.dumps(report, default=_plain))
        return
    render_report(StdoutConsole(), report)
    if plot is not None:
        Console(stderr=True).print(f"[green]wrote[/green] {plot}", highlight=False)


def _plot(report: dict, path: Path) -> None:
    from moetrace.analysis.plots import plot_load

    sel = report["selection"]
    plot_load(
        np.asarray(report["expert_counts"]),
        sel["layers"],
        path,
        title=f"{report['model']}: expert load ({Path(report['trace']).name})",
        subtitle=f"{_n(sel['requests'], 'request')}, {_n(sel['rows'], 'token')}"
        + ("" if sel["part"] == "all" else f" ({sel['part']} only)")
        + f", {report['experts']} experts, top-{report['top_k']}",
        ep=report.get("ep"),
    )


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-able: {type(value)}")
