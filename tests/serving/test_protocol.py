"""What a request may say, over real HTTP on loopback: one server, one trace, checked at the end.

Every bad request below got a 500, a half-closed connection, a dead trace
writer or an unreadable trace before these checks; each must now be a 400
(409 for a reused id) naming its field, on a keep-alive connection that
stays usable, and the trace must hold every answered request exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from support.serve import ServerProcess

from moetrace import open_trace

GREEDY = {"max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("protocol") / "served.h5"
    # No --enable-return-routed-experts: /generate must still answer return_routed_experts.
    srv = ServerProcess(
        "demo", "--device", "cpu", "--trace-out", str(trace), "--flush-every", "1",
        "--max-sequences-per-request", "8", "--shutdown-timeout", "1",
    )  # fmt: skip
    srv.trace = trace
    srv.answered = []  # ids of the requests answered 200: each must be in the trace once
    yield srv
    assert srv.stop() == 0, srv.stderr
    verify = subprocess.run(
        [sys.executable, "-m", "moetrace", "verify", str(trace)], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with open_trace(trace) as t:
        ids = [r.id for r in t]
    assert len(ids) == len(set(ids))
    assert set(srv.answered) <= set(ids), set(srv.answered) - set(ids)


@pytest.fixture(scope="module")
def http(server):
    """One keep-alive connection for every request: an error must not break it."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _post(http, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def _refused(r: httpx.Response, field: str | None, status: int = 400) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == field, error
    assert "Traceback" not in r.text and r.headers.get("connection") != "close"


LOOSE = [  # as vLLM's strict fields would refuse them
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": [True, 104]}, "prompt"),
    ({"prompt": [104, "a"]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"prompt": "x", "seed": "1"}, "seed"),
]


def test_loose_types_are_refused(http):
    for body, field in LOOSE:
        _refused(_post(http, "/v1/completions", body), field)
    r = _post(http, "/generate", {"input_ids": [104, True]})
    _refused(r, "input_ids")
    r = _post(http, "/generate", {"text": "x", "sampling_params": {"n": "2"}})
    _refused(r, "sampling_params.n")


def test_bodies_that_broke_the_parser_are_400s_on_a_live_connection(http, server):
    cases = [
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),  # > 4,300 digits
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # nested 5,000 deep
        (b'{"prompt": "bad\\ud800"}', "prompt"),
        (b'{"prompt": ["ok", "bad\\udfff"]}', "prompt.1"),
    ]
    for body, field in cases:
        _refused(_post(http, "/v1/completions", body), field)
    chat = [
        ({"messages": [{"role": "user", "content": "bad\ud800"}]}, "messages.0.content"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"messages": []},
            },
            "chat_template_kwargs.messages",
        ),
    ]
    for body, field in chat:
        r = _post(http, "/v1/chat/completions", json.dumps(body).encode())
        _refused(r, field)
    r = _post(http, "/v1/completions", {"prompt": "after the errors", **GREEDY})
    assert r.status_code == 200, r.text  # the same pooled connection still serves
    server.answered.append(r.json()["id"] + "-0-0")


def test_ids_that_would_break_the_trace_are_refused_at_the_door(http):
    for rid, why in [
        ("bad\ud800", "surrogate"),
        ("nul\x00", "NUL"),
        ("", "empty"),
        ("x" * 600, "characters"),
    ]:
        r = _post(http, "/generate", json.dumps({"text": "x", "rid": rid}).encode())
        _refused(r, "rid")
        assert why in r.json()["error"]["message"]
        r = _post(http, "/v1/completions", json.dumps({"prompt": "x", "request_id": rid}).encode())
        _refused(r, "request_id")


def test_request_id_names_the_response_and_the_trace_record(http, server):
    r = _post(
        http, "/v1/completions", {"prompt": "joined later", "request_id": "rollout-7", **GREEDY}
    )
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-rollout-7"  # vLLM's rule
    server.answered.append("cmpl-rollout-7-0-0")  # docs/serving.md: the trace's id
    again = _post(http, "/v1/completions", {"prompt": "retry", "request_id": "rollout-7", **GREEDY})
    _refused(again, "request_id", 409)
    r = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                            "request_id": "rollout-7", **GREEDY})  # fmt: skip
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-rollout-7", r.text
    server.answered.append("chatcmpl-rollout-7-0-0")


def test_a_reused_rid_is_a_409_and_the_trace_stays_readable(http, server):
    body = {"text": "same rid", "rid": "r-1", "sampling_params": {"max_new_tokens": 3}}
    first = _post(http, "/generate", body)
    assert first.status_code == 200, first.text
    server.answered.append("r-1")
    _refused(_post(http, "/generate", body), "rid", 409)
    _refused(
        _post(http, "/generate", {**body, "rid": ["r-2", "r-2"], "text": ["a", "b"]}), "rid", 409
    )
    r = _post(http, "/generate", {**body, "rid": "r-2"})
    assert r.status_code == 200, r.text  # the refused batch took no id
    server.answered.append("r-2")


def test_generate_without_the_server_switch_leaves_the_field_out(http, server):
    r = _post(http, "/generate", {"input_ids": [104, 105], "rid": "no-switch",
                                  "return_routed_experts": True, "sampling_params": {"max_new_tokens": 3}})  # fmt: skip
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert "routed_experts" not in meta and meta["completion_tokens"] == 3
    server.answered.append("no-switch")


def test_prompts_times_n_is_capped(http):
    _refused(_post(http, "/v1/completions", {"prompt": "x", "n": 9}), "n")
    _refused(_post(http, "/v1/completions", {"prompt": ["a"] * 9}), "prompt")
    _refused(_post(http, "/v1/completions", {"prompt": ["a"] * 3, "n": 3}), "n")
    _refused(
        _post(http, "/generate", {"text": "x", "sampling_params": {"n": 9}}), "sampling_params.n"
    )
    r = _post(http, "/v1/completions", {"prompt": ["a", "b"], "n": 4, **GREEDY})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_a_text_too_long_for_the_context_is_refused_untokenized(http):
    r = _post(http, "/v1/completions", {"prompt": "x" * 2_000_000})
    _refused(r, "prompt")
    assert "cannot fit the context" in r.json()["error"]["message"]
