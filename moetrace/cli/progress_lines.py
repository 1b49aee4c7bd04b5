"""Progress as log lines, for a standard error that is no terminal (Slurm logs, ``2> log``).

A progress bar redraws one line; written to a file it is either nothing or
noise, so a long run went silent until its final line.  Instead, as vLLM's
engine logs its stats every ``VLLM_LOG_STATS_INTERVAL`` seconds, a line goes
out once an interval has passed: requests done of the total, the average
prompt and generation throughput over the interval, and the time left at the
run's rate so far.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TextIO

import typer

DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


def check_interval(seconds: float) -> None:
    """``--log-stats-interval`` must be a positive number of seconds (a usage error)."""
    if not 0 < seconds < math.inf:
        raise typer.BadParameter(
            f"must be a positive number of seconds, got {seconds}",
            param_hint="'--log-stats-interval'",
        )


def clock_time(seconds: float) -> str:
    """``h:mm:ss``, as progress bars show elapsed and remaining time."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressLines:
    """Writes a progress line to ``stream`` when ``interval_s`` has passed since the last.

    ``update`` is called as work completes (after each engine step); it costs
    a clock read when no line is due.
    """

    def __init__(
        self,
        what: str,
        stream: TextIO,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.stream = stream
        self.interval_s = interval_s
        self.clock = clock
        self.started = self.last = clock()
        self.counted: dict[str, int] = {}

    def update(self, done: int, total: int | None, **tokens: int) -> None:
        """``tokens``: running token counts by kind (``prompt=``, ``generation=``), each
        shown as its average throughput over the interval."""
        now = self.clock()
        span = now - self.last
        if span < self.interval_s:
            return
        elapsed = now - self.started
        rates = "".join(
            f"avg {kind} throughput {(n - self.counted.get(kind, 0)) / span:,.1f} tokens/s, "
            for kind, n in tokens.items()
        )
        if total is None:
            count, left = f"{done:,} requests", "ETA unknown (input still streaming)"
        else:
            share = done / total if total else 1.0
            count = f"{done:,}/{total:,} requests ({100 * share:.1f}%)"
            left = f"ETA {clock_time((total - done) * elapsed / done)}" if done else "ETA unknown"
        print(
            f"{self.what}: {count}, {rates}elapsed {clock_time(elapsed)}, {left}",
            file=self.stream,
            flush=True,
        )
        self.last, self.counted = now, dict(tokens)
