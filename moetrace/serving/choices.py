"""One generated sequence as a client sees it: text, finish and stop reasons, token ids.

As in vLLM, the token that stopped a request (EOS or one of
``stop_token_ids``) stays in ``token_ids`` but not in the text, unless
``include_stop_str_in_output`` (SGLang: ``no_stop_trim``) asks for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moetrace.engine.sampling import SamplingParams
from moetrace.serving.context import ServingContext
from moetrace.serving.text import IncrementalText
from moetrace.trace.records import FinishedRequest


@dataclass
class EncodeClock:
    """Time spent encoding routed experts, summed over a response (for the benchmark)."""

    seconds: float = 0.0

    def header(self) -> dict[str, str]:
        return {"x-routed-experts-encode-ms": f"{self.seconds * 1e3:.3f}"}


@dataclass
class Choice:
    ctx: ServingContext
    prompt_token_ids: list[int]
    sampling: SamplingParams
    skip_special_tokens: bool = True
    include_stop: bool = False
    sent_tokens: int = 0  # output tokens already streamed
    _text: IncrementalText | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.ctx.tokenizer is not None:
            self._text = IncrementalText(
                self.ctx.tokenizer, self.prompt_token_ids, self.skip_special_tokens
            )

    @property
    def stop_token_ids(self) -> frozenset[int]:
        eos = () if self.sampling.ignore_eos else self.ctx.eos_token_ids
        return frozenset(self.sampling.stop_token_ids) | frozenset(eos)

    def add(self, token_ids: list[int]) -> str:
        """Text completed by newly streamed tokens."""
        self.sent_tokens += len(token_ids)
        return self._text.add(token_ids) if self._text is not None else ""

    def finish(self, done: FinishedRequest) -> tuple[str, list[int]]:
        """(the rest of the text, the output tokens not streamed yet)."""
        ids = done.output_token_ids.tolist()
        rest = ids[self.sent_tokens :]
        self.sent_tokens = len(ids)
        text_ids = rest
        if self.stopped_by_token(done) and not self.include_stop and text_ids:
            text_ids = text_ids[:-1]
        text = self._text.add(text_ids, final=True) if self._text is not None else ""
        return text, rest

    @property
    def text(self) -> str:
        return self._text.text if self._text is not None else ""

    def stopped_by_token(self, done: FinishedRequest) -> bool:
        return (
            done.finish_reason == "stop"
            and done.output_len > 0
            and int(done.output_token_ids[-1]) in self.stop_token_ids
        )

    def stop_reason(self, done: FinishedRequest) -> int | None:
        """vLLM's ``stop_reason``: the stop token id, None for EOS and length."""
        if not self.stopped_by_token(done):
            return None
        last = int(done.output_token_ids[-1])
        return last if last in self.sampling.stop_token_ids else None

    def routed_experts(self, done: FinishedRequest, start: int, clock: EncodeClock) -> str | None:
        if not self.ctx.return_routed_experts:
            return None
        t0 = time.perf_counter()
        encoded = self.ctx.vllm_routed_experts(done.routed_experts, start)
        clock.seconds += time.perf_counter() - t0
        return encoded
