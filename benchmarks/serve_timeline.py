"""Summaries of the engine's step timeline, for ``benchmarks/serve.py``.

The server writes its timeline (``moetrace/serving/timeline.py``: each step's
wall and CPU time, the waits for work, request arrivals, the event loop's CPU)
when ``MOETRACE_SERVE_TIMELINE`` names a file; ``record``'s steps are timed in
the benchmark by wrapping ``LLMEngine.step``.  These functions cut the
measured window out of both and say where the time went:

- *off-CPU in step()*: wall minus the engine thread's CPU time inside a step;
  on a host-bound engine this is mostly waiting for the GIL (CUDA waits spin
  and count as CPU with torch's default scheduling);
- *between steps*: the loop's own work (inbox, events to the HTTP side);
- *idle*: the engine had nothing to run;
- *head* / *tail*: before the first step and after the last one in the window
  (arrivals ramping up; answers being built, sent and parsed).
"""

from __future__ import annotations

import numpy as np

BUCKETS = 8


def _stats(start, end, cpu, running) -> dict:
    wall = end - start
    return {
        "steps": int(len(start)),
        "step_wall_s": float(wall.sum()),
        "step_cpu_s": float(cpu.sum()),
        "step_off_cpu_s": float((wall - cpu).sum()),
        "step_ms_p50": float(np.percentile(wall, 50) * 1e3) if len(wall) else float("nan"),
        "step_ms_p90": float(np.percentile(wall, 90) * 1e3) if len(wall) else float("nan"),
        "mean_running": float(running.mean()) if len(running) else float("nan"),
        "span_s": float(end[-1] - start[0]) if len(start) else 0.0,
    }


def _buckets(t0: float, t1: float, start, end, cpu, running, loop_cpu=None) -> list[dict]:
    """The window in BUCKETS slices: steps begun, ms per step, batch size, CPU shares."""
    edges = np.linspace(t0, t1, BUCKETS + 1)
    out = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        sel = (start >= a) & (start < b)
        wall = end[sel] - start[sel]
        row = {
            "from_s": float(a - t0),
            "steps": int(sel.sum()),
            "ms_per_step": float(wall.mean() * 1e3) if sel.any() else 0.0,
            "off_cpu_share": float((wall - cpu[sel]).sum() / wall.sum()) if sel.any() else 0.0,
            "running": float(running[sel].mean()) if sel.any() else 0.0,
        }
        if loop_cpu is not None:
            row["event_loop_cpu_share"] = loop_cpu(b) - loop_cpu(a)
            row["event_loop_cpu_share"] /= b - a
        out.append(row)
    return out


def record_steps(steps: list[tuple]) -> dict:
    """``record``'s steps: (start, end, cpu_s, running, waiting, finished) each."""
    if not steps:
        return {"steps": 0}
    a = np.asarray(steps, dtype=np.float64)
    start, end, cpu, running = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    result = _stats(start, end, cpu, running)
    result["between_steps_s"] = result["span_s"] - result["step_wall_s"]
    result["buckets"] = _buckets(start[0], end[-1], start, end, cpu, running)
    return result


def summarise_serve(
    raw: dict, window: tuple[float, float], client: list[tuple], client_cpu_s: float
) -> dict:
    """The server's timeline over the client's measured window (monotonic times)."""
    t0, t1 = window
    col = {name: i for i, name in enumerate(raw["step_columns"])}
    steps = np.asarray(raw["steps"], dtype=np.float64).reshape(-1, len(col))
    steps = steps[(steps[:, col["step_start"]] >= t0) & (steps[:, col["step_start"]] < t1)]

    def c(name):
        return steps[:, col[name]]

    start, end = c("step_start"), c("step_end")
    result = _stats(start, end, c("step_cpu_s"), c("running"))
    result["window_s"] = t1 - t0
    result["loop_work_s"] = float(
        (c("step_start") - c("loop_start")).sum() + (c("loop_end") - c("step_end")).sum()
    )
    result["idle_s"] = float(
        sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in raw["idle"] if b > t0 and a < t1)
    )
    result["head_s"] = float(start[0] - t0) if len(start) else float("nan")
    result["tail_s"] = float(t1 - end[-1]) if len(end) else float("nan")
    result["max_waiting"] = int(c("waiting").max()) if len(start) else 0
    sent = np.array([s for s, _ in client]) - t0
    done = np.array([d for _, d in client]) - t0
    result["client_cpu_s"] = client_cpu_s
    result["client_sent_s"] = [float(sent.min()), float(sent.max())]
    result["client_done_s"] = [float(done.min()), float(done.max())]
    arrivals = np.array([a for a in raw["arrivals"] if t0 <= a < t1]) - t0
    result["arrivals"] = int(len(arrivals))
    result["arrived_s"] = (
        [float(arrivals.min()), float(arrivals.max())] if len(arrivals) else [0.0, 0.0]
    )
    cpu = np.asarray(raw["cpu"], dtype=np.float64).reshape(-1, 3)
    if len(cpu) > 1:

        def at(t: float, column: int = 1) -> float:
            return float(np.interp(t, cpu[:, 0], cpu[:, column]))

        result["event_loop_cpu_s"] = at(t1) - at(t0)
        result["process_cpu_s"] = at(t1, 2) - at(t0, 2)
        loop_cpu = at
    else:
        result["event_loop_cpu_s"] = result["process_cpu_s"] = float("nan")
        loop_cpu = None
    result["buckets"] = _buckets(t0, t1, start, end, c("step_cpu_s"), c("running"), loop_cpu)
    return result


def _table(buckets: list[dict]) -> list[str]:
    lines = []
    for b in buckets:
        loop = b.get("event_loop_cpu_share")
        lines.append(
            f"    from {b['from_s']:6.2f} s: {b['steps']:4d} steps, {b['ms_per_step']:6.2f} ms "
            f"each, {b['running']:5.1f} running, off-CPU {100 * b['off_cpu_share']:4.1f}%"
            + ("" if loop is None else f", event loop busy {100 * loop:4.1f}%")
        )
    return lines


def describe_serve(t: dict) -> str:
    lines = [
        f"  serve timeline over the measured {t['window_s']:.2f} s:",
        f"    client sent requests at {t['client_sent_s'][0]:.2f}-{t['client_sent_s'][1]:.2f} s, "
        f"got answers at {t['client_done_s'][0]:.2f}-{t['client_done_s'][1]:.2f} s; "
        f"{t['arrivals']} reached the engine at {t['arrived_s'][0]:.2f}-{t['arrived_s'][1]:.2f} s; "
        f"the client process used {t['client_cpu_s']:.2f} s of CPU (1 core at most)",
        f"    head (before the first step) {t['head_s']:.2f} s, tail (after the last) "
        f"{t['tail_s']:.2f} s, engine idle {t['idle_s']:.2f} s",
        f"    {t['steps']} steps: {t['step_wall_s']:.2f} s in step() (engine thread CPU "
        f"{t['step_cpu_s']:.2f} s, off-CPU {t['step_off_cpu_s']:.2f} s: GIL waits), "
        f"{t['loop_work_s']:.2f} s loop work between steps; step p50 {t['step_ms_p50']:.2f} ms "
        f"p90 {t['step_ms_p90']:.2f} ms; {t['mean_running']:.1f} running on average, "
        f"{t['max_waiting']} waiting at most",
        f"    event loop thread CPU {t['event_loop_cpu_s']:.2f} s "
        f"({1e3 * t['event_loop_cpu_s'] / max(1, t['arrivals']):.2f} ms per request), whole "
        f"process CPU {t['process_cpu_s']:.2f} s",
        *_table(t["buckets"]),
    ]
    return "\n".join(lines)


def describe_record(t: dict) -> str:
    if not t.get("steps"):
        return "  record: no steps timed"
    lines = [
        f"  record timeline: {t['steps']} steps: {t['step_wall_s']:.2f} s in step() (CPU "
        f"{t['step_cpu_s']:.2f} s, off-CPU {t['step_off_cpu_s']:.2f} s), "
        f"{t['between_steps_s']:.2f} s between steps; step p50 {t['step_ms_p50']:.2f} ms "
        f"p90 {t['step_ms_p90']:.2f} ms; {t['mean_running']:.1f} running on average",
        *_table(t["buckets"]),
    ]
    return "\n".join(lines)
