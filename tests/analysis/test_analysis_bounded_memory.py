"""inspect of a 1,000,000-row trace reads it chunk by chunk: memory does not grow with the file."""

from __future__ import annotations

import importlib.util
import time
import tracemalloc
from pathlib import Path

from moetrace import open_trace
from moetrace.analysis.report import InspectOptions, inspect_report

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "inspect_1m.py"
ROWS, LAYERS, EXPERTS, TOP_K = 1_000_000, 8, 64, 4


def _make_trace():
    spec = importlib.util.spec_from_file_location("inspect_1m", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_trace


def test_inspect_of_a_million_rows_in_bounded_memory(tmp_path):
    path = tmp_path / "big.h5"
    counts = _make_trace()(path, ROWS, LAYERS, EXPERTS, TOP_K, requests=500)
    row_bytes = ROWS * LAYERS * TOP_K  # 32 MB of uint8 ids; 256 MB once widened to intp
    opts = InspectOptions(ep_size=8)  # the default views (summary, load) and expert parallelism
    with open_trace(path) as trace:
        assert trace.num_rows == ROWS
        tracemalloc.start()
        start = time.perf_counter()
        report = inspect_report(trace, opts)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert report["expert_counts"] == counts.tolist()
    assert report["selection"]["rows"] == ROWS
    assert sum(layer["rank_load"][0] for layer in report["ep"]["layers"]) > 0
    # Peak Python/numpy allocation of the whole pass: a few chunks, not the file.
    assert peak < row_bytes / 2, f"peak {peak / 2**20:.1f} MiB for {row_bytes / 2**20:.0f} MiB"
    print(f"\n1M rows: {elapsed:.1f} s, tracemalloc peak {peak / 2**20:.1f} MiB")
