"""Starting and stopping ``moetrace serve``: the address checked first, requests answered to the end."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from support.serve import ServerProcess

from moetrace import open_trace


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetrace", "serve", "demo", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_busy_port_is_one_line_before_loading_and_leaves_no_trace(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        trace = tmp_path / "t.h5"
        start = time.monotonic()
        proc = _serve("--port", port, "--trace-out", str(trace))
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
        ]
        assert time.monotonic() - start < 60  # no model was loaded (well under a load's time)
        assert not trace.exists() and not list(tmp_path.iterdir())
        again = _serve("--port", port, "--host", "0.0.0.0")
        lines = again.stderr.strip().splitlines()
        assert again.returncode == 1 and len(lines) == 2, again.stderr
        assert lines[0].startswith("warning: serving on 0.0.0.0 without --api-key")
    bad = _serve("--host", "no-such-host.invalid")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    last = bad.stderr.strip().splitlines()[-1]  # after the warning: not a loopback address
    assert last.startswith("error: cannot listen on no-such-host.invalid:8000: "), last


def _post(url: str, body: dict, out: dict, key: str) -> None:
    try:
        out[key] = httpx.post(url + "/v1/completions", json=body, timeout=60)
    except httpx.HTTPError as exc:
        out[key] = exc


def test_the_shutdown_timeout_answers_requests_as_aborted(tmp_path):
    trace = tmp_path / "t.h5"
    srv = ServerProcess("demo", "--device", "cpu", "--trace-out", str(trace),
                        "--shutdown-timeout", "1")  # fmt: skip
    long = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    answers: dict = {}
    try:
        waiter = threading.Thread(target=_post, args=(srv.url, long, answers, "plain"))
        waiter.start()
        chunks = []
        with httpx.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True},
                          timeout=60) as r:  # fmt: skip
            lines = r.iter_lines()
            chunks.append(next(lines))
            srv.proc.send_signal(signal.SIGTERM)  # the timeout, not a second signal, ends them
            chunks += [line for line in lines if line]
        waiter.join(60)
        code = srv.wait()  # stop() would send the second SIGTERM that means "stop now"
    finally:
        srv.stop()
    assert code == 0, srv.stderr
    plain = answers["plain"]
    assert isinstance(plain, httpx.Response) and plain.status_code == 200, plain
    assert plain.json()["choices"][0]["finish_reason"] == "abort"
    assert chunks[-1] == "data: [DONE]"
    last = json.loads(chunks[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    with open_trace(trace) as t:
        assert sorted(r.finish_reason for r in t) == ["abort", "abort"]
