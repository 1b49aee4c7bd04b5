"""``serve``'s options on who may call it and what one request or connection may hold.

Declared once (``GUARD_OPTIONS``, vLLM's names where vLLM has the option) and
handed to ``serve_command`` as one ``GuardArgs`` by ``with_guard_options``, as
the engine options are (``engine_options.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from moetrace.cli.engine_options import with_options

if TYPE_CHECKING:  # serving loads lazily
    from moetrace.serving.access import AccessOptions

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # as serving/access.py
PANEL = "Access and limits"


def _option(default: Any, *names: str, help: str) -> Any:
    return typer.Option(default, *names, help=help, rich_help_panel=PANEL)


GUARD_OPTIONS: dict[str, tuple[Any, Any]] = {
    "api_key": (
        list[str],
        _option(
            None,
            "--api-key",
            help="Require 'Authorization: Bearer KEY' on every route but /health (repeatable; "
            "MOETRACE_API_KEY adds one).",
        ),
    ),
    "allowed_origins": (
        list[str],
        _option(
            None,
            "--allowed-origins",
            help="Origins browsers may call from (CORS; repeatable, '*' for any). Default: none.",
        ),
    ),
    "public_metrics": (
        bool,
        _option(False, "--public-metrics", help="/metrics answers without the API key."),
    ),
    "max_request_bytes": (
        int,
        _option(
            DEFAULT_MAX_REQUEST_BYTES,
            "--max-request-bytes",
            help="Largest request body; a larger one gets 413 before it is read.",
        ),
    ),
    "max_sequences_per_request": (
        int,
        _option(
            4096,
            "--max-sequences-per-request",
            help="Most engine requests (prompts x n) one HTTP request may start.",
        ),
    ),
    "limit_concurrency": (
        int | None,
        _option(
            None,
            "--limit-concurrency",
            help="uvicorn's: connections served at once, 503 past it (default: from the "
            "open-files limit, at most 4096).",
        ),
    ),
    "header_timeout": (
        float,
        _option(10.0, "--header-timeout", help="Seconds a request has to send its headers."),
    ),
    "body_timeout": (
        float,
        _option(60.0, "--body-timeout", help="Seconds a request has to send its body after them."),
    ),
}


@dataclass(frozen=True)
class GuardArgs:
    """The options of ``GUARD_OPTIONS`` as the command line gave them."""

    api_key: list[str] | None
    allowed_origins: list[str] | None
    public_metrics: bool
    max_request_bytes: int
    max_sequences_per_request: int
    limit_concurrency: int | None
    header_timeout: float
    body_timeout: float

    def access(self) -> AccessOptions:
        """The access rules: the keys given and ``MOETRACE_API_KEY``'s, origins, body size."""
        from moetrace import envs
        from moetrace.serving.access import AccessOptions

        if any(not k.strip() for k in self.api_key or []):
            raise typer.BadParameter("an API key must not be blank", param_hint="--api-key")
        keys = [k for k in (*(self.api_key or []), envs.get("MOETRACE_API_KEY")) if k]
        return AccessOptions(
            api_keys=tuple(keys),
            allowed_origins=tuple(self.allowed_origins or ()),
            public_metrics=self.public_metrics,
            max_request_bytes=self.max_request_bytes,
        )

    def server_limits(self) -> dict[str, Any]:
        """``Server``'s keyword arguments for the limits on requests and connections."""
        return {
            "max_sequences_per_request": self.max_sequences_per_request,
            "limit_concurrency": self.limit_concurrency,
            "header_timeout_s": self.header_timeout,
            "body_timeout_s": self.body_timeout,
        }


# Put ``GUARD_OPTIONS`` where a command has its ``guard: GuardArgs`` parameter.
with_guard_options = with_options("guard", GUARD_OPTIONS, GuardArgs)
