"""The abort routes end a request by any id its client holds, and count what really ended.

vLLM's ``/abort_requests {request_ids}`` and SGLang's ``/abort_request {rid}``
against long requests (``ignore_eos``, far more tokens than run before the
abort) over real HTTP, the engine in its own process as ``moetrace serve``
runs it by default: by the trace id, the response id (all its choices) and
the client's own ``request_id``.  Each aborted request is answered with
finish reason ``abort`` and written to the trace as ``abort``.
"""

from __future__ import annotations

import time

import httpx
import pytest
from support.serve import ServerProcess, in_thread, post, wait_running

from moetrace import open_trace

LONG = 500  # tokens a request would run to without the abort


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("serve-abort") / "served.h5"
    srv = ServerProcess(
        "demo", "--device", "cpu", "--enable-weight-updates", "--enable-return-routed-experts",
        "--num-kv-blocks", "256", "--trace-out", str(trace), "--shutdown-timeout", "5",
        request_timeout_s=120,
    )  # fmt: skip
    srv.trace = trace
    yield srv
    assert srv.stop() == 0, srv.stderr


def start(srv: ServerProcess, path: str, body: dict):
    """A long request running in a thread; returns once the engine runs it."""
    body = {"model": "demo", "max_tokens": LONG, "ignore_eos": True, "temperature": 0, **body}
    thread, out = in_thread(lambda: post(srv, path, body))
    wait_running(srv)
    return thread, out


def answer_of(thread, out) -> dict:
    thread.join(120)
    assert not thread.is_alive(), "the request was not answered"
    assert out["answer"].status_code == 200, out["answer"].text
    return out["answer"].json()


def traced_reasons(srv: ServerProcess, ids: list[str]) -> list[str]:
    """The finish reasons the trace holds for ``ids`` (the writer may lag the answer)."""
    deadline = time.monotonic() + 30
    while True:
        with open_trace(srv.trace) as trace:
            if set(ids) <= set(trace.request_ids):
                return [trace.request(i).finish_reason for i in ids]
        assert time.monotonic() < deadline, f"{ids} never reached the trace"
        time.sleep(0.1)


COMPLETION = {"prompt": "def fibonacci(n):"}
CHAT = {"messages": [{"role": "user", "content": "Count to a thousand."}]}


@pytest.mark.parametrize(
    ("path", "body", "abort_id", "trace_ids"),
    [
        # The client's own request_id: every prompt and sample of its request.
        ("/v1/completions", {**COMPLETION, "request_id": "rq1"}, "rq1", ["cmpl-rq1-0-0"]),
        # The response id the client sees: all choices of that response.
        (
            "/v1/completions",
            {**COMPLETION, "request_id": "rq2", "n": 2},
            "cmpl-rq2",
            ["cmpl-rq2-0-0", "cmpl-rq2-0-1"],
        ),
        # The trace id: that choice alone.
        ("/v1/completions", {**COMPLETION, "request_id": "rq3"}, "cmpl-rq3-0-0", ["cmpl-rq3-0-0"]),
        (
            "/v1/chat/completions",
            {**CHAT, "request_id": "rq5"},
            "chatcmpl-rq5",
            ["chatcmpl-rq5-0-0"],
        ),
        ("/v1/chat/completions", {**CHAT, "request_id": "rq6"}, "rq6", ["chatcmpl-rq6-0-0"]),
    ],
)
def test_abort_requests_by_each_id_a_client_holds(server, path, body, abort_id, trace_ids):
    running = start(server, path, body)
    aborted = post(server, "/abort_requests", {"request_ids": [abort_id]})
    assert aborted.status_code == 200, aborted.text
    assert aborted.json() == {"status": "aborted", "aborted": len(trace_ids)}
    answer = answer_of(*running)
    assert [c["finish_reason"] for c in answer["choices"]] == ["abort"] * len(trace_ids)
    assert traced_reasons(server, trace_ids) == ["abort"] * len(trace_ids)


def test_abort_requests_counts_only_what_it_ended(server):
    """An unknown id, or one whose request already finished, aborts nothing: 0."""
    unknown = post(server, "/abort_requests", {"request_ids": ["x"]})
    assert unknown.json() == {"status": "aborted", "aborted": 0}
    done = post(server, "/v1/completions", {"model": "demo", **COMPLETION, "max_tokens": 2,
                                            "request_id": "rq7"})  # fmt: skip
    assert done.status_code == 200, done.text
    again = post(server, "/abort_requests", {"request_ids": ["rq7", "cmpl-rq7-0-0"]})
    assert again.json() == {"status": "aborted", "aborted": 0}


def test_abort_requests_refuses_an_empty_id(server):
    answer = post(server, "/abort_requests", {"request_ids": ["rq1", ""]})
    assert answer.status_code == 400
    assert "request_ids.1" in answer.text


def test_sglang_abort_request_by_the_clients_request_id(server):
    running = start(server, "/v1/completions", {**COMPLETION, "request_id": "rq4"})
    aborted = post(server, "/abort_request", {"rid": "rq4"})
    assert aborted.status_code == 200, aborted.text
    assert answer_of(*running)["choices"][0]["finish_reason"] == "abort"
    assert traced_reasons(server, ["cmpl-rq4-0-0"]) == ["abort"]


def test_abort_requests_by_the_tokens_routes_request_id(server):
    """vLLM's tokens-in route: by the request_id its answer shows."""
    body = {"token_ids": [1, 2, 3], "model": "demo",
            "sampling_params": {"max_tokens": LONG, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    thread, out = in_thread(
        lambda: post(server, "/inference/v1/generate", body | {"request_id": "rq8"})
    )
    wait_running(server)
    aborted = post(server, "/abort_requests", {"request_ids": ["rq8"]})
    assert aborted.json() == {"status": "aborted", "aborted": 1}
    assert answer_of(thread, out)["choices"][0]["finish_reason"] == "abort"
    assert traced_reasons(server, ["generate-tokens-rq8-0"]) == ["abort"]


def test_abort_requests_ends_a_held_request(server):
    """Paused (keep), a new request waits outside the engine; aborted, it is answered at
    once, counted, and its id is free again (it never reached the trace)."""
    assert httpx.post(server.url + "/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    try:
        body = {"model": "demo", **COMPLETION, "max_tokens": 4, "request_id": "rq9"}
        thread, out = in_thread(lambda: post(server, "/v1/completions", body))
        deadline = time.monotonic() + 30
        while True:  # until the server holds it
            aborted = post(server, "/abort_requests", {"request_ids": ["rq9"]}).json()["aborted"]
            if aborted or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert aborted == 1
        thread.join(60)
        assert out["answer"].status_code == 503, out["answer"].text
    finally:
        assert httpx.post(server.url + "/resume", timeout=60).status_code == 200
    again = post(server, "/v1/completions", body)
    assert again.status_code == 200, again.text
