"""The scripts under benchmarks/ as modules: they import each other by bare name."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported as its siblings import it.

    The folder is on ``sys.path`` only while it imports (the scripts put it there
    themselves): left there, its bare-named scripts could answer an import of a
    same-named package in every later test of the process.
    """
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
