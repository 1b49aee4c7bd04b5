"""``moetrace merge``: one trace from the shards of a recording."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def merge_command(
    output: Path = typer.Argument(..., metavar="OUT", help="Trace file to write."),
    shards: list[Path] = typer.Argument(..., metavar="SHARD...", help="Shard traces, in order."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="Merge shards whose recording did not finish."
    ),
) -> None:
    """Combine traces of the same model recorded as shards into OUT.

    Shards of different models (config digest), routing shapes, dtypes or
    formats are refused, and so are request ids that appear in two shards.
    Example: moetrace merge all.h5 shard0.h5 shard1.h5
    """
    from moetrace.analysis.merge import merge_traces

    result = merge_traces(output, shards, overwrite=overwrite, allow_incomplete=allow_incomplete)
    console = Console(stderr=True)
    for note in result["notes"]:
        console.print(f"[yellow]note[/yellow] {note}", highlight=False)
    console.print(
        f"[green]wrote[/green] {output}: {result['requests']:,} requests, {result['rows']:,} rows "
        f"from {result['shards']} shards",
        highlight=False,
    )
