"""``moetrace inspect``: what a trace holds and how evenly each layer spreads its load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from moetrace.trace.reader import open_trace
from moetrace.trace.stats import expert_counts, load_stats, summary


def inspect_command(
    trace_path: Path = typer.Argument(
        ..., metavar="TRACE", help="Trace file written by 'moetrace record'."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Show what TRACE holds and the per-layer expert load."""
    with open_trace(trace_path) as trace:
        info = summary(trace)
        counts = expert_counts(trace)
        stats = load_stats(counts)
        layers = list(trace.metadata["moe_layer_indices"])
    per_layer = [
        {
            "layer": int(layer),
            "min": int(stats.min[i]),
            "max": int(stats.max[i]),
            "mean": float(stats.mean[i]),
            "max_over_mean": float(stats.max_over_mean[i]),
            "normalized_entropy": float(stats.normalized_entropy[i]),
            "dead_experts": int(stats.dead[i]),
        }
        for i, layer in enumerate(layers)
    ]
    if as_json:
        typer.echo(
            json.dumps({"trace": str(trace_path), **info, "layer_load": per_layer}, default=_plain)
        )
        return
    console = Console()
    head = Table(title=str(trace_path), show_header=False, box=None)
    for key, value in info.items():
        head.add_row(key.replace("_", " "), _show(value))
    console.print(head)
    table = Table(title="expert load per MoE layer (token-expert assignments)")
    for name in ("layer", "min", "max", "mean", "max/mean", "entropy", "dead"):
        table.add_column(name, justify="right")
    for row in per_layer:
        table.add_row(
            str(row["layer"]),
            f"{row['min']:,}",
            f"{row['max']:,}",
            f"{row['mean']:,.1f}",
            f"{row['max_over_mean']:.2f}",
            f"{row['normalized_entropy']:.3f}",
            str(row["dead_experts"]),
        )
    console.print(table)


def _show(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-able: {type(value)}")
