"""Per-request sampling settings, with vLLM's names, meanings and ranges.

``SAMPLING_RULES`` is the one statement of which values are allowed: the
prompt-line parser, the command line and ``SamplingParams`` itself all check
against it, so a value the line check refuses cannot slip in through an
option, and one the engine cannot hold (a seed past 64 bits, a ``top_k`` of
1e30, a NaN temperature) is refused before any work instead of ending the run
in an overflow traceback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# vLLM's default --max-logprobs: more top log-probabilities than this per token are refused.
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Rule:
    """What a setting accepts, in words (for the one-line error) and as a test."""

    expects: str
    accepts: Callable[[Any], bool]


def _int_rule(least: int, most: int, expects: str) -> Rule:
    return Rule(expects, lambda v: _is_int(v) and least <= v <= most)


def _number_rule(least: float, most: float, expects: str, *, open_low: bool = False) -> Rule:
    def accepts(v: Any) -> bool:
        return _is_finite(v) and (least < v if open_low else least <= v) and v <= most

    return Rule(expects, accepts)


SAMPLING_RULES: dict[str, Rule] = {
    "max_tokens": _int_rule(1, INT32_MAX, f"a positive integer (at most {INT32_MAX})"),
    "temperature": _number_rule(0, math.inf, "a finite number >= 0"),
    "top_p": _number_rule(0, 1, "a number in (0, 1]", open_low=True),
    # vLLM: 0 or -1 switch it off; a k beyond the vocabulary keeps every token.
    "top_k": _int_rule(
        -1, INT32_MAX, f"a positive integer (at most {INT32_MAX}; 0 or -1 to disable)"
    ),
    "min_p": _number_rule(0, 1, "a number in [0, 1]"),
    # What torch.Generator.manual_seed takes (so vLLM's offline SamplingParams too): any
    # 64-bit pattern, signed or not.  The sampler holds it as int64 (see SamplingParams).
    "seed": _int_rule(INT64_MIN, UINT64_MAX, "a 64-bit integer"),
    "min_tokens": _int_rule(0, INT32_MAX, f"an integer from 0 to {INT32_MAX}"),
    "presence_penalty": _number_rule(-2, 2, "a number in [-2, 2]"),
    "frequency_penalty": _number_rule(-2, 2, "a number in [-2, 2]"),
    "repetition_penalty": _number_rule(0, math.inf, "a finite number > 0", open_low=True),
    "n": _int_rule(1, INT32_MAX, f"a positive integer (at most {INT32_MAX})"),
    "logprobs": _int_rule(0, MAX_LOGPROBS, f"an integer from 0 to {MAX_LOGPROBS}"),
}
_OPTIONAL = ("seed", "logprobs")  # None: not given


def sampling_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not allowed for setting ``name`` ("expected ..."), or None."""
    rule = SAMPLING_RULES[name]
    return None if rule.accepts(value) else f"expected {rule.expects}"


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
        if self.seed is not None and self.seed > INT64_MAX:
            # The same 64 bits as a signed integer, as manual_seed reads a negative seed.
            self.seed -= 2**64

    def problem(self) -> str | None:
        """What is wrong with these settings (SAMPLING_RULES, then vLLM's joint rules), or None."""
        for name in SAMPLING_RULES:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            problem = sampling_problem(name, value)
            if problem is not None:
                return f"{name}: {problem}, got {value!r}"
        checks = (
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
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

    def recorded(self, seed: int) -> dict[str, Any]:
        """The settings as a trace stores them: JSON-able, with the seed the request used
        (``n`` left out: each sample is a record of its own)."""
        from dataclasses import asdict

        values = asdict(self)
        del values["n"]
        values["seed"] = seed
        return values

    def for_sample(self, sample_index: int) -> SamplingParams:
        """The settings of sample ``sample_index`` of ``n``: vLLM gives each ``seed + index``."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + sample_index
        return replace(self, n=1, seed=seed)
