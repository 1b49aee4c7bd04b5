"""Who may call the server, and what a request may bring: one ASGI middleware for every route.

Every route is guarded unless it is on the allow-list (``/health``, and
``/metrics`` when the operator says so), so a route added later is covered
without touching it.  In order, a request is refused with an OpenAI-style
JSON error when:

- its ``Host`` header is not the server's own name while the server listens
  on loopback only (400): a web page the operator opens cannot reach a
  loopback server through a name it controls (DNS rebinding);
- ``--api-key`` is set and its ``Authorization: Bearer`` token is none of
  the keys (401; compared in constant time over the keys' SHA-256 digests,
  as vLLM's middleware does);
- it carries a body that is not ``application/json`` (415): a browser sends
  ``text/plain`` and form bodies cross-site without asking first, JSON it
  does not (a CORS preflight, answered only for ``--allowed-origins``);
- its body is larger than ``--max-request-bytes`` (413), said by its
  ``Content-Length`` before a byte of it is read, or found while a chunked
  body is read.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moetrace.serving.protocol import FieldProblem
from moetrace.serving.responses import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a text prompt of a million tokens fits


@dataclass(frozen=True)
class AccessOptions:
    """What ``serve``'s access options say (docs/serving.md, "Access")."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    public_metrics: bool = False  # /metrics answers without a key
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    loopback_only: bool = True  # the server listens on loopback: Host must name it
    public_paths: tuple[str, ...] = field(default=("/health",))

    @property
    def open_paths(self) -> tuple[str, ...]:
        return (*self.public_paths, *(("/metrics",) if self.public_metrics else ()))


def is_loopback(host: str) -> bool:
    """Whether an address to listen on reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class BodyTooLarge(FieldProblem):
    def __init__(self, limit: int) -> None:
        super().__init__(
            None, f"the request body is larger than {limit:,} bytes (--max-request-bytes)", 413
        )


def _refusal(status: int, message: str) -> JSONResponse:
    # Connection: close: the client may still be sending a body nobody will read.
    headers = {"connection": "close"} if status in (413, 415) else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


class AccessGuard:
    """The checks above, before the application sees the request."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Iterable[str] = (),
        public_paths: Iterable[str] = ("/health",),
        loopback_only: bool = False,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.app = app
        self.key_digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in api_keys]
        self.public_paths = frozenset(public_paths)
        self.loopback_only = loopback_only
        self.max_body_bytes = max_body_bytes

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode("utf-8")).digest()
        match = False
        for key in self.key_digests:  # every key compared, whichever matches
            match |= secrets.compare_digest(digest, key)
        return match

    def refusal(self, scope: Scope, headers: Headers) -> JSONResponse | None:
        if self.loopback_only and host_name(headers.get("host", "")) not in LOOPBACK_NAMES:
            return _refusal(400, "unexpected Host header for a server listening on loopback")
        if (
            self.key_digests
            and scope["path"] not in self.public_paths
            and not self.authorized(headers)
        ):
            return _refusal(401, "a valid API key is required (Authorization: Bearer KEY)")
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if has_body:
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return _refusal(
                    415, f"the body must be application/json, got {kind or 'no Content-Type'}"
                )
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                return _refusal(413, str(BodyTooLarge(self.max_body_bytes)))
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope, Headers(scope=scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        """``receive``, refusing a (chunked) body once it passes the limit."""
        seen = 0
        limit = self.max_body_bytes

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return counted
