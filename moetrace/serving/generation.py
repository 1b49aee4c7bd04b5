"""Running a handler's engine requests: waiting, streaming, and aborting on disconnect.

A client that goes away must not keep the engine busy: every wait here races
the connection's ``http.disconnect``, and whatever ends a wait early (the
client leaving, a sibling request failing, the server cancelling the handler
at shutdown) aborts the requests still running, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

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

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(http: HttpRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(http: HttpRequest, work: Awaitable[T]) -> T:
    """``work``'s result, or ``ClientGone`` if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def submit(ctx: ServingContext, requests: list[EngineRequest]) -> list[RequestHandle]:
    if ctx.draining or not ctx.loop.alive:
        raise FieldProblem(None, "the server is shutting down", status=503)
    handles = [RequestHandle(r) for r in requests]
    for handle in handles:
        ctx.loop.add(handle)
    return handles


def abort_unfinished(ctx: ServingContext, handles: list[RequestHandle]) -> None:
    ctx.loop.abort([h.request_id for h in handles if not h.done])


def _failure(event: Failed) -> FieldProblem:
    return FieldProblem(event.field, event.message, status=event.status)


async def _finish_all(handles: list[RequestHandle]) -> list[FinishedRequest]:
    out = []
    for handle in handles:
        while True:
            event = await handle.next_event()
            if isinstance(event, Finished):
                out.append(event.request)
                break
            if isinstance(event, Failed):
                raise _failure(event)
    return out


async def generate_all(
    ctx: ServingContext, http: HttpRequest, requests: list[EngineRequest]
) -> list[FinishedRequest]:
    """Run ``requests`` to the end; abort them all if the client leaves or one fails."""
    handles = submit(ctx, requests)
    try:
        return await race_disconnect(http, _finish_all(handles))
    finally:
        abort_unfinished(ctx, handles)


async def stream_events(
    ctx: ServingContext, http: HttpRequest, requests: list[EngineRequest]
) -> AsyncIterator[tuple[int, NewTokens | Finished]]:
    """(request index, event) as they happen, until every request has finished."""
    handles = submit(ctx, requests)
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        while True:
            event = await handle.next_event()
            await merged.put((i, event))
            if not isinstance(event, NewTokens):
                return

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(handles)
    try:
        while remaining:
            i, event = await race_disconnect(http, merged.get())
            if isinstance(event, Failed):
                raise _failure(event)
            if isinstance(event, Finished):
                remaining -= 1
            yield i, event
    finally:
        for task in pumps:
            task.cancel()
        abort_unfinished(ctx, handles)
