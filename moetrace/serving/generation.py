"""Running a handler's engine requests: waiting, streaming, and aborting on disconnect.

A client that goes away must not keep the engine busy.  The engine requests
of one HTTP request share one queue, and a watcher puts a marker into it when
the connection's ``http.disconnect`` arrives, so a single ``await`` waits for
the next token, the end, or the client leaving, with no task per event.
Whatever ends a wait early (the client leaving, a sibling request failing,
the server cancelling the handler at shutdown) aborts the requests still
running, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request as HttpRequest

from moetrace.serving.context import ServingContext
from moetrace.serving.engine_loop import (
    EngineRequest,
    Failed,
    Finished,
    NewTokens,
    RequestHandle,
)
from moetrace.serving.protocol import FieldProblem
from moetrace.trace.records import FinishedRequest

_GONE = object()  # the watcher's marker: the client disconnected


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _watch(http: HttpRequest, queue: asyncio.Queue) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait((-1, _GONE))
            return


async def stream_events(
    ctx: ServingContext, http: HttpRequest, requests: list[EngineRequest]
) -> AsyncIterator[tuple[int, NewTokens | Finished]]:
    """(request index, event) as they happen, until every request has finished."""
    if ctx.draining or not ctx.loop.alive:
        ctx.loop.release([r.request_id for r in requests])  # they never reach the engine
        failure = ctx.loop.failure  # stopped by a failure: say which (disk full: 507)
        if failure is not None:
            raise FieldProblem(None, failure.message, status=failure.status)
        raise FieldProblem(None, "the server is shutting down", status=503)
    queue: asyncio.Queue = asyncio.Queue()
    handles = [RequestHandle(r, queue, i) for i, r in enumerate(requests)]
    for handle in handles:
        ctx.loop.add(handle)
    watcher = asyncio.ensure_future(_watch(http, queue))
    remaining = len(handles)
    try:
        while remaining:
            i, event = await queue.get()
            if event is _GONE:
                raise ClientGone
            if isinstance(event, Failed):
                handles[i].done = True
                raise FieldProblem(event.field, event.message, status=event.status)
            if isinstance(event, Finished):
                handles[i].done = True
                remaining -= 1
            yield i, event
    finally:
        watcher.cancel()
        ctx.loop.abort([h.request_id for h in handles if not h.done])


async def generate_all(
    ctx: ServingContext, http: HttpRequest, requests: list[EngineRequest]
) -> list[FinishedRequest]:
    """Run ``requests`` to the end; abort them all if the client leaves or one fails."""
    out: list[FinishedRequest | None] = [None] * len(requests)
    events = stream_events(ctx, http, requests)
    try:
        async for i, event in events:
            if isinstance(event, Finished):
                out[i] = event.request
    finally:
        await events.aclose()
    return out  # type: ignore[return-value]
