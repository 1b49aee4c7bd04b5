"""The Starlette application: routes, and errors as OpenAI-style JSON.

Every failure a client can cause is answered with ``{"error": {"message",
"type", "param", "code"}}`` and the server keeps serving; an unexpected
exception is a 500 with a one-line message (its traceback goes to stderr).

Starlette rather than FastAPI on top of it: the handlers parse and answer
their own bodies (pydantic models, starlette responses), so FastAPI added
only its per-request layers, which took more of the event loop's time than
the handlers did (docs/serving.md, "Why Starlette").
"""

from __future__ import annotations

import sys
import traceback

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moetrace.serving import openai_api, sglang_api, tokens_api, vllm_control_api, weights_api
from moetrace.serving.access import AccessGuard, AccessOptions
from moetrace.serving.context import ServingContext
from moetrace.serving.metrics import CONTENT_TYPE
from moetrace.serving.protocol import FieldProblem
from moetrace.serving.responses import error_body, error_response


async def _field_problem(request: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FieldProblem)
    return error_response(exc)


async def _gone(request: HttpRequest, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; no traceback for a hang-up


async def _http_error(request: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)


async def _bug(request: HttpRequest, exc: Exception) -> JSONResponse:
    traceback.print_exception(exc, file=sys.stderr)
    message = " ".join(str(exc).split()) or type(exc).__name__
    # Said before uvicorn closes the connection (starlette re-raises the error after this
    # answer), so a client's pool does not send its next request on it.
    return JSONResponse(
        error_body(500, f"internal error: {message}"),
        status_code=500,
        headers={"connection": "close"},
    )


def middleware(access: AccessOptions) -> list[Middleware]:
    """CORS for the allowed origins only (outermost: it answers preflights), then the guard."""
    stack = []
    if access.allowed_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(access.allowed_origins),
                allow_methods=["*"],
                allow_headers=["*"],
            )
        )
    stack.append(
        Middleware(
            AccessGuard,
            api_keys=access.api_keys,
            public_paths=access.open_paths,
            loopback_only=access.loopback_only,
            max_body_bytes=access.max_request_bytes,
        )
    )
    return stack


def create_app(ctx: ServingContext, access: AccessOptions | None = None) -> Starlette:
    async def health(request: HttpRequest) -> Response:
        return Response(status_code=200 if ctx.loop.healthy and not ctx.draining else 503)

    async def models(request: HttpRequest) -> JSONResponse:
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

    async def metrics(request: HttpRequest) -> Response:
        assert ctx.metrics is not None
        body = ctx.metrics.render(ctx.loop.counts())
        return Response(body, media_type=CONTENT_TYPE)

    # The routes that let a client replace the model or stop the engine: only when asked.
    control = (
        [*weights_api.CONTROL_ROUTES, *vllm_control_api.CONTROL_ROUTES]
        if ctx.enable_weight_updates
        else []
    )
    app = Starlette(
        routes=[
            *openai_api.ROUTES,
            *sglang_api.ROUTES,
            *tokens_api.ROUTES,
            *weights_api.ROUTES,
            *vllm_control_api.ROUTES,
            *control,
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=middleware(access or AccessOptions()),
        exception_handlers={
            FieldProblem: _field_problem,
            ClientDisconnect: _gone,
            HTTPException: _http_error,
            Exception: _bug,
        },
    )
    app.state.serving = ctx
    return app
