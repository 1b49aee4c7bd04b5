"""The FastAPI application: routes, and errors as OpenAI-style JSON.

Every failure a client can cause is answered with ``{"error": {"message",
"type", "param", "code"}}`` and the server keeps serving; an unexpected
exception is a 500 with a one-line message (its traceback goes to stderr).
"""

from __future__ import annotations

import sys
import traceback

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from moetrace import __version__
from moetrace.serving import openai_api, sglang_api
from moetrace.serving.context import ServingContext
from moetrace.serving.protocol import FieldProblem
from moetrace.serving.responses import error_body, error_response


def create_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="moetrace serve", version=__version__, openapi_url=None)
    app.state.serving = ctx
    app.include_router(openai_api.router)
    app.include_router(sglang_api.router)

    @app.exception_handler(FieldProblem)
    async def _field_problem(request: HttpRequest, exc: FieldProblem) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: HttpRequest, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; no traceback for a hang-up

    @app.exception_handler(HTTPException)
    async def _http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _bug(request: HttpRequest, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc, file=sys.stderr)
        message = " ".join(str(exc).split()) or type(exc).__name__
        return JSONResponse(error_body(500, f"internal error: {message}"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if ctx.loop.alive and not ctx.draining else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": ctx.created,
                "owned_by": "moetrace",
                "root": ctx.model_path,
                "parent": None,
                "max_model_len": ctx.max_model_len,
                "permission": [],
            }
            for name in ctx.served_model_names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = ctx.loop.stats
        values = {
            **ctx.loop.counts(),
            "requests_finished_total": stats.requests_finished,
            "requests_aborted_total": stats.requests_aborted,
            "generation_tokens_total": stats.output_tokens,
            "engine_steps_total": stats.steps,
        }
        lines = [f"moetrace:{name} {value}" for name, value in values.items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    return app
