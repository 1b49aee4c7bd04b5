"""Per-request sampling settings, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's default --max-logprobs: more top log-probabilities than this per token are refused.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    ``temperature == 0`` is greedy.  ``top_k <= 0``, ``top_p == 1`` and
    ``min_p == 0`` switch those filters off.  ``seed`` makes a sampled request
    reproducible on its own, whatever else shares the batch.

    As in vLLM: ``stop`` strings end a request when its detokenized output
    contains one (the text is cut before it unless
    ``include_stop_str_in_output``); neither EOS, ``stop_token_ids`` nor stop
    strings can end it before ``min_tokens`` tokens.  Penalties follow vLLM
    (and OpenAI): ``repetition_penalty`` divides positive and multiplies
    negative logits of tokens seen in the prompt or output;
    ``frequency_penalty`` subtracts per occurrence in the output,
    ``presence_penalty`` once per token present in it.  ``n`` samples the
    prompt that many times (sample ``i`` with ``seed + i`` when a seed is
    given).  ``logprobs`` returns, per output token, the log-probability of
    the sampled token, its rank, and the ``logprobs`` most likely tokens, all
    from the model's raw distribution (before penalties and temperature).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # when detokenizing to match stop strings
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these settings, in vLLM's terms, or None."""
        checks = (
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.n >= 1, "n must be at least 1"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
        )
        return next((message for ok, message in checks if not ok), None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def for_sample(self, sample_index: int) -> SamplingParams:
        """The settings of sample ``sample_index`` of ``n``: vLLM gives each ``seed + index``."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + sample_index
        return replace(self, n=1, seed=seed)
