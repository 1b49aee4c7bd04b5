"""Progress in a log: lines at an interval when standard error is no terminal, a bar when it is.

A run writing to a Slurm log said nothing until its final line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import threading

from support.cli import moetrace

from moetrace.cli.progress_lines import ProgressLines, clock_time

LINE = re.compile(
    r"^recording: (\d+)/(\d+) requests \([\d.]+%\), avg prompt throughput [\d,.]+ tokens/s, "
    r"avg generation throughput [\d,.]+ tokens/s, elapsed \d:\d\d:\d\d, ETA (\d:\d\d:\d\d|unknown)$"
)


def test_a_line_once_an_interval_has_passed_with_the_rates_over_it():
    now = [100.0]
    out = io.StringIO()
    lines = ProgressLines("recording", out, 10.0, clock=lambda: now[0])
    now[0] = 105.0
    lines.update(1, 8, prompt=500, generation=50)  # 5 s: not yet
    assert out.getvalue() == ""
    now[0] = 110.0
    lines.update(2, 8, prompt=1000, generation=100)
    now[0] = 130.0
    lines.update(6, 8, prompt=1400, generation=500)
    first, second = out.getvalue().splitlines()
    assert first == (
        "recording: 2/8 requests (25.0%), avg prompt throughput 100.0 tokens/s, avg generation "
        "throughput 10.0 tokens/s, elapsed 0:00:10, ETA 0:00:30"
    )
    # Over the last 20 s: 400 prompt and 400 generated tokens; 2 left at 6 per 30 s.
    assert "avg prompt throughput 20.0 tokens/s, avg generation throughput 20.0" in second
    assert second.endswith("elapsed 0:00:30, ETA 0:00:10")
    now[0] = 145.0
    lines.update(7, None, prompt=1400, generation=500)  # standard input: no total yet
    assert out.getvalue().splitlines()[-1].endswith("ETA unknown (input still streaming)")
    assert clock_time(3725) == "1:02:05"


def _prompts(tmp_path):
    lines = [{"id": f"r{i}", "prompt": "Hello experts " * 8, "max_tokens": 40} for i in range(12)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ["record", "demo", "p.jsonl", "--max-num-seqs", "2", "--no-enable-prefix-caching"]


def test_a_log_gets_progress_lines_and_a_terminal_a_bar(tmp_path):
    args = _prompts(tmp_path)
    proc = moetrace(*args, "-o", "log.h5", "--log-stats-interval", "0.2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("recording:")]
    assert progress, proc.stderr
    for line in progress:
        match = LINE.match(line)
        assert match, line
        assert match.group(2) == "12"
    assert proc.stderr.splitlines().index(progress[-1]) < len(proc.stderr.splitlines()) - 1
    leader, follower = pty.openpty()
    seen = bytearray()

    def drain() -> None:  # the terminal's side, read as the run writes (a full pty blocks it)
        with contextlib.suppress(OSError):
            while chunk := os.read(leader, 65536):
                seen.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        tty = moetrace(*args, "-o", "tty.h5", "--log-stats-interval", "0.2", cwd=tmp_path,
                       stderr=follower)  # fmt: skip
    finally:
        os.close(follower)
        reader.join(30)
        os.close(leader)
    assert tty.returncode == 0
    shown = seen.decode(errors="replace")
    assert "tty.h5: 12 requests" in shown and "avg prompt throughput" not in shown
    assert moetrace(*args, "-o", "q.h5", "-q", cwd=tmp_path).stderr.count("recording:") == 0


def test_the_interval_is_a_positive_number_of_seconds(tmp_path):
    proc = moetrace(*_prompts(tmp_path), "-o", "t.h5", "--log-stats-interval", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--log-stats-interval" in proc.stderr
    assert not (tmp_path / "t.h5").exists()
