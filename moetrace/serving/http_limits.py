"""Bounds on what one connection may hold: read timeouts, header size, open files, log lines.

uvicorn closes an idle keep-alive connection but never one that is slow to
send its request: a client that sends its headers a byte at a time, or a
body shorter than its ``Content-Length``, holds a connection (and a file
descriptor) for as long as it likes, and thousands of them exhaust the
process's descriptors.  ``GuardedHttpTools`` gives each request
``header_timeout_s`` to deliver its headers and ``body_timeout_s`` more for
its body, and caps the header bytes; ``--limit-concurrency`` (uvicorn's own)
answers 503 past a number of connections.  When descriptors do run out,
asyncio reports every failed ``accept``; ``RateLimitedLog`` keeps that to
one line per message every few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from moetrace.errors import MoetraceError

MAX_HEADER_BYTES = 64 << 10  # request line and headers; vLLM's clients send under 1 KiB
LOG_EVERY_S = 10.0


def _status(code: int, reason: str) -> bytes:
    body = reason.encode("ascii")
    return (
        f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii") + body


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines and a header size cap."""

    header_timeout_s = 10.0
    body_timeout_s = 60.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._arm(self.header_timeout_s, 408, "Request Timeout")

    def _arm(self, seconds: float, code: int, reason: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, code, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, code: int, reason: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_status(code, reason))  # no answer under way: say why
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._deadline is None:  # a keep-alive connection's next request
            self._arm(self.header_timeout_s, 408, "Request Timeout")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._disarm()
            self.transport.write(_status(431, "Request Header Fields Too Large"))
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            has_body = any(
                name in (b"content-length", b"transfer-encoding") and value not in (b"0",)
                for name, value in self.headers
            )
            if has_body:
                self._arm(self.body_timeout_s, 408, "Request Timeout")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()


class RateLimitedLog(logging.Filter):
    """Lets each message through at most once every ``every_s`` seconds, counting the rest."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} (and {dropped} more like it)"
        return True


def rate_limit_logs(every_s: float = LOG_EVERY_S) -> None:
    """Bound the lines uvicorn and asyncio write per kind of connection error."""
    for name in ("uvicorn.error", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
            logger.addFilter(RateLimitedLog(every_s))


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard one; the soft limit after it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 16)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_connection_limit(open_files: int) -> int:
    """Connections served at once: what the descriptors allow, less room for the rest."""
    return max(64, min(4096, open_files - 256))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (before the model loads), or one line saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MoetraceError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)  # listening starts with serving: until then, connections are refused
    except OSError as exc:
        sock.close()
        raise MoetraceError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock
