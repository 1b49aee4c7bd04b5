"""Request state as the scheduler sees it.

A request's tokens are its prompt followed by what it generated.  The engine
tracks how many of them have been run through the model
(``num_computed_tokens``); everything else (what to schedule, when to sample,
which rows exist) follows from that count and ``num_tokens``.
"""

from __future__ import annotations

import enum
import time

import numpy as np

from moetrace.engine.logprob_columns import LogprobColumns, StepLogprobs
from moetrace.engine.logprob_columns import TokenLogprob as TokenLogprob  # its old home
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.stop_strings import StopStringMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputes from its tokens
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Scoring:
    """What makes a request teacher-forced: every token is given and nothing is sampled.

    The engine runs all tokens but the last (as for a finished request, whose
    last token is never run), so the request gets one routing row per token
    but the last, and the log-probability of each token from ``logprobs_from``
    on, given the ones before it.  ``forced_experts`` (``[rows, L, k]``, at
    least ``num_tokens - 1`` rows) routes token ``p`` through
    ``forced_experts[p]`` at every MoE layer.
    """

    def __init__(
        self, num_tokens: int, logprobs_from: int, forced_experts: np.ndarray | None = None
    ) -> None:
        self.logprobs_from = logprobs_from
        self.forced_experts = forced_experts
        self.logprobs = np.full(num_tokens, np.nan, dtype=np.float32)  # filled as steps end

    def cache_salt(self, start: int, stop: int) -> bytes:
        """What a prefix-cache block of tokens ``start:stop`` depends on beyond its tokens:
        the experts forced on them (KV computed under other experts is another KV)."""
        if self.forced_experts is None:
            return b""
        return np.ascontiguousarray(self.forced_experts[start:stop]).tobytes()


class Request:
    """One prompt moving through the engine (one sample of it, when ``n`` > 1).

    ``request_id`` is unique in the engine; a sample of a prompt sampled ``n``
    times also knows the prompt's id (``parent_id``) and its ``sample_index``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        index: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        sample_index: int = 0,
        parent_id: str | None = None,
        stop_strings: StopStringMatcher | None = None,
        scoring: Scoring | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.parent_id = request_id if parent_id is None else parent_id
        self.sample_index = sample_index
        self.index = index
        self.sampling = sampling
        self.stop_strings = stop_strings
        # vLLM's stop_reason: the stop token id (not EOS) or stop string that ended it.
        self.stop_reason: int | str | None = None
        self.logprobs = LogprobColumns(sampling.logprobs or 0)  # filled when it asked for them
        self.eos_token_ids = () if sampling.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = frozenset(sampling.stop_token_ids) | frozenset(self.eos_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still on the device: scheduled, not yet known on the host.
        self.num_placeholders = 0
        self.num_cached_tokens = (
            -1
        )  # prompt tokens served by the prefix cache, set on first schedule
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.status = RequestStatus.WAITING
        self.scoring = scoring
        # Monotonic times for the server's latency metrics (any process reads the same clock).
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.extra: dict = {}  # what the caller attaches; the finished record carries it
        # vLLM's cache_salt: prefix-cache hits only between requests with the same salt.
        self.cache_salt = cache_salt
        # [version, start, end): the output tokens each weight version sampled (vLLM's spans).
        self.weight_versions: list[list] = []

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens to run before it ends or samples: all but a scoring request's last."""
        return self.num_tokens - 1 if self.scoring is not None else self.num_tokens

    @property
    def num_cacheable_tokens(self) -> int:
        """The most leading tokens a prefix-cache hit may serve.

        At least one token must run (its logits sample the next one); a scoring
        request must also compute every position whose logits give a wanted
        log-probability.
        """
        if self.scoring is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 2, self.scoring.logprobs_from - 1)

    def cache_key(self, start: int, stop: int) -> tuple:
        """What decides whether a cached block holds tokens ``start:stop`` of this request."""
        tokens = tuple(self.token_ids[start:stop])
        key = tokens if self.scoring is None else (tokens, self.scoring.cache_salt(start, stop))
        if self.cache_salt is not None and start == 0:  # the first block's hash salts the chain
            key = (key, self.cache_salt)
        return key

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens including those still being sampled on the device."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def awaiting_last_token(self) -> bool:
        """Its final token is already being sampled: nothing more to schedule."""
        return self.num_output_tokens + self.num_placeholders >= self.sampling.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(
        self, token_id: int, logprobs: StepLogprobs | None = None, version: str | None = None
    ) -> None:
        """Add a sampled token; with its log-probabilities when the step has them for this
        request, and the weight version that sampled it."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)
        if version is not None:
            index = self.num_output_tokens - 1
            last = self.weight_versions[-1] if self.weight_versions else None
            if last is not None and last[0] == version and last[2] == index:
                last[2] = index + 1
            else:
                self.weight_versions.append([version, index, index + 1])
        if logprobs is not None:
            row = logprobs.rows.get(self.request_id)
            if row is not None:
                self.logprobs.append(logprobs, row)

    def check_stop(self) -> bool:
        """Mark the request finished if its last token ends it (vLLM's rules and order).

        Before ``min_tokens`` output tokens nothing but the length ends it;
        then a stop token (EOS or ``stop_token_ids``), a stop string completed
        by this token, and ``max_tokens``, in that order.
        """
        n = self.num_output_tokens
        if n == 0:
            return False
        last = self.token_ids[-1]
        stop_token = n >= self.sampling.min_tokens and last in self.stop_token_ids
        matched = None
        if self.stop_strings is not None:
            matched = self.stop_strings.update(last, ends_request=stop_token)
        if stop_token:
            self.status = RequestStatus.FINISHED_STOPPED
            if last not in self.eos_token_ids:
                self.stop_reason = last
        elif matched is not None:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = matched
        elif n >= self.sampling.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished

    @property
    def output_text(self) -> str | None:
        """The detokenized output, cut at a stop string (only kept with stop strings)."""
        return None if self.stop_strings is None else self.stop_strings.text

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
