"""The one gate every trainer-facing control route passes: how it is registered and run.

The control routes (weight updates, pause, memory release) let a client
replace the served model, so they exist only on a server started with
``--enable-weight-updates``; ``admin_route`` is where each of them is
registered, and where a check that applies to them all (an API key) goes.
``run_control`` hands a control call to the engine loop and waits for it;
``join_group`` first waits, here on the event loop, for the trainer's store
to listen, so the engine never stands still for a trainer that is not there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from moetrace.serving.context import ServingContext
from moetrace.serving.engine_control import ControlCall, ControlResult, JoinGroup
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


async def join_group(http: HttpRequest, call: JoinGroup) -> ControlResult:
    """Join the trainer's group once its store (rank 0's ``master_address:master_port``)
    accepts connections; a store that never listens fails here, after
    ``--weight-update-timeout``, with the engine stepping meanwhile."""
    timeout_s = context(http).weight_update_timeout_s
    if not await _listening(call.master_address, call.master_port, timeout_s):
        where = f"{call.master_address}:{call.master_port}"
        return ControlResult(
            False,
            f"nobody listened at {where} (the trainer's store) within {timeout_s:g} s "
            "(--weight-update-timeout); the server joined no group",
            context(http).loop.state,
        )
    return await run_control(http, call)


async def _listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s`` (tried twice a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), max(left, 0.01))
        except (OSError, asyncio.TimeoutError):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.5, left))
            continue
        writer.close()
        return True


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
