"""What every handler needs: the engine loop, the tokenizer and the model's facts.

Requests are checked here before they reach the engine (prompt length,
vocabulary, KV cache room, the routed-experts offset), so a bad request is
answered with a 400 naming its field and the engine never sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from moetrace.engine.llm_engine import request_problem
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import ModelError
from moetrace.inputs.tokenizer import Tokenizer
from moetrace.models.source import ModelSource
from moetrace.runs.setup import generation_defaults as checkpoint_generation_defaults
from moetrace.serving.engine_loop import EngineLoop
from moetrace.serving.metrics import ServerMetrics
from moetrace.serving.protocol import FieldProblem
from moetrace.serving.responses import Base64Text
from moetrace.trace.wire import (
    float32_base64,
    hidden_layer_rows,
    int32_base64,
    npy_base64,
    raw_base64,
)

T = TypeVar("T")

# Texts longer than this are tokenized in a thread: the event loop keeps answering meanwhile.
TOKENIZE_IN_THREAD_CHARS = 16 << 10

# vLLM's defaults for OpenAI requests that leave a sampling field out.
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def generation_defaults(model: ModelSource, mode: str) -> dict[str, Any]:
    """Sampling defaults: vLLM's, overridden by the checkpoint's generation_config.json (auto)."""
    found, _ = checkpoint_generation_defaults(model, mode)
    return {**OPENAI_SAMPLING_DEFAULTS, **found}


@dataclass
class ModelFacts:
    """The routing shape clients decode against."""

    num_hidden_layers: int
    moe_layer_indices: list[int]
    num_experts: int
    top_k: int
    vocab_size: int


@dataclass
class ServingContext:
    loop: EngineLoop
    tokenizer: Tokenizer | None
    model: ModelFacts
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    return_routed_experts: bool
    eos_token_ids: tuple[int, ...] = ()
    return_routed_weights: bool = False  # the engine captures gate weights
    sampling_defaults: dict[str, Any] = field(
        default_factory=lambda: dict(OPENAI_SAMPLING_DEFAULTS)
    )
    created: int = 0
    draining: bool = False
    # Engine requests one HTTP request may start (prompts x n): its work stays bounded.
    max_sequences_per_request: int = 4096
    # Longest text a prompt may be and still fit the context, whatever the tokenizer does
    # (max_model_len tokens of the longest vocabulary entry): longer is refused untokenized.
    max_prompt_chars: int | None = None
    metrics: ServerMetrics | None = None
    enable_weight_updates: bool = False  # the trainer's control routes exist
    weight_update_timeout_s: float = 600.0  # --weight-update-timeout: joins and transfers
    dtype: str = "auto"  # --dtype as given (SGLang's server info reports it)
    # Ranks that serve: a trainer's update group counts each (SGLang's tp_size, vLLM's world_size).
    tensor_parallel_size: int = 1

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise FieldProblem("model", f"The model `{name}` does not exist.", status=404)

    # ------------------------------------------------------------------ prompts
    def _need_tokenizer(self, field_name: str) -> Tokenizer:
        if self.tokenizer is None:
            raise FieldProblem(field_name, "the model has no tokenizer.json; send token ids")
        return self.tokenizer

    def check_sequences(self, prompts: int, n: int, where: str) -> None:
        """Refuse a request that would start more engine requests than the server allows."""
        if prompts * n > self.max_sequences_per_request:
            raise FieldProblem(
                where,
                f"{prompts} prompt(s) x n={n} is more than the {self.max_sequences_per_request} "
                "sequences one request may start (--max-sequences-per-request)",
            )

    def check_text_length(self, text: str, field_name: str) -> None:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise FieldProblem(
                field_name,
                f"{len(text):,} characters cannot fit the context of {self.max_model_len} tokens",
            )

    def encode(self, text: str, field_name: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._need_tokenizer(field_name)
        self.check_text_length(text, field_name)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def off_loop(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (tokenizing ``chars`` characters) in a thread when it is long work."""
        if chars > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def claim(self, request_ids: list[str], field_name: str) -> None:
        """Take the ids of a request's engine requests, or refuse it with a 409."""
        taken = self.loop.claim(request_ids)
        if taken is not None:
            raise FieldProblem(
                field_name,
                f"request id {taken!r} is in flight or already in the trace; use another",
                status=409,
            )

    def chat_prompt(self, messages: list[dict[str, Any]], variables: dict[str, Any]) -> list[int]:
        tokenizer = self._need_tokenizer("messages")
        plain = [_plain_message(m, i) for i, m in enumerate(messages)]
        for i, message in enumerate(plain):
            if isinstance(message.get("content"), str):
                self.check_text_length(message["content"], f"messages.{i}.content")
        try:
            return tokenizer.apply_chat_template(plain, **variables)
        except ModelError as exc:
            raise FieldProblem("messages", str(exc)) from None

    def check_prompt(self, ids: list[int], max_tokens: int, where: str = "prompt") -> None:
        """Refuse a prompt that can never run, as the engine would, naming the field."""
        problem = request_problem(ids, max_tokens, self.model.vocab_size, self.max_model_len)
        if problem is not None:
            name, text = problem
            raise FieldProblem(where if name in ("prompt", "prompt_token_ids") else name, text)
        need = -(-(len(ids) + max_tokens - 1) // self.block_size)
        if need > self.num_kv_blocks:
            raise FieldProblem(
                "max_tokens",
                f"the request needs {need} KV blocks of {self.block_size} tokens; the cache "
                f"holds {self.num_kv_blocks}",
            )

    def default_max_tokens(self, prompt_len: int) -> int:
        """vLLM's rule when a chat request gives no max_tokens: the rest of the context."""
        room = self.max_model_len - prompt_len
        by_cache = self.num_kv_blocks * self.block_size - prompt_len + 1
        return max(1, min(room, by_cache))

    def sampling(self, values: dict[str, Any]) -> SamplingParams:
        """Engine sampling settings: the request's values over the server's defaults."""
        merged = {**self.sampling_defaults, **{k: v for k, v in values.items() if v is not None}}
        try:
            return SamplingParams(**merged)
        except ValueError as exc:
            raise FieldProblem(None, str(exc)) from None

    # ------------------------------------------------------------------ routing
    def vllm_rows(self, rows: np.ndarray) -> np.ndarray:
        return hidden_layer_rows(rows, self.model.moe_layer_indices, self.model.num_hidden_layers)

    def vllm_routed_experts(self, rows: np.ndarray, start: int) -> Base64Text:
        """vLLM's ``routed_experts``: every hidden layer, rows from ``start`` on."""
        return Base64Text(npy_base64(self.vllm_rows(rows[start:])))

    def sglang_routed_experts(self, rows: np.ndarray, start: int) -> Base64Text:
        """SGLang's ``meta_info.routed_experts``: flat int32, rows from ``start`` on."""
        return Base64Text(int32_base64(self.vllm_rows(rows[start:])))

    def packed_routed_experts(self, rows: np.ndarray, start: int) -> dict:
        """prime-rl's ``routed_experts`` object: raw bytes of the rows from ``start`` on
        (every hidden layer), with their shape, ``start`` and dtype."""
        spread = self.vllm_rows(rows[start:])
        return {
            "data": Base64Text(raw_base64(spread)),
            "shape": list(spread.shape),
            "start": start,
            "dtype": spread.dtype.name,
        }

    def check_weights_asked(self, asked: bool) -> None:
        """Refuse a request for gate weights the engine does not capture."""
        if asked and not self.return_routed_weights:
            raise FieldProblem(
                "return_routed_weights",
                "the server was started without --enable-return-routed-weights",
            )

    def vllm_routed_weights(self, weights: np.ndarray, start: int) -> Base64Text:
        """``routed_weights`` beside vLLM's ``routed_experts``: the same rows and layout,
        ``.npy`` in the captured dtype (float16 or float32), dense layers zero."""
        return Base64Text(npy_base64(self.vllm_rows(weights[start:])))

    def sglang_routed_weights(self, weights: np.ndarray, start: int) -> Base64Text:
        """``meta_info.routed_weights``: the rows of ``routed_experts``, flat little-endian
        float32."""
        return Base64Text(float32_base64(self.vllm_rows(weights[start:])))


def _plain_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message whose content is a list of text parts, joined the way vLLM does."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise FieldProblem(
                f"messages.{index}.content.{j}", "only text parts are supported by moetrace serve"
            )
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}
