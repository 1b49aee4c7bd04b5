"""The ``moetrace`` command: record, inspect."""

from __future__ import annotations

import sys

import typer

from moetrace import __version__
from moetrace.cli.diff_cmd import diff_command
from moetrace.cli.export_cmd import export_command
from moetrace.cli.import_cmd import import_command
from moetrace.cli.inspect_cmd import inspect_command
from moetrace.cli.merge_cmd import merge_command
from moetrace.cli.record_cmd import record_command
from moetrace.cli.verify_cmd import verify_command
from moetrace.errors import MoetraceError

app = typer.Typer(
    name="moetrace",
    help="Record which experts a Mixture-of-Experts model routes every token to, into HDF5.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
app.command("record", no_args_is_help=True)(record_command)
app.command("inspect", no_args_is_help=True)(inspect_command)
app.command("export", no_args_is_help=True)(export_command)
app.command("diff", no_args_is_help=True)(diff_command)
app.command("import", no_args_is_help=True)(import_command)
app.command("merge", no_args_is_help=True)(merge_command)
app.command("verify", no_args_is_help=True)(verify_command)


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
    """Console entry point: user errors become one line on stderr, exit code 2... or 1."""
    try:
        # Outside standalone mode click returns a command's typer.Exit code instead of exiting.
        code = app(standalone_mode=False)
    except MoetraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
