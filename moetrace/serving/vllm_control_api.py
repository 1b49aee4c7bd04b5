"""vLLM's RLHF routes (SkyRL, TRL's async GRPO, AReaL's vLLM backend) and prime-rl's.

Paths, query parameters and answers as vLLM's ``serve/dev/rlhf`` and sleep
routers have them: ``/pause?mode=abort|wait|keep`` answers ``{"status":
"paused"}``, the native weight transfer ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/sleep`` and ``/wake_up`` answer as vLLM does, errors as ``{"error": ...}``.
prime-rl's ``/update_weights {weight_dir}`` (a checkpoint directory, between
its ``/pause`` and ``/resume``) shares the path and answers ``{"status":
"ok"}``.

The weight-transfer group is a torch process group built as SGLang's is
(``distributed/update_group.py``, group name ``weight_update_group``);
``init_info`` may say ``backend: gloo`` for a CPU server.  vLLM's own trainer
helper (``NCCLWeightTransferEngine.trainer_init``) builds a different kind
of group (its ``StatelessProcessGroup`` and PyNccl), which this one does not
meet (docs/serving.md).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moetrace.engine.memory_release import TAGS
from moetrace.serving.admin import (
    admin_route,
    context,
    control_body,
    join_group,
    query_flag,
    run_control,
)
from moetrace.serving.engine_control import (
    ControlResult,
    FlushCache,
    JoinGroup,
    Pause,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromGroup,
)
from moetrace.serving.protocol import FieldProblem, request_id_value
from moetrace.serving.rl_protocol import (
    SGLANG_GROUP,
    AbortRequestsRequest,
    FinishWeightUpdateRequest,
    InitWeightTransferRequest,
    ResetPrefixCacheRequest,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
)

PAUSE_MODES = ("abort", "wait", "keep")
IDLE_POLL_S = 0.01


def _failed(result: ControlResult) -> JSONResponse:
    return JSONResponse({"error": result.message}, status_code=400)


async def _pause(http: HttpRequest, mode: str, clear_cache: bool) -> ControlResult:
    """vLLM's pause: ``wait`` lets the requests in the engine finish (new ones wait)."""
    if mode not in PAUSE_MODES:
        raise FieldProblem("mode", f"choose {', '.join(PAUSE_MODES)}, got {mode!r}")
    loop = context(http).loop
    if mode == "wait":
        loop.holding = True
        while loop.num_live:
            await asyncio.sleep(IDLE_POLL_S)
    result = await run_control(http, Pause("keep" if mode == "wait" else mode))
    if result.ok and clear_cache and mode != "keep":
        await run_control(http, FlushCache(when_idle=False))
    return result


async def pause(http: HttpRequest) -> Response:
    mode = http.query_params.get("mode", "abort")
    result = await _pause(http, mode, query_flag(http, "clear_cache", True))
    return JSONResponse({"status": "paused"}) if result.ok else _failed(result)


async def resume(http: HttpRequest) -> Response:
    context(http).loop.holding = False
    result = await run_control(http, Resume())
    return JSONResponse({"status": "resumed"}) if result.ok else _failed(result)


async def is_paused(http: HttpRequest) -> Response:
    return JSONResponse({"is_paused": context(http).loop.state.paused is not None})


async def init_weight_transfer_engine(http: HttpRequest) -> Response:
    req: InitWeightTransferRequest = await control_body(http, InitWeightTransferRequest)
    info = req.init_info
    call = JoinGroup(
        info.master_address,
        info.master_port,
        info.rank_offset,
        info.world_size,
        SGLANG_GROUP,
        info.backend,
    )
    result = await join_group(http, call)
    return (
        JSONResponse({"message": "Weight transfer initialized"}) if result.ok else _failed(result)
    )


async def start_weight_update(http: HttpRequest) -> Response:
    await control_body(http, StartWeightUpdateRequest)
    return JSONResponse({"message": "Weight update started"})


async def update_weights(http: HttpRequest) -> Response:
    req: UpdateWeightsRequest = await control_body(http, UpdateWeightsRequest)
    if req.weight_dir is not None:  # prime-rl: a checkpoint directory
        result = await run_control(http, UpdateFromDisk(req.weight_dir))
        return JSONResponse({"status": "ok"}) if result.ok else _failed(result)
    info = req.update_info
    assert info is not None
    call = UpdateFromGroup(
        tuple(info.names),
        tuple(info.dtype_names),
        tuple(tuple(s) for s in info.shapes),
        SGLANG_GROUP,
        packed=info.packed,
        buffer_bytes=info.packed_buffer_size_bytes,
    )
    result = await run_control(http, call)
    return JSONResponse({"message": "Weights updated"}) if result.ok else _failed(result)


async def finish_weight_update(http: HttpRequest) -> Response:
    req: FinishWeightUpdateRequest = await control_body(http, FinishWeightUpdateRequest)
    if req.weight_version is not None:
        result = await run_control(http, SetVersion(req.weight_version))
        if not result.ok:
            return _failed(result)
    return JSONResponse({"message": "Weight update finished"})


async def weight_info(http: HttpRequest) -> Response:
    return JSONResponse({"weight_version": context(http).loop.state.weight_version})


async def get_world_size(http: HttpRequest) -> Response:
    query_flag(http, "include_dp", True)
    # Every rank joins the trainer's group: its world_size counts them all.
    return JSONResponse({"world_size": context(http).tensor_parallel_size})


async def sleep(http: HttpRequest) -> Response:
    """vLLM's sleep: pause (``mode``), then level 1 keeps the weights in host memory and
    drops the KV cache, level 2 drops both (new weights must follow), level 0 only pauses."""
    level_text = http.query_params.get("level", "1")
    if level_text not in ("0", "1", "2"):
        raise FieldProblem("level", f"choose 0, 1 or 2, got {level_text!r}")
    level = int(level_text)
    result = await _pause(http, http.query_params.get("mode", "abort"), clear_cache=False)
    if result.ok and level > 0:
        result = await run_control(http, ReleaseMemory(TAGS, keep_weights=level == 1))
    return Response(status_code=200) if result.ok else _failed(result)


async def wake_up(http: HttpRequest) -> Response:
    tags = http.query_params.getlist("tags") or list(TAGS)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise FieldProblem("tags", f"unknown tag {unknown[0]!r}; choose among {list(TAGS)}")
    result = await run_control(http, ResumeMemory(tuple(tags)))
    if result.ok and not result.state.released:
        context(http).loop.holding = False
        result = await run_control(http, Resume())
    return Response(status_code=200) if result.ok else _failed(result)


async def is_sleeping(http: HttpRequest) -> Response:
    return JSONResponse({"is_sleeping": bool(context(http).loop.state.released)})


async def reset_prefix_cache(http: HttpRequest) -> Response:
    await control_body(http, ResetPrefixCacheRequest)  # SkyRL sends its flags as a body
    query_flag(http, "reset_running_requests", False)
    result = await run_control(http, FlushCache(when_idle=False))
    return Response(status_code=200) if result.ok else _failed(result)


async def abort_requests(http: HttpRequest) -> Response:
    """Ends the requests ``request_ids`` name (any id a client holds for one), or all when
    absent; ``aborted`` counts what really ended, so unknown or finished ids count 0."""
    req: AbortRequestsRequest = await control_body(http, AbortRequestsRequest)
    for i, rid in enumerate(req.request_ids or []):
        try:
            request_id_value(rid)  # the rules of a generation body's ids: an empty one is a 400
        except ValueError as exc:
            raise FieldProblem(f"request_ids.{i}", str(exc)) from None
    count = await context(http).loop.abort_named(req.request_ids)
    return JSONResponse({"status": "aborted", "aborted": count})


async def liveness(http: HttpRequest) -> Response:
    """prime-rl's: the engine loop answers."""
    ctx = context(http)
    if ctx.loop.alive and not ctx.draining:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine_unresponsive"}, status_code=503)


CONTROL_ROUTES = [
    admin_route("/pause", pause, ["POST"]),
    admin_route("/resume", resume, ["POST"]),
    admin_route("/init_weight_transfer_engine", init_weight_transfer_engine, ["POST"]),
    admin_route("/start_weight_update", start_weight_update, ["POST"]),
    admin_route("/update_weights", update_weights, ["POST"]),
    admin_route("/finish_weight_update", finish_weight_update, ["POST"]),
    admin_route("/sleep", sleep, ["POST"]),
    admin_route("/wake_up", wake_up, ["POST"]),
    admin_route("/reset_prefix_cache", reset_prefix_cache, ["POST"]),
    admin_route("/abort_requests", abort_requests, ["POST"]),
]
ROUTES = [
    Route("/is_paused", is_paused, methods=["GET"]),
    Route("/is_sleeping", is_sleeping, methods=["GET"]),
    Route("/weight_info", weight_info, methods=["GET"]),
    Route("/get_world_size", get_world_size, methods=["GET"]),
    Route("/liveness", liveness, methods=["GET"]),
]
