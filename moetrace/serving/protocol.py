"""Request bodies the server accepts, with vLLM's field names, defaults and checks.

Every field vLLM accepts on ``/v1/completions`` and ``/v1/chat/completions``
is known here.  Those the engine honours are typed fields; the others are
accepted only at their default value (``echo: false``, ``logit_bias: null``,
...) and refused otherwise with a 400 naming them, so a rollout never runs
with a setting silently dropped.  A field vLLM does not know is refused too
(newest vLLM ignores unknown fields with a log line; moetrace answers 400,
because a misspelt ``max_token`` would otherwise change every rollout).

SGLang's ``/generate`` body is checked the same way (``GenerateRequest``,
``GenerateSampling``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from moetrace.engine.sampling import MAX_LOGPROBS

INT64 = 2**63
TOKEN_ID_LIMIT = 2**31  # token ids travel as int32 (the trace, the engine's tensors)
MAX_ID_CHARS = 512  # a request id is a key clients join on, not a payload


class FieldProblem(Exception):
    """A request field that is wrong or unsupported: answered with a 400 naming it."""

    def __init__(self, field: str | None, problem: str, status: int = 400) -> None:
        self.field = field
        self.problem = problem
        self.status = status
        where = f"field '{field}': " if field else ""
        super().__init__(f"{where}{problem}")


# Parts of a pydantic error location that name a member of a union, not a field.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")


def validation_problem(exc: ValidationError, prefix: str = "") -> FieldProblem:
    """The first error of a pydantic validation, as one line naming its field."""
    err = exc.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if not (isinstance(p, str) and _UNION_MEMBER.match(p))]
    path = prefix + ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        return FieldProblem(path, "unknown field (not one vLLM accepts here)")
    if err["type"] == "missing":
        return FieldProblem(path or None, "required")
    if err["type"] == "value_error":  # our own validators say what they expected
        return FieldProblem(path or None, str(err["msg"]).removeprefix("Value error, "))
    return FieldProblem(path or None, f"{err['msg']}, got {_shown(err.get('input'))}")


def _token_ids(value: Any, where: str = "") -> list[int]:
    """A list of token ids: integers (never booleans) in ``0 .. 2**31 - 1``."""
    if not isinstance(value, list):
        raise ValueError("expected a list of token ids")
    for i, item in enumerate(value):
        if type(item) is not int or not 0 <= item < TOKEN_ID_LIMIT:
            raise ValueError(
                f"token id {where}{i} must be an integer in 0..{TOKEN_ID_LIMIT - 1}, "
                f"got {_shown(item)}"
            )
    return value


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def prompt_value(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """vLLM's prompt forms: text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        if value == []:
            return value
        raise ValueError(
            "expected text, a list of texts, a list of token ids or a list of token-id lists"
        )
    if all(isinstance(v, str) for v in value):
        return value
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            _token_ids(ids, f"{i}.")
        return value
    if any(isinstance(v, (str, list)) for v in value):
        raise ValueError("a list prompt must hold only texts, only token ids or only lists")
    return _token_ids(value)


def request_id_value(value: Any) -> Any:
    """An id that is stored in the trace as given: printable text of bounded length."""
    if isinstance(value, str):
        if not value:
            raise ValueError("an id must not be empty")
        if len(value) > MAX_ID_CHARS:
            raise ValueError(f"an id has at most {MAX_ID_CHARS} characters, got {len(value)}")
        if "\x00" in value:
            raise ValueError("an id must not contain NUL characters")
    return value


def rid_value(value: Any) -> Any:
    """SGLang's ``rid``: one id, or one per prompt."""
    if value is None:
        return value
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        where = f"rid {i}: " if isinstance(value, list) else ""
        if not isinstance(item, str):
            raise ValueError(f"{where}expected a string or a list of strings, got {_shown(item)}")
        try:
            request_id_value(item)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None
    return value


TokenIds = Annotated[list[int], BeforeValidator(_token_ids)]
RequestId = Annotated[str, AfterValidator(request_id_value)]


def refuse_unsupported(data: Any, defaults: dict[str, Any]) -> Any:
    """Drop known-but-unsupported fields left at their default; refuse any other value."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, default in defaults.items():
        if name not in out:
            continue
        value = out.pop(name)
        if value is None or value == default:
            continue
        raise FieldProblem(
            name, f"not supported by moetrace serve (only {default!r} is accepted), got {value!r}"
        )
    return out


class Strict(BaseModel):
    """No unknown field, no coercion: ``"n": "2"`` or ``"stream": "yes"`` is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


# vLLM fields moetrace accepts only at these values (engine features not built yet).
_COMMON_UNSUPPORTED: dict[str, Any] = {
    "logit_bias": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "watermarking": False,
    "allowed_token_ids": None,
    "bad_words": [],
    "prompt_logprobs": None,
    "logprob_token_ids": None,
    "return_tokens_as_token_ids": False,
    "return_token_offsets": False,
    "return_mm_kwargs": True,
    "truncate_prompt_tokens": None,
    "truncation_side": None,
    "response_format": None,
    "structured_outputs": None,
    "priority": 0,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
    "stream_interval": None,
    "session_id": None,
    "prompt_embeds": None,
}


class SamplingFields(Strict):
    """The fields both OpenAI endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=1024)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Fast tokenizers decode the same either way (no spaces are inserted).
    spaces_between_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: RequestId | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    # moetrace's: each choice's gate weights beside its routed experts (docs/serving.md).
    return_routed_weights: bool = False
    # vLLM's: prefix-cache hits only among requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: per choice, which weight version sampled which output tokens.
    return_weight_versions: bool = False

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _checks(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldProblem("stream_options", "only allowed with stream: true")
        return self


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, AfterValidator(prompt_value)]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        data = refuse_unsupported(data, _COMMON_UNSUPPORTED)
        if isinstance(data, dict) and data.get("max_tokens", 0) is None:
            data = {**data, "max_tokens": 16}  # vLLM: null means the default
        return data

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.echo:
            raise FieldProblem("echo", "echo is not supported by moetrace serve")
        if self.suffix:
            raise FieldProblem("suffix", "suffix is not supported (vLLM refuses it too)")
        if self.prompt == "" or self.prompt == []:
            raise FieldProblem("prompt", "empty prompt")
        return self


_CHAT_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "tools": None,
    "tool_choice": "none",
    "parallel_tool_calls": True,
    "reasoning_effort": None,
    "include_reasoning": True,
    "echo": False,
    "continue_final_message": False,
    "documents": None,
    "chat_template": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "return_prompt_text": None,
    "add_special_tokens": False,
}


# Variables the chat template gets from the request: chat_template_kwargs may not set them.
_TEMPLATE_OWN_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "add_special_tokens", "tools", "documents"}
)


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, _CHAT_UNSUPPORTED)

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldProblem("top_logprobs", "needs logprobs: true (as in vLLM)")
        for i, message in enumerate(self.messages):
            if not isinstance(message.get("role"), str):
                raise FieldProblem(f"messages.{i}.role", "each message needs a role (a string)")
            content = message.get("content")
            if not (content is None or isinstance(content, (str, list))):
                raise FieldProblem(f"messages.{i}.content", "expected a string or a list of parts")
        for name in self.chat_template_kwargs or {}:
            if name in _TEMPLATE_OWN_VARIABLES:
                raise FieldProblem(
                    f"chat_template_kwargs.{name}",
                    f"'{name}' is set by the request itself, not by chat_template_kwargs",
                )
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --- SGLang's native /generate -------------------------------------------------------

_SGLANG_SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "stream_interval": None,
}


class GenerateSampling(Strict):
    """SGLang's ``sampling_params`` with its defaults (max_new_tokens 128, top_k -1)."""

    max_new_tokens: int | None = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    min_new_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, _SGLANG_SAMPLING_UNSUPPORTED)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


_GENERATE_UNSUPPORTED: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "lora_path": None,
    "return_hidden_states": False,
    "logprob_start_len": -1,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "session_params": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "priority": None,
    "return_indexer_topk": False,
}


class GenerateRequest(Strict):
    text: str | list[str] | None = None
    input_ids: Annotated[Any, AfterValidator(prompt_value)] = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: Annotated[Any, AfterValidator(rid_value)] = None
    return_logprob: bool | None = None
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)
    return_routed_weights: bool = False  # moetrace's: meta_info.routed_weights
    log_metrics: bool = True
    modalities: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, _GENERATE_UNSUPPORTED)

    @model_validator(mode="after")
    def _checks(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise FieldProblem("text", "give exactly one of text and input_ids")
        if isinstance(self.input_ids, str) or (
            isinstance(self.input_ids, list) and any(isinstance(v, str) for v in self.input_ids)
        ):
            raise FieldProblem("input_ids", "expected token ids (send text as 'text')")
        return self

    def sampling(self) -> GenerateSampling:
        try:
            return GenerateSampling.model_validate(self.sampling_params or {})
        except ValidationError as exc:
            raise validation_problem(exc, "sampling_params.") from None
