"""Run as ``python -m moetrace``."""

from moetrace.cli.app import main

main()
