"""The ``moetrace`` command: record, inspect."""

from __future__ import annotations

import sys

import typer

from moetrace import __version__
from moetrace.cli.inspect_cmd import inspect_command
from moetrace.cli.record_cmd import record_command
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
        app(standalone_mode=False)
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


if __name__ == "__main__":
    main()
