"""``serve --trace-out`` on a disk that fills up, over real HTTP on loopback (the demo model).

Not attacked before this round.  What it found: the request whose trace write
hit the full disk got a 500, requests that arrived after the engine stopped
got no answer until the shutdown timeout, the server printed two error lines
and advised ``--resume`` (serve has none).  Now: every request gets its answer
or an OpenAI-style 507 error, the server stops with one line and exit 1, and
the trace holds every request flushed before, intact.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os

import httpx
import numpy as np
import pytest
from support.serve import ServerProcess
from test_reliability_diskfull import small_disk

from moetrace import open_trace
from moetrace.trace.diskspace import DEFAULT_RESERVE_BYTES, RESERVE_ENV
from moetrace.trace.verify import verify_trace

REQUESTS = 400  # far more than the disk holds


def _ask(url: str, i: int) -> tuple[int | str, dict]:
    body = {
        "model": "demo",
        "prompt": f"request {i}: " + "tell me about experts " * 4,
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
    }
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        # The server has stopped: refused, or a keep-alive connection it closed as the
        # request went out (HTTP's own race).  A request left unanswered would time out.
        return "server gone", {}
    try:
        return r.status_code, r.json()
    except ValueError:  # not JSON: the assertions below show it
        return r.status_code, {"not JSON": r.text[:300]}


@pytest.mark.slow
@pytest.mark.parametrize("reserve", [DEFAULT_RESERVE_BYTES, 0], ids=["reserve", "no-reserve"])
def test_serve_on_a_full_disk_answers_every_request_and_keeps_the_trace(tmp_path, reserve):
    with small_disk(tmp_path, reserve, room=230_000) as (target, preexec, how):
        trace = target / "t.h5"
        srv = ServerProcess(
            "demo", "--device", "cpu", "--trace-out", str(trace), "--flush-every", "4",
            "--shutdown-timeout", "2",
            env={RESERVE_ENV: str(reserve), "OMP_NUM_THREADS": "1"}, preexec_fn=preexec,
        )  # fmt: skip
        try:
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda i: _ask(srv.url, i), range(REQUESTS)))
            code = srv.proc.wait(60)  # it stops by itself
        finally:
            srv.stop()
        err = srv.stderr
        assert code == 1, (how, code, err)
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert err.count("error:") == 1 and last.startswith(
            "error: the server stopped: disk full while writing"
        ), err
        assert "--resume" not in last
        statuses = [status for status, _ in answers]
        # Each request was answered, refused with the JSON error, refused as the server
        # stops (503, once the disk-full stop has begun), or found the server gone.
        assert set(statuses) <= {200, 503, 507, "server gone"}, answers
        for status, body in answers:
            if status == 503:
                assert body["error"]["message"] == "the server is shutting down", body
        assert not [body for _, body in answers if "not JSON" in body], answers
        failed = [body for status, body in answers if status == 507]
        # Requests in flight when the writer failed are told why (507); when none was, the
        # server stopped between requests and the next ones found it gone.
        assert failed or "server gone" in statuses, collections.Counter(map(str, statuses))
        for body in failed:
            error = body["error"]
            assert error["code"] == 507 and error["type"] == "InsufficientStorageError"
            assert "disk full" in error["message"] and "--resume" not in error["message"]
        served = [b["choices"][0]["token_ids"] for s, b in answers if s == 200]
        report = verify_trace(trace)
        assert report.status == "incomplete" and not report.problems, (how, report.summary())
        assert report.num_requests > 0
        with open_trace(trace) as t:  # every record reads, checked, and is one that was served
            for request in t:
                assert any(np.array_equal(request.output_token_ids, s) for s in served)
        assert os.path.getsize(trace) > 0
