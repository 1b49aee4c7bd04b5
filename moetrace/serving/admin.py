"""The one gate every trainer-facing control route passes: how it is registered and run.

The control routes (weight updates, pause, memory release) let a client
replace the served model, so they exist only on a server started with
``--enable-weight-updates``; ``admin_route`` is where each of them is
registered, and where a check that applies to them all (an API key) goes.
``run_control`` hands a control call to the engine loop and waits for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from moetrace.serving.context import ServingContext
from moetrace.serving.engine_control import ControlCall, ControlResult
from moetrace.serving.protocol import FieldProblem
from moetrace.serving.responses import read_body

Endpoint = Callable[[HttpRequest], Awaitable[Response]]


def admin_route(path: str, endpoint: Endpoint, methods: list[str]) -> Route:
    """A control route: registered only with ``--enable-weight-updates`` (``app.py``)."""

    async def guarded(http: HttpRequest) -> Response:
        return await endpoint(http)

    return Route(path, guarded, methods=methods, name=path.strip("/"))


def context(http: HttpRequest) -> ServingContext:
    return http.app.state.serving


async def run_control(http: HttpRequest, call: ControlCall) -> ControlResult:
    """Carry ``call`` out between two engine steps; 503 once the server stops."""
    ctx = context(http)
    if ctx.draining or not ctx.loop.alive:
        raise FieldProblem(None, "the server is shutting down", status=503)
    return await ctx.loop.control(call)


async def control_body(http: HttpRequest, model: type[BaseModel]) -> Any:
    """The body as ``model``; an empty body is ``{}`` (trainers post ``{}`` or nothing)."""
    return await read_body(http, model, empty_is_object=True)


def query_flag(http: HttpRequest, name: str, default: bool) -> bool:
    """A boolean query parameter as FastAPI reads one (true/false/1/0/yes/no/on/off)."""
    value = http.query_params.get(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise FieldProblem(name, f"expected a boolean, got {value!r}")
