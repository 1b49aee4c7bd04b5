"""The package version, in a module of its own so the trace writer can stamp it
without importing the package root (which imports the trace reader)."""

__version__ = "0.1.0"
