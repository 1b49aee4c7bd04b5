"""``moetrace merge``: one trace from the shards of a recording."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def merge_command(
    output: Path = typer.Argument(..., metavar="OUT", help="Trace file to write."),
    shards: list[Path] = typer.Argument(..., metavar="SHARD", help="Shard traces, in order."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="Merge shards whose recording did not finish."
    ),
    as_complete: bool = typer.Option(
        False,
        "--as-complete",
        help="Mark OUT complete although shards are missing or incomplete (the subset is "
        "all you want).",
    ),
    mixed_settings: bool = typer.Option(
        False,
        "--mixed-settings",
        help="Merge traces recorded with other sampling settings or seeds (not shards of one "
        "run): each request keeps the settings it ran with; OUT states no run-wide ones.",
    ),
) -> None:
    """Combine traces of the same model recorded as shards into OUT.

    Shards of different models (config digest), routing shapes, dtypes,
    formats or run settings (those --resume compares) are refused, and so are
    request ids that appear in two shards.
    Without every shard of a --num-shards split (or with an incomplete shard)
    OUT is marked incomplete, as verify reports, unless --as-complete.
    Example: moetrace merge all.h5 shard0.h5 shard1.h5
    """
    from moetrace.analysis.merge import merge_traces

    result = merge_traces(
        output,
        shards,
        overwrite=overwrite,
        allow_incomplete=allow_incomplete,
        as_complete=as_complete,
        mixed_settings=mixed_settings,
    )
    console = Console(stderr=True)
    for note in result["notes"]:
        console.print(f"[yellow]note[/yellow] {note}", highlight=False)
    partial = "; ".join(result["partial"])
    if mixed_settings:
        console.print(
            "[yellow]note[/yellow] mixed settings: each request keeps its own (sampling_params)",
            highlight=False,
        )
    state = (
        "complete"
        if not partial
        else f"marked complete as asked ({partial})"
        if result["complete"]
        else f"marked incomplete: {partial} (--as-complete to mark it complete)"
    )
    console.print(
        f"[green]wrote[/green] {output}: {result['requests']:,} requests, {result['rows']:,} rows "
        f"from {result['shards']} shards, {state}",
        highlight=False,
        soft_wrap=True,
    )
