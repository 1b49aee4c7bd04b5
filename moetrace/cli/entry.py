"""The console entry point: signal handlers first, everything heavy after.

Importing the command line (typer, rich, and for ``record`` torch and the
engine) takes a second or two; a Ctrl-C in that time must end with one line
and exit 130 like at any later moment, not with a traceback.  So this module
imports nothing but ``moetrace.signals`` before it installs the handlers.
"""

from __future__ import annotations


def main() -> None:
    from moetrace.signals import install_exit_handlers

    install_exit_handlers()
    from moetrace.cli.app import main as run

    run()
