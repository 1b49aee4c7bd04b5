"""Slow and oversized clients over raw sockets: each is cut off, and normal requests go on.

One server (the demo model) with short read deadlines.  Before these limits
a body short of its ``Content-Length`` held its connection for 90 s and
slow-header connections piled up until descriptors ran out.
"""

from __future__ import annotations

import socket
import time
import urllib.parse

import httpx
import pytest
from support.serve import ServerProcess

HEADER_S, BODY_S = 1.0, 1.5


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "demo", "--device", "cpu", "--header-timeout", str(HEADER_S),
        "--body-timeout", str(BODY_S), "--shutdown-timeout", "1",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.stderr
    assert len(srv.stderr) < 20_000  # connection errors are not logged one line each


def _connect(url: str) -> socket.socket:
    address = urllib.parse.urlsplit(url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def _until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """What the server says before closing, and how long it took to close."""
    start, out = time.monotonic(), b""
    while chunk := sock.recv(65536):
        out += chunk
    return out, time.monotonic() - start


def test_headers_that_never_end_are_cut_at_the_deadline(server):
    with _connect(server.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        answer, waited = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert waited < HEADER_S + 3


def test_a_connection_that_says_nothing_is_closed(server):
    with _connect(server.url) as sock:
        answer, waited = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and waited < HEADER_S + 3


def test_a_body_short_of_its_length_is_cut_at_the_deadline(server):
    with _connect(server.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
            b'{"prompt": "short'
        )
        _, waited = _until_closed(sock)
    assert waited < BODY_S + 3


def test_huge_headers_get_431(server):
    padding = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70))  # 70 KB
    with _connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + padding)
        answer, waited = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    assert waited < HEADER_S  # at once, not at the header deadline


def test_many_slow_connections_do_not_stop_normal_requests(server):
    slow = []
    for _ in range(200):
        sock = _connect(server.url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: loc")
        slow.append(sock)
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "meanwhile", "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        time.sleep(HEADER_S + 1)
        for sock in slow:  # every slow one was closed by the server
            sock.settimeout(5)
            assert _until_closed(sock)[0].startswith(b"HTTP/1.1 408")
    finally:
        for sock in slow:
            sock.close()
