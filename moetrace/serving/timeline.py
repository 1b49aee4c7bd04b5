"""Where a serving run's time goes: the engine loop's steps, waits and arrivals, on one clock.

Off unless the environment variable ``MOETRACE_SERVE_TIMELINE`` names a JSON
file; the server writes it when it stops.  ``benchmarks/serve.py`` sets it and
prints a summary beside ``record``'s steps, so one run on the GPU says whether
serving loses its time in the steps themselves (the engine thread waiting for
the GIL: wall time minus its CPU time), between steps (the loop's own work),
idle (no work arrived yet), or before and after (the client's arrival ramp,
answers still being built and sent).

Every time is ``time.monotonic()``, one clock for all processes of a host, so
a client can cut out the window it measured.  Costs a few microseconds per
step when on; nothing when off.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from moetrace import envs

ENV = "MOETRACE_SERVE_TIMELINE"

STEP_COLUMNS = (
    "loop_start",  # the loop iteration began (the inbox is emptied next)
    "step_start",  # LLMEngine.step() called
    "step_end",  # ... returned
    "loop_end",  # the step's events handed to the HTTP side
    "step_cpu_s",  # the engine thread's CPU time inside step()
    "loop_cpu_s",  # its CPU time over the whole iteration
    "running",  # scheduler's running requests when the step began
    "waiting",  # ... and waiting ones
    "inbox",  # adds and aborts taken from the inbox this iteration
    "finished",  # requests that ended in this step
)


def timeline_path() -> Path | None:
    return envs.get(ENV)


@dataclass
class Timeline:
    """The samples of one run; appended from the engine thread and the event loop."""

    steps: list[tuple] = field(default_factory=list)
    idle: list[tuple[float, float]] = field(default_factory=list)  # engine had no work
    arrivals: list[float] = field(default_factory=list)  # a request reached the engine's inbox
    # (time, event-loop thread CPU s, process CPU s), every SAMPLE_S on the event loop
    cpu: list[tuple[float, float, float]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    SAMPLE_S = 0.02

    def step(self, *values) -> None:
        self.steps.append(values)

    async def sample_cpu(self) -> None:
        """Samples the event loop thread's and the process's CPU time until cancelled."""
        while True:
            self.cpu.append((time.monotonic(), time.thread_time(), time.process_time()))
            await asyncio.sleep(self.SAMPLE_S)

    def to_json(self) -> dict:
        return {
            "step_columns": list(STEP_COLUMNS),
            "steps": [list(s) for s in self.steps],
            "idle": [list(i) for i in self.idle],
            "arrivals": self.arrivals,
            "cpu_columns": ["time", "event_loop_thread_cpu_s", "process_cpu_s"],
            "cpu": [list(c) for c in self.cpu],
            "started": self.started,
            "pid": os.getpid(),
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))
