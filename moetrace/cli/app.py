"""The ``moetrace`` command: record, serve, replay, inspect, export, diff, import, merge, verify."""

from __future__ import annotations

import sys

import typer

from moetrace import __version__
from moetrace.cli.diff_cmd import diff_command
from moetrace.cli.export_cmd import export_command
from moetrace.cli.help_format import HelpCommand
from moetrace.cli.import_cmd import import_command
from moetrace.cli.inspect_cmd import inspect_command
from moetrace.cli.merge_cmd import merge_command
from moetrace.cli.pipes import quiet_on_closed_pipe
from moetrace.cli.record_cmd import record_command
from moetrace.cli.replay_cmd import replay_command
from moetrace.cli.serve_cmd import serve_command
from moetrace.cli.verify_cmd import verify_command
from moetrace.errors import MoetraceError, UsageError

app = typer.Typer(
    name="moetrace",
    help="Record which experts a Mixture-of-Experts model routes every token to, into HDF5.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help (cli/help_format.py) and usage errors
)


for _name, _command in (
    ("record", record_command),
    ("serve", serve_command),
    ("replay", replay_command),
    ("inspect", inspect_command),
    ("export", export_command),
    ("diff", diff_command),
    ("import", import_command),
    ("merge", merge_command),
    ("verify", verify_command),
):
    app.command(_name, no_args_is_help=True, cls=HelpCommand)(quiet_on_closed_pipe(_command))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moetrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """moetrace: MoE routing traces."""


def main() -> None:
    """Console entry point.

    Typer runs in its standalone mode, so usage errors (unknown command or
    option, missing argument, no arguments at all) print click's usage message
    and exit 2, ``typer.Exit`` codes pass through and Ctrl-C exits 130.  Errors
    the user can fix in their input raise ``MoetraceError``: one line, exit 1;
    an option value only the model or the trace can refuse, ``UsageError``:
    one line, exit 2.
    """
    try:
        app(prog_name="moetrace")
    except MoetraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, UsageError) else 1)


if __name__ == "__main__":
    main()
