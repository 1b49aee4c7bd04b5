"""Who may call ``moetrace serve`` and what a request may bring, over real HTTP on loopback.

One server (the demo model on the CPU) with two API keys (``--api-key`` and
``MOETRACE_API_KEY``), one allowed origin and a small body limit.  Raw
sockets send what clients would not: a ``Content-Length`` past the limit, a
chunked body that grows past it, a foreign ``Host``.
"""

from __future__ import annotations

import socket
import urllib.parse

import httpx
import openai
import pytest
from support.serve import ServerProcess

KEY, ENV_KEY = "sek-1", "sek-from-env"
ORIGIN = "http://trusted.example"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "demo", "--device", "cpu", "--api-key", KEY, "--allowed-origins", ORIGIN,
        "--max-request-bytes", str(LIMIT), "--shutdown-timeout", "1",
        env={"MOETRACE_API_KEY": ENV_KEY},
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.stderr


def auth(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


def raw(url: str, request: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``request`` as it is; everything the server answers before it closes or goes quiet."""
    address = urllib.parse.urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b'"code"' in out:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def test_every_route_needs_a_key_but_health(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/generate"),
        ("GET", "/no/such/route"),  # a route added later is covered without naming it
    ]:
        for headers in ({}, auth("wrong"), {"authorization": f"Basic {KEY}"}):
            r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            error = r.json()["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/no/such/route", headers=auth(), timeout=10).status_code == 404


def test_both_keys_work_with_the_openai_client(server):
    for key in (KEY, ENV_KEY):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert client.completions.create(model="demo", prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_bodies_must_be_json(server):
    url = server.url + "/v1/completions"
    for kind, content in [
        ("text/plain", b'{"prompt": "hi", "max_tokens": 2}'),
        ("application/x-www-form-urlencoded", b"prompt=hi"),
        ("multipart/form-data; boundary=x", b"--x--"),
        (None, b'{"prompt": "hi"}'),
    ]:
        headers = {**auth(), **({"content-type": kind} if kind else {})}
        r = httpx.post(url, content=content, headers=headers, timeout=30)
        assert r.status_code == 415, (kind, r.text)
        assert r.json()["error"]["type"] == "UnsupportedMediaTypeError"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=auth(), timeout=30)
    assert r.status_code == 200, r.text


def test_cors_answers_only_the_allowed_origin(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            server.url + "/v1/completions",
            headers={
                "origin": origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
            timeout=10,
        )

    ok = preflight(ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = preflight("http://evil.example")
    assert other.status_code != 200
    assert "access-control-allow-origin" not in other.headers


def test_a_foreign_host_header_is_refused_on_loopback(server):
    port = urllib.parse.urlsplit(server.url).port
    for host, status in [
        ("evil.example", 400),  # a name a web page controls, resolved to 127.0.0.1
        (f"evil.example:{port}", 400),
        (f"localhost:{port}", 401),  # our own names pass on to the key check
        (f"127.0.0.1:{port}", 401),
    ]:
        answer = raw(server.url, f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert answer.startswith(f"HTTP/1.1 {status}".encode()), (host, answer[:200])


def test_a_body_past_the_limit_is_refused_before_it_is_read(server):
    # Headers only: the server answers 413 without waiting for the promised bytes.
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {100 << 20}\r\n\r\n"
    ).encode()
    answer = raw(server.url, head, timeout_s=5)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"--max-request-bytes" in answer
    # A chunked body says no length: it is refused once it passes the limit.
    piece = b'{"prompt": "' + b"x" * (LIMIT + 10) + b'"}'
    chunked = (
        (
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        + f"{len(piece):x}\r\n".encode()
        + piece
        + b"\r\n0\r\n\r\n"
    )
    answer = raw(server.url, chunked, timeout_s=5)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "still serving", "max_tokens": 2},
        headers=auth(),
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_the_command_line_and_the_guard_share_one_body_limit():
    """serve_options declares the default beside the option (serving loads lazily)."""
    from moetrace.cli.serve_options import DEFAULT_MAX_REQUEST_BYTES as option_default
    from moetrace.serving.access import DEFAULT_MAX_REQUEST_BYTES

    assert option_default == DEFAULT_MAX_REQUEST_BYTES
