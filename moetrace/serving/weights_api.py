"""SGLang's routes for a trainer between steps (slime, AReaL, ROLL, verl's SGLang HTTP engine).

Same paths, bodies (``rl_protocol.py``), answers and status codes as SGLang's
``http_server.py``: an update answers ``{"success", "message"}`` (disk:
``num_paused_requests`` too), 200 or 400; a weight version given with a
successful update becomes the server's and is said in the message.  The
control routes exist only with ``--enable-weight-updates``; the read-only
ones (server info, weight version, health) and ``/abort_request`` always.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from moetrace import __version__
from moetrace.engine.sampling import SamplingParams
from moetrace.serving.admin import admin_route, context, control_body, join_group, run_control
from moetrace.serving.engine_control import (
    ControlResult,
    FlushCache,
    JoinGroup,
    LeaveGroup,
    Pause,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromGroup,
    UpdateFromTensors,
)
from moetrace.serving.engine_loop import EngineRequest
from moetrace.serving.generation import ClientGone, generate_all
from moetrace.serving.protocol import FieldProblem
from moetrace.serving.responses import new_id
from moetrace.serving.rl_protocol import (
    AbortReq,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    MemoryOccupationReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT


def _answer(result: ControlResult, **extra: Any) -> JSONResponse:
    body = {"success": result.ok, "message": result.message, **extra}
    return JSONResponse(body, status_code=HTTPStatus.OK if result.ok else HTTPStatus.BAD_REQUEST)


def _error(result: ControlResult) -> JSONResponse:
    """SGLang's ``_create_error_response`` for the memory routes."""
    return JSONResponse({"error": {"message": result.message}}, status_code=400)


# ----------------------------------------------------------------------------- updates


async def update_weights_from_disk(http: HttpRequest) -> Response:
    req: UpdateWeightFromDiskReqInput = await control_body(http, UpdateWeightFromDiskReqInput)
    call = UpdateFromDisk(req.model_path, req.weight_version, req.abort_all_requests)
    result = await run_control(http, call)
    return _answer(result, num_paused_requests=result.num_paused_requests)


async def init_weights_update_group(http: HttpRequest) -> Response:
    req: InitWeightsUpdateGroupReqInput = await control_body(http, InitWeightsUpdateGroupReqInput)
    call = JoinGroup(
        req.master_address,
        req.master_port,
        req.rank_offset,
        req.world_size,
        req.group_name,
        req.backend,
    )
    return _answer(await join_group(http, call))


async def destroy_weights_update_group(http: HttpRequest) -> Response:
    req = await control_body(http, DestroyWeightsUpdateGroupReqInput)
    return _answer(await run_control(http, LeaveGroup(req.group_name)))


async def update_weights_from_distributed(http: HttpRequest) -> Response:
    req: UpdateWeightsFromDistributedReqInput = await control_body(
        http, UpdateWeightsFromDistributedReqInput
    )
    call = UpdateFromGroup(
        tuple(req.names),
        tuple(req.dtypes),
        tuple(tuple(s) for s in req.shapes),
        req.group_name,
        version=req.weight_version,
        abort_all=req.abort_all_requests,
    )
    return _answer(await run_control(http, call))


async def update_weights_from_tensor(http: HttpRequest) -> Response:
    req: UpdateWeightsFromTensorReqInput = await control_body(http, UpdateWeightsFromTensorReqInput)
    call = UpdateFromTensors(
        tuple(req.serialized_named_tensors),
        req.load_format,
        req.weight_version,
        req.abort_all_requests,
    )
    return _answer(await run_control(http, call))


async def update_weight_version(http: HttpRequest) -> Response:
    req: UpdateWeightVersionReqInput = await control_body(http, UpdateWeightVersionReqInput)
    result = await run_control(http, SetVersion(req.new_version, req.abort_all_requests))
    if not result.ok:
        return _answer(result)
    return JSONResponse(
        {"success": True, "message": result.message, "new_version": req.new_version}
    )


# ----------------------------------------------------------------------------- generation


async def pause_generation(http: HttpRequest) -> Response:
    req: PauseGenerationReqInput = await control_body(http, PauseGenerationReqInput)
    result = await run_control(http, Pause(req.mode))
    if not result.ok:
        return _answer(result)
    return JSONResponse({"message": result.message, "status": "ok"})


async def continue_generation(http: HttpRequest) -> Response:
    await control_body(http, ContinueGenerationReqInput)
    context(http).loop.holding = False
    result = await run_control(http, Resume())
    return JSONResponse({"message": result.message, "status": "ok"})


async def flush_cache(http: HttpRequest) -> Response:
    result = await run_control(http, FlushCache(when_idle=True))
    return PlainTextResponse(FLUSHED, status_code=200 if result.ok else 400)


async def release_memory_occupation(http: HttpRequest) -> Response:
    req: MemoryOccupationReqInput = await control_body(http, MemoryOccupationReqInput)
    result = await run_control(http, ReleaseMemory(req.chosen))
    return JSONResponse(None) if result.ok else _error(result)


async def resume_memory_occupation(http: HttpRequest) -> Response:
    req: MemoryOccupationReqInput = await control_body(http, MemoryOccupationReqInput)
    result = await run_control(http, ResumeMemory(req.chosen))
    return JSONResponse(None) if result.ok else _error(result)


# ----------------------------------------------------------------------------- always there


async def abort_request(http: HttpRequest) -> Response:
    req: AbortReq = await control_body(http, AbortReq)
    if req.abort_all or req.rid:
        context(http).loop.abort_rid(None if req.abort_all else req.rid)
    return Response(status_code=200)


async def get_weight_version(http: HttpRequest) -> Response:
    return JSONResponse({"weight_version": context(http).loop.state.weight_version})


async def get_model_info(http: HttpRequest) -> Response:
    ctx = context(http)
    return JSONResponse(
        {
            "model_path": ctx.model_path,
            "tokenizer_path": ctx.model_path if ctx.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": ctx.loop.state.weight_version,
        }
    )


async def get_server_info(http: HttpRequest) -> Response:
    """The SGLang server arguments clients read (slime compares a few with its own)."""
    ctx = context(http)
    state = ctx.loop.state
    return JSONResponse(
        {
            "model_path": ctx.model_path,
            "served_model_name": ctx.model_name,
            "dtype": ctx.dtype,
            "tp_size": ctx.tensor_parallel_size,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "num_gpus": ctx.tensor_parallel_size,
            "context_length": ctx.max_model_len,
            "page_size": ctx.block_size,
            "max_total_num_tokens": ctx.num_kv_blocks * ctx.block_size,
            "enable_return_routed_experts": ctx.return_routed_experts,
            # SGLang's memory-saver allocator; moetrace releases memory without one.
            "enable_memory_saver": False,
            "disaggregation_mode": "null",
            "weight_version": state.weight_version,
            "enable_weight_updates": ctx.enable_weight_updates,
            "is_paused": state.paused is not None,
            "released_memory": list(state.released),
            "version": f"moetrace {__version__}",
        }
    )


async def health_generate(http: HttpRequest) -> Response:
    """200 once a one-token request runs (or the engine is held by a pause, which answered)."""
    ctx = context(http)
    if ctx.draining or not ctx.loop.alive:
        return Response(status_code=503)
    if ctx.loop.state.holds_requests:
        return Response(status_code=200)
    probe = EngineRequest(
        f"HEALTH_CHECK_{new_id()}", [0], SamplingParams(max_tokens=1, temperature=0.0)
    )
    try:
        await asyncio.wait_for(generate_all(ctx, http, [probe]), HEALTH_TIMEOUT_S)
    except (TimeoutError, FieldProblem, ClientGone):
        return Response(status_code=503)
    return Response(status_code=200)


CONTROL_ROUTES = [
    admin_route("/update_weights_from_disk", update_weights_from_disk, ["POST"]),
    admin_route("/init_weights_update_group", init_weights_update_group, ["POST"]),
    admin_route("/destroy_weights_update_group", destroy_weights_update_group, ["POST"]),
    admin_route("/update_weights_from_distributed", update_weights_from_distributed, ["POST"]),
    admin_route("/update_weights_from_tensor", update_weights_from_tensor, ["POST"]),
    admin_route("/update_weight_version", update_weight_version, ["POST"]),
    admin_route("/pause_generation", pause_generation, ["POST"]),
    admin_route("/continue_generation", continue_generation, ["POST"]),
    admin_route("/flush_cache", flush_cache, ["GET", "POST"]),
    admin_route("/release_memory_occupation", release_memory_occupation, ["GET", "POST"]),
    admin_route("/resume_memory_occupation", resume_memory_occupation, ["GET", "POST"]),
]
ROUTES = [
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/get_weight_version", get_weight_version, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
    Route("/server_info", get_server_info, methods=["GET"]),
    Route("/health_generate", health_generate, methods=["GET"]),
]
