"""One generated sequence as a client sees it: text, finish and stop reasons, token ids.

As in vLLM, the token that stopped a request (EOS or one of
``stop_token_ids``) stays in ``token_ids`` but not in the text, unless
``include_stop_str_in_output`` (SGLang: ``no_stop_trim``) asks for it.  With
stop strings the engine cuts the text where the string starts (the tokens
stay whole), and a stream holds back the last ``len(longest stop) - 1``
characters until it knows they are not the start of a stop string, as vLLM
does, so streamed pieces always join to the final text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moetrace.engine.sampling import SamplingParams
from moetrace.serving.context import ServingContext
from moetrace.serving.logprobs import TokenLogprobs, from_output
from moetrace.serving.responses import Base64Text
from moetrace.serving.text import IncrementalText
from moetrace.trace.records import FinishedRequest


def weight_version_spans(done: FinishedRequest) -> list[dict]:
    """vLLM's ``weight_versions``: output tokens ``start..end-1`` were sampled by ``version``."""
    return [{"version": v, "start": start, "end": end} for v, start, end in done.weight_versions]


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
    sent_tokens: int = 0  # output tokens already streamed
    emitted: str = ""  # text already streamed
    final_text: str | None = None
    _text: IncrementalText | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.ctx.tokenizer is not None:
            self._text = IncrementalText(
                self.ctx.tokenizer, self.prompt_token_ids, self.sampling.skip_special_tokens
            )
        self._hold = max((len(s) for s in self.sampling.stop), default=1) - 1

    @property
    def stop_token_ids(self) -> frozenset[int]:
        eos = () if self.sampling.ignore_eos else self.ctx.eos_token_ids
        return frozenset(self.sampling.stop_token_ids) | frozenset(eos)

    def add(self, token_ids: list[int]) -> str:
        """Text completed by newly streamed tokens (less what a stop string may still take)."""
        self.sent_tokens += len(token_ids)
        if self._text is None:
            return ""
        self._text.add(token_ids)
        upto = max(len(self.emitted), len(self._text.text) - self._hold)
        piece = self._text.text[len(self.emitted) : upto]
        self.emitted += piece
        return piece

    def finish(self, done: FinishedRequest) -> tuple[str, list[int]]:
        """(the rest of the text, the output tokens not streamed yet)."""
        ids = done.output_token_ids.tolist()
        rest = ids[self.sent_tokens :]
        self.sent_tokens = len(ids)
        if done.output_text is not None:  # stop strings: the engine's text, cut where vLLM cuts
            final = done.output_text
        elif self._text is not None:
            text_ids = rest
            if self.stopped_by_token(done) and not self.sampling.include_stop_str_in_output:
                text_ids = text_ids[:-1]
            self._text.add(text_ids, final=True)
            final = self._text.text
        else:
            final = ""
        self.final_text = final
        piece = final[len(self.emitted) :] if final.startswith(self.emitted) else ""
        self.emitted = final
        return piece, rest

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else self.emitted

    def stopped_by_token(self, done: FinishedRequest) -> bool:
        return (
            done.finish_reason == "stop"
            and done.output_len > 0
            and not isinstance(done.stop_reason, str)
            and int(done.output_token_ids[-1]) in self.stop_token_ids
        )

    @staticmethod
    def stop_reason(done: FinishedRequest) -> int | str | None:
        """vLLM's ``stop_reason``: the stop token id or string; None for EOS and length."""
        return done.stop_reason

    def logprobs(self, done: FinishedRequest, start: int) -> list[TokenLogprobs] | None:
        return None if done.logprobs is None else from_output(done.logprobs, start)

    def routed_experts(
        self, done: FinishedRequest, start: int, clock: EncodeClock
    ) -> Base64Text | None:
        if not self.ctx.return_routed_experts:
            return None
        t0 = time.perf_counter()
        encoded = self.ctx.vllm_routed_experts(done.routed_experts, start)
        clock.seconds += time.perf_counter() - t0
        return encoded

    def routed_weights(self, done: FinishedRequest, start: int, clock: EncodeClock) -> dict:
        """``{"routed_weights": ...}`` for a request that asked (``return_routed_weights``)."""
        t0 = time.perf_counter()
        encoded = self.ctx.vllm_routed_weights(done.routed_weights, start)
        clock.seconds += time.perf_counter() - t0
        return {"routed_weights": encoded}
