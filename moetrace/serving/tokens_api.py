"""vLLM's tokens-in, tokens-out ``/inference/v1/generate``, with prime-rl's routed experts.

The body is vLLM's ``GenerateRequest`` (``token_ids``, ``sampling_params`` with
vLLM's names, ``model``, ``cache_salt``, ``request_id``); the answer is
``{"request_id", "choices": [{"index", "logprobs", "finish_reason",
"token_ids", "routed_experts", "weight_versions"}], "prompt_logprobs",
"kv_transfer_params", "usage"}``.  ``routed_experts`` is prime-rl's compact
object: ``{"data": base64 of the raw array, "shape", "start", "dtype"}``,
the rows from ``sampling_params.routed_experts_prompt_start`` on, every
hidden layer (dense ones zero), uint8 up to 256 experts; verifiers decodes it
by dtype and shape and offsets it by ``start``.  ``max_tokens`` left out
means the rest of the context, as prime-rl and newer vLLM default it.
SkyRL asks ``/skyrl/v1/generate`` when it replays routing; the same handler
answers there (its decoder reads ``data``, ``shape`` and ``dtype``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from moetrace.engine.sampling import MAX_LOGPROBS
from moetrace.serving.choices import Choice, EncodeClock, weight_version_spans
from moetrace.serving.context import ServingContext
from moetrace.serving.engine_loop import EngineRequest
from moetrace.serving.generation import ClientGone, generate_all
from moetrace.serving.logprobs import chat_logprobs
from moetrace.serving.protocol import (
    INT64,
    FieldProblem,
    Strict,
    refuse_unsupported,
    validation_problem,
)
from moetrace.serving.responses import JSONBody, new_id, read_body, usage

_SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
    "logits_processors": None,
    "truncate_prompt_tokens": None,
    "extra_args": None,
    "detokenize": True,
    "flat_logprobs": False,
    "output_kind": None,
}


class TokensSampling(Strict):
    """vLLM's ``SamplingParams`` as JSON, the fields the engine honours."""

    n: int = Field(1, ge=1, le=1024)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    routed_experts_prompt_start: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, _SAMPLING_UNSUPPORTED)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TokensGenerateRequest(Strict):
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = 0
    features: dict | None = None
    kv_transfer_params: dict | None = None
    stream_options: dict | None = None

    @model_validator(mode="after")
    def _checks(self) -> TokensGenerateRequest:
        for name, value, default in (
            ("stream", self.stream, False),
            ("priority", self.priority, 0),
            ("features", self.features, None),
            ("kv_transfer_params", self.kv_transfer_params, None),
        ):
            if value not in (default, None):
                raise FieldProblem(name, f"not supported by moetrace serve, got {value!r}")
        return self

    def sampling(self) -> TokensSampling:
        from pydantic import ValidationError

        try:
            return TokensSampling.model_validate(self.sampling_params)
        except ValidationError as exc:
            raise validation_problem(exc, "sampling_params.") from None


def _ctx(http: HttpRequest) -> ServingContext:
    return http.app.state.serving


async def generate_tokens(http: HttpRequest) -> Response:
    ctx = _ctx(http)
    req: TokensGenerateRequest = await read_body(http, TokensGenerateRequest)
    ctx.check_model(req.model)
    sp = req.sampling()
    ids = list(req.token_ids)
    limit = sp.max_tokens or ctx.default_max_tokens(len(ids))
    ctx.check_prompt(ids, limit, "token_ids")
    start = sp.routed_experts_prompt_start
    if start > len(ids):
        raise FieldProblem(
            "sampling_params.routed_experts_prompt_start",
            f"must be at most the prompt's {len(ids)} tokens, got {start}",
        )
    request_id = req.request_id or new_id()
    requests, choices = [], []
    for j in range(sp.n):
        params = ctx.sampling(
            {
                "max_tokens": limit,
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "top_k": sp.top_k,
                "seed": None if sp.seed is None else sp.seed + j,
                "stop_token_ids": list(sp.stop_token_ids or []),
                "ignore_eos": sp.ignore_eos,
                "stop": sp.stop_strings,
                "include_stop_str_in_output": sp.include_stop_str_in_output,
                "skip_special_tokens": sp.skip_special_tokens,
                "min_tokens": sp.min_tokens,
                "min_p": sp.min_p,
                "presence_penalty": sp.presence_penalty,
                "frequency_penalty": sp.frequency_penalty,
                "repetition_penalty": sp.repetition_penalty,
                "logprobs": sp.logprobs,
            }
        )
        rid = f"generate-tokens-{request_id}-{j}"
        # vLLM's engine id is ``generate-tokens-<request_id>``; the answer shows request_id.
        aliases = (f"generate-tokens-{request_id}", request_id)
        requests.append(EngineRequest(rid, ids, params, cache_salt=req.cache_salt, aliases=aliases))
        choices.append(Choice(ctx, ids, params))
    try:
        finished = await generate_all(ctx, http, requests)
    except ClientGone:
        return Response(status_code=499)
    clock = EncodeClock()
    out = []
    for i, (choice, done) in enumerate(zip(choices, finished, strict=True)):
        choice.finish(done)
        tokens = done.output_token_ids.tolist()
        lps = choice.logprobs(done, 0)
        routed = None
        if ctx.return_routed_experts:
            routed = ctx.packed_routed_experts(done.routed_experts, start)
        out.append(
            {
                "index": i,
                "logprobs": None if lps is None else chat_logprobs(ctx.tokenizer, tokens, lps),
                "finish_reason": done.finish_reason,
                "token_ids": tokens,
                "routed_experts": routed,
                "weight_versions": weight_version_spans(done),
            }
        )
    body = {
        "request_id": request_id,
        "choices": out,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "usage": usage(len(ids), sum(f.output_len for f in finished)),
    }
    return JSONBody(body, headers=clock.header())


ROUTES = [
    Route("/inference/v1/generate", generate_tokens, methods=["POST"]),
    # SkyRL's route for rollouts with routed experts: the same body, the same packed object
    # (skyrl/backends/skyrl_train/inference_servers/generate_wire.py).
    Route("/skyrl/v1/generate", generate_tokens, methods=["POST"]),
]
