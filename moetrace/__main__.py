"""Run as ``python -m moetrace``."""

from moetrace.cli.entry import main

main()
