"""SGLang's native ``/generate``, so slime and Miles rollouts point at moetrace unchanged.

With ``return_routed_experts`` the answer's ``meta_info.routed_experts`` is
SGLang's encoding: base64 of the flat int32 buffer of shape
``(prompt_len + output_len - 1 - routed_experts_start_len, num_hidden_layers,
top_k)`` (dense layers zero), decoded by clients with
``np.frombuffer(b64decode(s), np.int32).reshape(-1, num_hidden_layers * top_k)``.
With ``return_routed_weights`` (moetrace's, on a server started with
``--enable-return-routed-weights``) ``meta_info.routed_weights`` holds their
gate weights in the same layout as flat little-endian float32.
A batch (``text`` or ``input_ids`` as a list) or ``n`` > 1 is answered with a
list, one entry per sequence, as SGLang does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from moetrace.serving.choices import Choice, EncodeClock
from moetrace.serving.context import ServingContext
from moetrace.serving.engine_loop import EngineRequest, Finished
from moetrace.serving.generation import ClientGone, generate_all, stream_events
from moetrace.serving.logprobs import sglang_logprobs
from moetrace.serving.protocol import FieldProblem, GenerateRequest, GenerateSampling
from moetrace.serving.responses import DONE, JSONBody, error_body, new_id, read_body, sse
from moetrace.trace.records import FinishedRequest


def _prompts(ctx: ServingContext, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the request was a batch."""
    if req.text is not None:
        if isinstance(req.text, str):
            return [ctx.encode(req.text, "text")], False
        return [ctx.encode(t, f"text.{i}") for i, t in enumerate(req.text)], True
    ids = req.input_ids or []
    if ids and isinstance(ids[0], list):
        return [list(p) for p in ids], True  # type: ignore[arg-type]
    return [list(ids)], False  # type: ignore[arg-type]


def _rids(req: GenerateRequest, count: int) -> list[str]:
    if req.rid is None:
        return [new_id() for _ in range(count)]
    rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
    if len(rids) != count:
        raise FieldProblem("rid", f"{len(rids)} rids for {count} prompts")
    return rids


def _finish_reason(done: FinishedRequest, choice: Choice, max_new: int) -> dict[str, Any]:
    if done.finish_reason == "length":
        return {"type": "length", "length": max_new}
    if done.finish_reason == "abort":  # SGLang's words for one aborted before its first token
        message = "Abort before prefill" if done.output_len == 0 else "Aborted"
        return {"type": "abort", "message": message}
    matched = done.stop_reason  # a stop string, or a stop token id
    if matched is None and choice.stopped_by_token(done):
        matched = int(done.output_token_ids[-1])  # EOS
    return {"type": "stop", "matched": matched}


def _num_prompts(req: GenerateRequest) -> int:
    if req.text is not None:
        return 1 if isinstance(req.text, str) else len(req.text)
    ids = req.input_ids or []
    return len(ids) if ids and isinstance(ids[0], list) else 1


def _text_chars(req: GenerateRequest) -> int:
    texts = [req.text] if isinstance(req.text, str) else (req.text or [])
    return sum(len(t) for t in texts)


class _Plan:
    def __init__(
        self,
        ctx: ServingContext,
        req: GenerateRequest,
        sampling: GenerateSampling,
        prompts: list[list[int]],
        batch: bool,
    ) -> None:
        ctx.check_weights_asked(req.return_routed_weights)
        self.batch = batch
        rids = _rids(req, len(prompts))
        self.requests: list[EngineRequest] = []
        self.choices: list[Choice] = []
        self.rids: list[str] = []
        self.max_new: list[int] = []
        self.batch = self.batch or sampling.n > 1
        for p, ids in enumerate(prompts):
            where = "input_ids" if req.input_ids is not None else "text"
            limit = sampling.max_new_tokens or ctx.default_max_tokens(len(ids))
            ctx.check_prompt(ids, limit, where)
            if req.routed_experts_start_len > len(ids):
                raise FieldProblem(
                    "routed_experts_start_len",
                    f"must be at most the prompt's {len(ids)} tokens, got "
                    f"{req.routed_experts_start_len}",
                )
            for j in range(sampling.n):
                seed = None if sampling.sampling_seed is None else sampling.sampling_seed + j
                params = ctx.sampling(
                    {
                        "max_tokens": limit,
                        "temperature": sampling.temperature,
                        "top_p": sampling.top_p,
                        "top_k": sampling.top_k,
                        "seed": seed,
                        "stop_token_ids": list(sampling.stop_token_ids or []),
                        "ignore_eos": sampling.ignore_eos,
                        "stop": sampling.stop_strings,
                        "include_stop_str_in_output": sampling.no_stop_trim,
                        "skip_special_tokens": sampling.skip_special_tokens,
                        "min_tokens": sampling.min_new_tokens,
                        "min_p": sampling.min_p,
                        "presence_penalty": sampling.presence_penalty,
                        "frequency_penalty": sampling.frequency_penalty,
                        "repetition_penalty": sampling.repetition_penalty,
                        "logprobs": req.top_logprobs_num if req.return_logprob else None,
                    }
                )
                rid = rids[p] if sampling.n == 1 else f"{rids[p]}-{j}"
                self.rids.append(rid)
                self.max_new.append(limit)
                aliases = () if rid == rids[p] else (rids[p],)  # the client's rid, n > 1
                self.requests.append(
                    EngineRequest(rid, ids, params, stream=req.stream, aliases=aliases)
                )
                self.choices.append(Choice(ctx, ids, params))
        ctx.claim(self.rids, "rid")


def _ctx(http: HttpRequest) -> ServingContext:
    return http.app.state.serving


def _output(
    ctx: ServingContext,
    req: GenerateRequest,
    plan: _Plan,
    i: int,
    done: FinishedRequest,
    start: float,
    clock: EncodeClock,
) -> dict[str, Any]:
    choice = plan.choices[i]
    meta: dict[str, Any] = {
        "id": plan.rids[i],
        "finish_reason": _finish_reason(done, choice, plan.max_new[i]),
        "prompt_tokens": done.prompt_len,
        "completion_tokens": done.output_len,
        "cached_tokens": done.num_cached_tokens,
        "e2e_latency": time.perf_counter() - start,
        # The weights that sampled the last token (the server's, before any token).
        "weight_version": (
            done.weight_versions[-1][0] if done.weight_versions else ctx.loop.state.weight_version
        ),
    }
    if req.return_logprob:
        lps = choice.logprobs(done, 0) or []
        meta.update(sglang_logprobs(done.output_token_ids.tolist(), lps, req.top_logprobs_num))
    # A request aborted before its prefill completed has rows for part of its prompt only;
    # clients reshape to prompt + output - 1 rows, so it gets none.
    whole = done.num_rows == done.prompt_len + done.output_len - 1
    if req.return_routed_experts and ctx.return_routed_experts and whole:  # else left out
        t0 = time.perf_counter()
        meta["routed_experts"] = ctx.sglang_routed_experts(
            done.routed_experts, req.routed_experts_start_len
        )
        clock.seconds += time.perf_counter() - t0
    if req.return_routed_weights:
        t0 = time.perf_counter()
        meta["routed_weights"] = ctx.sglang_routed_weights(
            done.routed_weights, req.routed_experts_start_len
        )
        clock.seconds += time.perf_counter() - t0
    return {"text": choice.text, "output_ids": done.output_token_ids.tolist(), "meta_info": meta}


async def generate(http: HttpRequest) -> Response:
    start = time.perf_counter()
    ctx = _ctx(http)
    req: GenerateRequest = await read_body(http, GenerateRequest)
    sampling = req.sampling()
    if sampling.max_new_tokens == 0:
        raise FieldProblem("sampling_params.max_new_tokens", "must be at least 1 here")
    ctx.check_sequences(_num_prompts(req), sampling.n, "sampling_params.n")
    prompts, batch = await ctx.off_loop(_text_chars(req), _prompts, ctx, req)
    plan = _Plan(ctx, req, sampling, prompts, batch)
    if req.stream:
        return StreamingResponse(
            _stream(ctx, http, req, plan, start), media_type="text/event-stream"
        )
    clock = EncodeClock()
    try:
        finished = await generate_all(ctx, http, plan.requests)
    except ClientGone:
        return Response(status_code=499)
    outputs = []
    for i, done in enumerate(finished):
        plan.choices[i].finish(done)
        outputs.append(_output(ctx, req, plan, i, done, start, clock))
    return JSONBody(outputs if plan.batch else outputs[0], headers=clock.header())


async def _stream(
    ctx: ServingContext, http: HttpRequest, req: GenerateRequest, plan: _Plan, start: float
) -> AsyncIterator[str]:
    clock = EncodeClock()
    tokens: list[list[int]] = [[] for _ in plan.choices]
    try:
        async for i, event in stream_events(ctx, http, plan.requests):
            choice = plan.choices[i]
            if isinstance(event, Finished):
                choice.finish(event.request)
                out = _output(ctx, req, plan, i, event.request, start, clock)
            else:
                choice.add(event.token_ids)
                tokens[i] += event.token_ids
                out = {
                    "text": choice.text,
                    "output_ids": list(tokens[i]),
                    "meta_info": {
                        "id": plan.rids[i],
                        "finish_reason": None,
                        "prompt_tokens": len(plan.requests[i].prompt_token_ids),
                        "completion_tokens": len(tokens[i]),
                    },
                }
            if plan.batch:
                out["index"] = i
            yield sse(out)
    except ClientGone:
        return
    except FieldProblem as problem:
        yield sse(error_body(problem.status, str(problem), problem.field))
    yield DONE


ROUTES = [Route("/generate", generate, methods=["POST"])]
