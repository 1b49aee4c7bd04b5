"""``/v1/completions`` and ``/v1/chat/completions`` with vLLM's routed-experts fields.

Per choice, ``routed_experts`` is vLLM's encoding (base64 ``.npy``, shape
``(prompt_len + output_len - 1 - routed_experts_prompt_start,
num_hidden_layers, top_k)``); ``return_token_ids`` adds ``prompt_token_ids``
(on the choice for completions, on the response for chat, as vLLM places
them) and each choice's ``token_ids``.  ``n`` runs n engine requests of the
same prompt; with a ``seed`` choice i samples with ``seed + i``, as vLLM's
parallel sampling does.  In a stream the routed experts come with each
choice's final chunk (vLLM's OpenAI streams carry none; its ``/generate``
stream does, per chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from moetrace.serving.choices import Choice, EncodeClock, weight_version_spans
from moetrace.serving.context import ServingContext
from moetrace.serving.engine_loop import EngineRequest, Finished
from moetrace.serving.generation import ClientGone, generate_all, stream_events
from moetrace.serving.logprobs import chat_logprobs, completion_logprobs
from moetrace.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldProblem,
    SamplingFields,
)
from moetrace.serving.responses import (
    DONE,
    JSONBody,
    error_body,
    new_id,
    now,
    read_body,
    sse,
    usage,
)


@dataclass
class Plan:
    """A request turned into engine requests: one per (prompt, sample)."""

    response_id: str
    prompts: list[list[int]]
    requests: list[EngineRequest]
    choices: list[Choice]
    n: int

    def prompt_of(self, choice_index: int) -> list[int]:
        return self.prompts[choice_index // self.n]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _num_prompts(prompt: Any) -> int:
    return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)


def _text_chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def _completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [ctx.encode(prompt, "prompt", req.add_special_tokens)]
    # The model checked that the list is all ints, all strings or all lists: one look will do.
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    out = []
    for i, item in enumerate(prompt):
        ids = (
            ctx.encode(item, f"prompt.{i}", req.add_special_tokens)
            if isinstance(item, str)
            else item
        )
        out.append(list(ids))  # type: ignore[arg-type]
    return out


def _plan(
    ctx: ServingContext,
    req: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    prefix: str,
    logprobs: int | None,
) -> Plan:
    ctx.check_model(req.model)
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise FieldProblem(
            "stream_options.continuous_usage_stats", "not supported by moetrace serve"
        )
    ctx.check_weights_asked(req.return_routed_weights)
    # vLLM's rule: the response id is the prefix and the client's request_id.
    base_id = req.request_id or new_id()
    response_id = f"{prefix}-{base_id}"
    requests, choices = [], []
    for p, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt.{p}"
        limit = max_tokens if max_tokens is not None else ctx.default_max_tokens(len(ids))
        ctx.check_prompt(ids, limit, "messages" if prefix == "chatcmpl" else where)
        if req.routed_experts_prompt_start > len(ids):  # vLLM: 0 <= start <= prompt_len
            raise FieldProblem(
                "routed_experts_prompt_start",
                f"must be at most the prompt's {len(ids)} tokens, got "
                f"{req.routed_experts_prompt_start}",
            )
        for j in range(req.n):
            seed = None if req.seed is None else req.seed + j
            params = ctx.sampling(
                {
                    "max_tokens": limit,
                    "temperature": req.temperature,
                    "top_p": req.top_p,
                    "top_k": req.top_k,
                    "seed": seed,
                    "stop_token_ids": list(req.stop_token_ids or []),
                    "ignore_eos": req.ignore_eos,
                    "stop": req.stop_strings,
                    "include_stop_str_in_output": req.include_stop_str_in_output,
                    "skip_special_tokens": req.skip_special_tokens,
                    "min_tokens": req.min_tokens,
                    "min_p": req.min_p,
                    "presence_penalty": req.presence_penalty,
                    "frequency_penalty": req.frequency_penalty,
                    "repetition_penalty": req.repetition_penalty,
                    "logprobs": logprobs,
                }
            )
            requests.append(
                EngineRequest(
                    f"{response_id}-{p}-{j}",
                    ids,
                    params,
                    stream=bool(req.stream),
                    cache_salt=req.cache_salt,
                    # vLLM's engine id for the prompt is ``<response id>-<p>``.
                    aliases=(response_id, f"{response_id}-{p}", base_id),
                )
            )
            choices.append(Choice(ctx, ids, params))
    ctx.claim([r.request_id for r in requests], "request_id")
    return Plan(response_id, prompts, requests, choices, req.n)


def _ctx(http: HttpRequest) -> ServingContext:
    return http.app.state.serving


def _routed_weights(req, choice: Choice, done, clock: EncodeClock) -> dict:
    """The choice's ``routed_weights`` entry when the request asked for it, else nothing;
    likewise ``weight_versions`` (vLLM's spans)."""
    out = {}
    if req.return_routed_weights:
        out.update(choice.routed_weights(done, req.routed_experts_prompt_start, clock))
    if req.return_weight_versions:
        out["weight_versions"] = weight_version_spans(done)
    return out


def _completion_lp(ctx: ServingContext, token_ids, lps, offset: int = 0) -> dict | None:
    return None if lps is None else completion_logprobs(ctx.tokenizer, token_ids, lps, offset)


def _chat_lp(ctx: ServingContext, token_ids, lps) -> dict | None:
    return None if lps is None else chat_logprobs(ctx.tokenizer, token_ids, lps)


# ----------------------------------------------------------------------------- completions


async def completions(http: HttpRequest) -> Response:
    ctx = _ctx(http)
    req: CompletionRequest = await read_body(http, CompletionRequest)
    ctx.check_model(req.model)
    ctx.check_sequences(_num_prompts(req.prompt), req.n, "prompt" if req.n == 1 else "n")
    prompts = await ctx.off_loop(_text_chars(req.prompt), _completion_prompts, ctx, req)
    plan = _plan(ctx, req, prompts, req.max_tokens, "cmpl", req.logprobs)
    if req.stream:
        return _sse_response(_completion_stream(ctx, http, req, plan))
    clock = EncodeClock()
    try:
        finished = await generate_all(ctx, http, plan.requests)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for i, (choice, done) in enumerate(zip(plan.choices, finished, strict=True)):
        choice.finish(done)
        choices.append(
            {
                "index": i,
                "text": choice.text,
                "logprobs": _completion_lp(
                    ctx, done.output_token_ids.tolist(), choice.logprobs(done, 0)
                ),
                "finish_reason": done.finish_reason,
                "stop_reason": choice.stop_reason(done),
                "token_ids": done.output_token_ids.tolist() if req.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": plan.prompt_of(i) if req.return_token_ids else None,
                "routed_experts": choice.routed_experts(
                    done, req.routed_experts_prompt_start, clock
                ),
                **_routed_weights(req, choice, done, clock),
            }
        )
    body = {
        "id": plan.response_id,
        "object": "text_completion",
        "created": now(),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(plan.prompt_tokens, sum(f.output_len for f in finished)),
    }
    return JSONBody(body, headers=clock.header())


async def _completion_stream(
    ctx: ServingContext, http: HttpRequest, req: CompletionRequest, plan: Plan
) -> AsyncIterator[str]:
    created = now()
    completion_tokens = 0
    first = [True] * len(plan.choices)
    clock = EncodeClock()

    offsets = [0] * len(plan.choices)

    def chunk(i: int, text: str, token_ids: list[int], lps, **extra: Any) -> str:
        logprobs = _completion_lp(ctx, token_ids, lps, offsets[i])
        offsets[i] += len(text)
        choice: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": extra.pop("finish_reason", None),
            "stop_reason": extra.pop("stop_reason", None),
            "prompt_token_ids": plan.prompt_of(i) if req.return_token_ids and first[i] else None,
            "token_ids": token_ids if req.return_token_ids else None,
            **extra,
        }
        first[i] = False
        return sse(
            {
                "id": plan.response_id,
                "object": "text_completion",
                "created": created,
                "model": ctx.model_name,
                "choices": [choice],
            }
        )

    try:
        async for i, event in _events(ctx, http, plan):
            choice = plan.choices[i]
            if isinstance(event, Finished):
                done = event.request
                text, rest = choice.finish(done)
                completion_tokens += done.output_len
                yield chunk(
                    i,
                    text,
                    rest,
                    choice.logprobs(done, len(done.output_token_ids) - len(rest)),
                    finish_reason=done.finish_reason,
                    stop_reason=choice.stop_reason(done),
                    routed_experts=choice.routed_experts(
                        done, req.routed_experts_prompt_start, clock
                    ),
                    **_routed_weights(req, choice, done, clock),
                )
            else:
                text = choice.add(event.token_ids)
                if text or req.return_token_ids or event.logprobs:
                    yield chunk(i, text, event.token_ids, event.logprobs)
    except FieldProblem as problem:  # the engine refused or stopped
        yield stream_error(problem)
        yield DONE
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(
            {
                "id": plan.response_id,
                "object": "text_completion",
                "created": created,
                "model": ctx.model_name,
                "choices": [],
                "usage": usage(plan.prompt_tokens, completion_tokens),
            }
        )
    yield DONE


# ----------------------------------------------------------------------------------- chat


def _chat_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    variables = {
        **(req.chat_template_kwargs or {}),
        "add_generation_prompt": req.add_generation_prompt,
    }
    return ctx.chat_prompt(req.messages, variables)


async def chat_completions(http: HttpRequest) -> Response:
    ctx = _ctx(http)
    req: ChatCompletionRequest = await read_body(http, ChatCompletionRequest)
    ctx.check_model(req.model)
    ctx.check_sequences(1, req.n, "n")
    chars = sum(len(str(m.get("content") or "")) for m in req.messages)
    prompt = [await ctx.off_loop(chars, _chat_prompt, ctx, req)]
    plan = _plan(ctx, req, prompt, req.requested_max_tokens, "chatcmpl", req.num_logprobs)
    if req.stream:
        return _sse_response(_chat_stream(ctx, http, req, plan))
    clock = EncodeClock()
    try:
        finished = await generate_all(ctx, http, plan.requests)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for i, (choice, done) in enumerate(zip(plan.choices, finished, strict=True)):
        choice.finish(done)
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": _chat_lp(ctx, done.output_token_ids.tolist(), choice.logprobs(done, 0)),
                "finish_reason": done.finish_reason,
                "stop_reason": choice.stop_reason(done),
                "token_ids": done.output_token_ids.tolist() if req.return_token_ids else None,
                "routed_experts": choice.routed_experts(
                    done, req.routed_experts_prompt_start, clock
                ),
                **_routed_weights(req, choice, done, clock),
            }
        )
    body = {
        "id": plan.response_id,
        "object": "chat.completion",
        "created": now(),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(plan.prompt_tokens, sum(f.output_len for f in finished)),
        "prompt_logprobs": None,
        "prompt_token_ids": plan.prompts[0] if req.return_token_ids else None,
    }
    return JSONBody(body, headers=clock.header())


async def _chat_stream(
    ctx: ServingContext, http: HttpRequest, req: ChatCompletionRequest, plan: Plan
) -> AsyncIterator[str]:
    created = now()
    completion_tokens = 0
    clock = EncodeClock()
    prompt_sent = False

    def chunk(i: int, delta: dict[str, Any], token_ids: list[int], lps=None, **extra: Any) -> str:
        nonlocal prompt_sent
        body: dict[str, Any] = {
            "id": plan.response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": ctx.model_name,
            "choices": [
                {
                    "index": i,
                    "delta": delta,
                    "logprobs": _chat_lp(ctx, token_ids, lps),
                    "finish_reason": extra.pop("finish_reason", None),
                    "stop_reason": extra.pop("stop_reason", None),
                    "token_ids": token_ids if req.return_token_ids else None,
                    **extra,
                }
            ],
        }
        if req.return_token_ids and not prompt_sent:
            body["prompt_token_ids"] = plan.prompts[0]
            prompt_sent = True
        return sse(body)

    for i in range(len(plan.choices)):  # the role comes first, as in OpenAI's streams
        yield chunk(i, {"role": "assistant", "content": ""}, [])
    try:
        async for i, event in _events(ctx, http, plan):
            choice = plan.choices[i]
            if isinstance(event, Finished):
                done = event.request
                text, rest = choice.finish(done)
                completion_tokens += done.output_len
                yield chunk(
                    i,
                    {"content": text} if text else {},
                    rest,
                    choice.logprobs(done, len(done.output_token_ids) - len(rest)),
                    finish_reason=done.finish_reason,
                    stop_reason=choice.stop_reason(done),
                    routed_experts=choice.routed_experts(
                        done, req.routed_experts_prompt_start, clock
                    ),
                    **_routed_weights(req, choice, done, clock),
                )
            else:
                text = choice.add(event.token_ids)
                if text or req.return_token_ids or event.logprobs:
                    yield chunk(i, {"content": text}, event.token_ids, event.logprobs)
    except FieldProblem as problem:  # the engine refused or stopped
        yield stream_error(problem)
        yield DONE
        return
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(
            {
                "id": plan.response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": ctx.model_name,
                "choices": [],
                "usage": usage(plan.prompt_tokens, completion_tokens),
            }
        )
    yield DONE


# ------------------------------------------------------------------------------ streaming


def _sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream")


async def _events(ctx: ServingContext, http: HttpRequest, plan: Plan):
    """The plan's stream events; ends quietly when the client has gone."""
    try:
        async for item in stream_events(ctx, http, plan.requests):
            yield item
    except ClientGone:
        return


def stream_error(problem: FieldProblem) -> str:
    return sse(error_body(problem.status, str(problem), problem.field))


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
