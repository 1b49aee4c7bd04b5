"""``moetrace verify``: is a trace complete, and is everything in it what was written?"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moetrace.trace.verify import verify_guarded

SHOWN = 20  # problems listed before "... and N more" (--json lists all)


def verify_command(
    trace_path: Path = typer.Argument(
        ..., metavar="TRACE", help="Trace file written by 'moetrace record'."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check TRACE: completion marker, every record's rows and checksum, the root counts.

    Exit status: 0 complete and intact; 1 damaged (truncated, altered, inconsistent);
    3 incomplete but intact (finish it with 'moetrace record ... --resume').
    """
    report = verify_guarded(trace_path)
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    else:
        for problem in report.problems[:SHOWN]:
            typer.echo(f"problem: {problem}")
        if len(report.problems) > SHOWN:
            typer.echo(f"problem: ... and {len(report.problems) - SHOWN} more (see --json)")
        for note in report.notes:
            typer.echo(f"note: {note}")
        typer.echo(report.summary())
    raise typer.Exit(report.exit_code)
