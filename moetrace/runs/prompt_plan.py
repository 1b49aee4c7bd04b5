"""The prompts of a recording: each line checked, tokenized and sized before it runs.

A prompt file is checked in full (``PromptPlan.count``) before anything is
written, so a typo on line 80,000 costs a second, not hours; standard input
is checked line by line as it streams (``PromptPlan.specs``).  The sampling
settings a line does not give come from ``SamplingDefaults``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from moetrace.engine.llm_engine import request_problem
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import CapacityError, InputError, ModelError, MoetraceError
from moetrace.inputs.prompts import PromptSpec
from moetrace.inputs.shards import ShardedPrompts
from moetrace.inputs.tokenizer import Tokenizer
from moetrace.trace.resume import ResumePoint

DEFAULT_SOURCE = "moetrace's default"
CLI_SOURCE = "command line"


@dataclass
class SamplingDefaults:
    """The sampling settings of a prompt line that gives none of its own.

    Each comes from the command line if given there, else from the model's
    generation config (vLLM's ``--generation-config``), else it is
    moetrace's own (greedy, 16 tokens); ``sources`` says which, per setting
    not moetrace's.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # every request returns its output tokens' log-probabilities
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        given: dict[str, Any],
        generation: dict[str, Any] | None = None,
        generation_source: str | None = None,
        **fixed: Any,
    ) -> SamplingDefaults:
        """Command-line values (None: not given) over the generation config's over moetrace's."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for key, value in (generation or {}).items():
            values[key], sources[key] = value, generation_source or "generation config"
        for key, value in given.items():
            if value is not None:
                values[key], sources[key] = value, CLI_SOURCE
        return cls(**values, **fixed, sources=sources)

    def settings(self) -> dict[str, Any]:
        """The defaults as SamplingParams takes them (without their sources)."""
        values = {k: v for k, v in self.__dict__.items() if k != "sources"}
        values["stop_token_ids"] = list(self.stop_token_ids)
        values["logprobs"] = 0 if self.logprobs else None
        return values

    def for_prompt(self, spec: PromptSpec) -> SamplingParams:
        values = self.settings()
        values.update(spec.sampling)
        return SamplingParams(**values)

    def describe(self) -> str:
        """One line: which defaults applied and where each came from."""
        by_source: dict[str, list[str]] = {}
        for key, source in self.sources.items():
            by_source.setdefault(source, []).append(f"{key} {getattr(self, key)}")
        parts = [f"{', '.join(items)} ({source})" for source, items in by_source.items()]
        own = [k for k in ("max_tokens", "temperature") if k not in self.sources]
        if own:
            shown = {"max_tokens": f"max_tokens {self.max_tokens}", "temperature": "greedy"}
            parts.append(f"{', '.join(shown[k] for k in own)} ({DEFAULT_SOURCE})")
        return "sampling defaults: " + "; ".join(parts)


def prompt_token_ids(spec: PromptSpec, tokenizer, source: str) -> list[int]:
    """The prompt's ids as vLLM makes them.

    A text prompt gets the tokenizer's special tokens (its post-processor's
    BOS, say) unless the line says ``add_special_tokens: false``; a chat is
    rendered by the chat template (with the line's ``chat_template_kwargs``)
    and encoded without them unless the line says otherwise.
    """
    if spec.token_ids is not None:
        return list(spec.token_ids)
    if tokenizer is None:
        field_name = "prompt" if spec.text is not None else "messages"
        raise InputError(
            source, spec.line, field_name, "the model has no tokenizer.json; give prompt_token_ids"
        )
    encoding = spec.encoding
    if spec.messages is not None:
        variables = dict(encoding.get("chat_template_kwargs") or {})
        if "add_generation_prompt" in encoding:
            variables["add_generation_prompt"] = encoding["add_generation_prompt"]
        try:
            return tokenizer.apply_chat_template(
                spec.messages,
                add_special_tokens=encoding.get("add_special_tokens", False),
                **variables,
            )
        except ModelError as exc:
            raise InputError(source, spec.line, "messages", str(exc)) from None
        except TypeError as exc:  # a chat_template_kwargs key the template call cannot take
            raise InputError(source, spec.line, "chat_template_kwargs", str(exc)) from None
    return tokenizer.encode(
        spec.text or "", add_special_tokens=encoding.get("add_special_tokens", True)
    )


@dataclass
class _Largest:
    """The request that needs the most KV cache, to refuse a too-small cache before any work."""

    tokens: int = 0
    request_id: str = ""
    where: str = ""


class PromptPlan:
    """Valid prompts not yet recorded, with their ids, sampling and the samples to record."""

    def __init__(
        self,
        reader: ShardedPrompts,
        *,
        tokenizer: Tokenizer | None,
        sampling: SamplingDefaults,
        vocab_size: int,
        max_model_len: int,
        skip_invalid: bool = False,
        num_shards: int = 1,
    ) -> None:
        self.reader = reader
        self.source = reader.source
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.skip_invalid = skip_invalid
        self.num_shards = num_shards
        self.resume_point: ResumePoint | None = None  # set by a resumed recording
        self.largest = _Largest()
        self.logprobs_not_kept = 0  # streamed lines that asked for logprobs the trace cannot keep
        self.expected_requests: int | None = None  # valid requests in the input, when known

    def check(self, spec: PromptSpec) -> tuple[list[int], SamplingParams]:
        """The line's prompt ids and sampling, or the ``InputError`` that names its problem."""
        ids = prompt_token_ids(spec, self.tokenizer, self.source)
        try:
            params = self.sampling.for_prompt(spec)
        except ValueError as exc:
            raise InputError(self.source, spec.line, None, str(exc)) from None
        if params.stop and self.tokenizer is None:
            raise InputError(
                self.source, spec.line, "stop", "stop strings need the model's tokenizer.json"
            )
        n = len(ids)
        if n == 0:
            raise InputError(self.source, spec.line, "prompt", "empty after tokenization")
        problem = request_problem(ids, params.max_tokens, self.vocab_size, self.max_model_len)
        if problem is not None:
            raise InputError(self.source, spec.line, *problem)
        need = n + params.max_tokens - 1  # KV slots: the last sampled token is never run
        if need > self.largest.tokens:
            self.largest = _Largest(need, spec.id, f"{self.source}:{spec.line}")
        return ids, params

    def samples_to_record(self, spec: PromptSpec, ids: list[int], n: int) -> list[int]:
        """The samples of the request this run records: all, less those a resumed trace holds."""
        point = self.resume_point
        held = (
            set()
            if point is None
            else point.check_prompt(spec.id, ids, f"{self.source}:{spec.line}")
        )
        return [i for i in range(n) if i not in held]

    def count(self, output: object) -> int:
        """Check every line; returns how many requests the run has to record (``output``
        names the trace in a resume's error)."""
        valid = todo = 0
        seen: set[str] = set()
        wants_logprobs = False
        for spec, ids, params in self._checked(None):
            valid += params.n
            seen.add(spec.id)
            todo += len(self.samples_to_record(spec, ids, params.n))
            wants_logprobs = wants_logprobs or params.logprobs is not None
        if wants_logprobs and not self.sampling.logprobs:
            # A line asks for log-probabilities: the trace keeps every request's (its
            # sampled tokens'), as --logprobs would, rather than dropping the line's.
            self.sampling.logprobs = True
            self.sampling.sources["logprobs"] = "a prompt line's logprobs"
        if valid == 0 and self.num_shards == 1:  # a shard of a short input may hold nothing
            raise self._nothing_valid(self.reader.errors)
        point = self.resume_point
        if point is not None:
            stray = next((rid for rid in point.prompts if rid not in seen), None)
            if stray is not None:
                raise MoetraceError(
                    f"cannot resume {output}: it holds request {stray!r}, which {self.source} "
                    "does not (resume with the same prompts)"
                )
        self.expected_requests = valid
        return todo

    def specs(
        self, errors: list[InputError]
    ) -> Iterator[tuple[PromptSpec, list[int], SamplingParams, list[int]]]:
        """Valid prompts not yet recorded, with the samples to record; bad ones go to
        ``errors`` with skip_invalid."""
        valid = 0
        for spec, ids, params in self._checked(errors):
            valid += 1
            if params.logprobs is not None and not self.sampling.logprobs:
                self.logprobs_not_kept += 1  # standard input: the trace was made without them
            samples = self.samples_to_record(spec, ids, params.n)
            if samples:
                yield spec, ids, params, samples
        errors.extend(e for e in self.reader.errors if e not in errors)
        if valid == 0 and self.num_shards == 1:  # a shard of a short input may hold nothing
            raise self._nothing_valid(errors)

    def _checked(
        self, errors: list[InputError] | None
    ) -> Iterator[tuple[PromptSpec, list[int], SamplingParams]]:
        """Each valid line with its ids and sampling; with skip_invalid, a bad line goes to
        ``errors`` (None: the reader's own list, which each pass starts anew) and the next
        is read (without, its error is raised)."""
        for spec in self.reader:
            try:
                ids, params = self.check(spec)
            except InputError as err:
                if not self.skip_invalid:
                    raise
                (self.reader.errors if errors is None else errors).append(err)
                continue
            yield spec, ids, params

    def _nothing_valid(self, errors: list[InputError]) -> InputError:
        """Every line was skipped: as the parser says when none parses, a run has nothing to do."""
        first = min(errors, key=lambda err: err.line or 0)
        n = len(errors)
        return InputError(
            self.source,
            None,
            None,
            f"contains no valid prompts ({n} invalid line{'s' if n != 1 else ''} skipped; "
            f"first: {first})",
        )

    def check_kv_capacity(self, num_blocks: int, block_size: int) -> None:
        """A request that can never fit would stop the run midway: refuse it before any work."""
        largest = self.largest
        if largest.tokens and -(-largest.tokens // block_size) > num_blocks:
            raise CapacityError(
                f"KV cache too small: {num_blocks} blocks of {block_size} tokens hold "
                f"{num_blocks * block_size} tokens, request {largest.request_id!r} "
                f"({largest.where}) needs {largest.tokens} (prompt + max_tokens - 1); raise "
                "--num-kv-blocks or lower --max-tokens"
            )
