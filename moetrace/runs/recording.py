"""One recording: prompts in, a trace file out.

Kept apart from the CLI so that Python callers (and tests) run exactly what
``moetrace record`` runs.  Prompt files are checked in full (JSON, fields,
tokenization, lengths, KV cache room) before anything is written, so a typo on
line 80,000 costs a second, not hours.  Standard input is a stream: a bad line
there stops intake, the requests in flight finish into the file, and the
error is raised after the file is closed.

Whatever ends a run early (input error, signal, disk full, a bug), every
request that finished is in the file and the file is closed with ``complete``
false and an ``end_reason``; ``resume=True`` continues such a file and skips
the ids it holds (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import moetrace
from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine, RequestRejected, request_problem
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import CapacityError, InputError, ModelError, MoetraceError
from moetrace.inputs.intake import Intake
from moetrace.inputs.prompts import CHAT_URL, STDIN, PromptSpec, iter_prompts, line_limit
from moetrace.inputs.shards import select_shard, shard_settings
from moetrace.models.demo import model_dir
from moetrace.models.fingerprint import weights_digest
from moetrace.models.loader import config_digest, read_config, resolve_dtype
from moetrace.models.registry import resolve_architecture
from moetrace.output_files import check_new_output, check_not_an_input, model_inputs
from moetrace.runs.preflight import MemoryAsk, preflight
from moetrace.runs.setup import (
    load_engine,
    load_tokenizer,
    model_context_length,
    model_metadata,
    model_source,
    resolve_device,
)
from moetrace.signals import GracefulStop, Interrupted, on_signal_exit, signal_name
from moetrace.trace.lock import TraceLock
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.resume import ResumePoint, check_settings, open_resume_point, result_settings
from moetrace.trace.writer import TraceWriter

MOETRACE_SOURCE = "moetrace's default"
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
            parts.append(f"{', '.join(shown[k] for k in own)} ({MOETRACE_SOURCE})")
        return "sampling defaults: " + "; ".join(parts)


@dataclass
class RecordResult:
    path: Path
    requests: int = 0  # finished and handed to the writer in this run
    rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    skipped: list[InputError] = field(default_factory=list)
    kept: int = 0  # requests already in the trace (resume)
    dropped_in_flight: int = 0  # unfinished when the run stopped early; a resume redoes them
    startup: dict[str, float] = field(default_factory=dict)  # seconds by phase, before step 1
    kernel_variants: int = 0
    late_compiles: int = 0  # kernel variants compiled one by one during start-up
    # As steps complete, from the engine (requests still running included): for throughput.
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (not cache hits)
    tokens_generated: int = 0


def _input_error_dict(err: InputError) -> dict:
    return {"source": err.source, "line": err.line, "field": err.field, "problem": err.problem}


ProgressCallback = Callable[[RecordResult, int | None], None]
_WAIT_SLICE_S = 0.1  # an idle loop waiting for standard input looks at the stop flag this often


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


class Recording:
    """Everything one ``record`` run needs, opened in the order that fails fastest."""

    def __init__(
        self,
        model: str,
        prompts: str,
        output: str | Path,
        *,
        engine: EngineConfig,
        sampling: SamplingDefaults,
        device: str = "auto",
        dtype: str = "auto",
        load_format: str = "auto",
        overwrite: bool = False,
        skip_invalid: bool = False,
        resume: bool = False,
        flush_interval_s: float = 5.0,
        flush_every_requests: int = 64,
        num_shards: int = 1,
        shard_index: int = 0,
        extra_settings: dict | None = None,
        tokenizer: str | None = None,
        ignore_unknown_fields: bool = False,
    ) -> None:
        engine.validate()
        if resume and overwrite:
            raise MoetraceError("--resume and --overwrite exclude each other")
        if not 0 < flush_interval_s < math.inf or flush_every_requests < 1:
            raise MoetraceError("--flush-interval must be > 0 and --flush-every at least 1")
        self.model_name = model
        self.engine_config = engine
        self.sampling = sampling
        self.output = Path(output)
        self.device = resolve_device(device)
        self.dtype = dtype
        self.load_format = load_format
        self.overwrite = overwrite
        self.skip_invalid = skip_invalid
        self.flush_interval_s = flush_interval_s
        self.flush_every_requests = flush_every_requests
        # Data-parallel shard (moetrace/inputs/shards.py) and settings recorded beside the
        # engine's (tensor parallelism, shard): kept in the trace, not compared on --resume.
        self.num_shards = num_shards
        self.extra_settings = dict(extra_settings or {})
        if num_shards > 1:
            self.extra_settings.update(shard_settings(num_shards, shard_index))
        self.resume = resume and self.output.exists()
        self._lock: TraceLock | None = None
        self._check_output(prompts, model)
        prompt_reader = iter_prompts(
            prompts, skip_invalid=skip_invalid, ignore_unknown_fields=ignore_unknown_fields
        )
        self.prompt_reader = prompt_reader
        self.reader = select_shard(prompt_reader, num_shards, shard_index)
        self.source = self.reader.source
        self.streaming = prompts == STDIN
        self.config = read_config(model_dir(model))
        resolve_architecture(self.config, model)
        self._preflight()
        self.tokenizer = load_tokenizer(model, tokenizer)
        self.tokenizer_name = tokenizer
        self.extra_settings.update(model_source(model))
        self.max_model_len = model_context_length(model, self.config, engine.max_model_len)
        prompt_reader.max_line_bytes = line_limit(self.max_model_len)
        self.resume_point: ResumePoint | None = None
        self._largest = _Largest()
        self.logprobs_not_kept = 0  # streamed lines that asked for logprobs the trace cannot keep
        self.total: int | None = None  # requests this run will record, when known
        self.expected_requests: int | None = None  # valid requests in the input, when known
        # From here this run owns the output: a second run on it is refused (trace/lock.py).
        self._lock = TraceLock(self.output).acquire()
        self._forget_lock = on_signal_exit(self._lock.release)
        try:
            if self.resume:
                self.resume_point = open_resume_point(self.output, self._expected_settings())
            if not self.streaming:
                self.total = self._prevalidate()
        except BaseException:
            self.release_output()
            raise

    def release_output(self) -> None:
        """Let another run write the output (after ``run``, or for a run that never starts)."""
        if getattr(self, "_lock", None) is not None:  # (__del__ of a half-built Recording)
            self._forget_lock()
            self._lock.release()
            self._lock = None

    def __del__(self) -> None:
        self.release_output()

    def _preflight(self) -> None:
        """The model built on ``meta`` against the weights' headers and the device's memory."""
        engine = self.engine_config
        preflight(
            self.config,
            model_dir(self.model_name),
            self.model_name,
            dtype=resolve_dtype(self.dtype, self.config, self.device),
            device=self.device,
            load_format=self._effective_load_format(),
            ask=MemoryAsk(engine.num_kv_blocks, engine.block_size, engine.max_num_batched_tokens),
            whole_model_on_device=int(self.extra_settings.get("tensor_parallel_size", 1)) <= 1,
        )

    def _check_output(self, prompts: str, model: str) -> None:
        inputs = [*model_inputs(model_dir(model))]
        inputs.append(("the prompt file", 0) if prompts == STDIN else ("the prompt file", prompts))
        check_not_an_input(self.output, inputs)
        check_new_output(self.output, overwrite=self.overwrite or self.resume, resume=True)

    def _expected_settings(self) -> dict:
        """What this run will record with, known before the weights load (for --resume)."""
        config = self.config
        dtype = resolve_dtype(self.dtype, config, self.device)
        return result_settings(
            config_digest(config),
            str(dtype).removeprefix("torch."),
            self._engine_settings(self.max_model_len, None),
        )

    @functools.cached_property
    def weights_digest(self) -> str:
        """Computed when first needed, so that config errors are reported before weight ones."""
        return weights_digest(model_dir(self.model_name), self._effective_load_format())

    def _effective_load_format(self) -> str:
        """auto and safetensors load the same weights; only dummy differs."""
        return "dummy" if self.load_format == "dummy" else "safetensors"

    def _engine_settings(self, max_model_len: int, num_kv_blocks: int | None) -> dict:
        return {
            **self.engine_config.to_dict(),
            "device": self.device.type,
            "load_format": self._effective_load_format(),
            "weights_digest": self.weights_digest,
            "sampling_defaults": self.sampling.__dict__,
            **({"tokenizer": self.tokenizer_name} if self.tokenizer_name else {}),
            "max_model_len": max_model_len,
            "num_kv_blocks": num_kv_blocks,
            **self.extra_settings,
        }

    def _check_spec(self, spec: PromptSpec) -> tuple[list[int], SamplingParams]:
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
        problem = request_problem(ids, params.max_tokens, self._vocab_size(), self.max_model_len)
        if problem is not None:
            raise InputError(self.source, spec.line, *problem)
        need = n + params.max_tokens - 1  # KV slots: the last sampled token is never run
        if need > self._largest.tokens:
            self._largest = _Largest(need, spec.id, f"{self.source}:{spec.line}")
        return ids, params

    def _vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def _samples_to_record(self, spec: PromptSpec, ids: list[int], n: int) -> list[int]:
        """The samples of the request this run records: all, less those a resumed trace holds."""
        point = self.resume_point
        held = (
            set()
            if point is None
            else point.check_prompt(spec.id, ids, f"{self.source}:{spec.line}")
        )
        return [i for i in range(n) if i not in held]

    def _prevalidate(self) -> int:
        """Check every line; returns how many requests this run has to record."""
        valid = todo = 0
        seen: set[str] = set()
        wants_logprobs = False
        for spec in self.reader:
            try:
                ids, params = self._check_spec(spec)
            except InputError as err:
                if not self.skip_invalid:
                    raise
                self.reader.errors.append(err)
                continue
            valid += params.n
            seen.add(spec.id)
            todo += len(self._samples_to_record(spec, ids, params.n))
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
                    f"cannot resume {self.output}: it holds request {stray!r}, which {self.source} "
                    "does not (resume with the same prompts)"
                )
        self.expected_requests = valid
        return todo

    def _specs(
        self, errors: list[InputError]
    ) -> Iterator[tuple[PromptSpec, list[int], SamplingParams, list[int]]]:
        """Valid prompts not yet recorded, with the samples to record; bad ones go to
        ``errors`` with skip_invalid."""
        valid = 0
        for spec in self.reader:
            try:
                ids, params = self._check_spec(spec)
            except InputError as err:
                if not self.skip_invalid:
                    raise
                errors.append(err)
                continue
            valid += 1
            if params.logprobs is not None and not self.sampling.logprobs:
                self.logprobs_not_kept += 1  # standard input: the trace was made without them
            samples = self._samples_to_record(spec, ids, params.n)
            if samples:
                yield spec, ids, params, samples
        errors.extend(e for e in self.reader.errors if e not in errors)
        if valid == 0 and self.num_shards == 1:  # a shard of a short input may hold nothing
            raise self._nothing_valid(errors)

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

    def _check_kv_capacity(self, engine: LLMEngine) -> None:
        """A request that can never fit would stop the run midway: refuse it before any work."""
        largest = self._largest
        bs = engine.config.block_size
        blocks = engine.block_manager.num_blocks
        if largest.tokens and -(-largest.tokens // bs) > blocks:
            raise CapacityError(
                f"KV cache too small: {blocks} blocks of {bs} tokens hold {blocks * bs} tokens, "
                f"request {largest.request_id!r} ({largest.where}) needs {largest.tokens} "
                "(prompt + max_tokens - 1); raise --num-kv-blocks or lower --max-tokens"
            )

    def metadata(self, engine: LLMEngine, architecture: str, digest: str) -> TraceMetadata:
        settings = self._engine_settings(engine.max_model_len, engine.block_manager.num_blocks)
        return model_metadata(
            self.model_name,
            engine,
            architecture,
            digest,
            self.tokenizer,
            settings,
            logprobs=self.sampling.logprobs,
        )

    def _writer(self, metadata: TraceMetadata) -> TraceWriter:
        point = self.resume_point
        if point is not None:  # the loaded model, not only the arguments, must match
            actual = result_settings(
                metadata.config_digest, metadata.dtype, metadata.engine_settings
            )
            check_settings(self.output, point.settings, actual)
        return TraceWriter(
            self.output,
            metadata,
            lock=self._lock,
            overwrite=self.overwrite,
            append=point is not None,
            keep_requests=None if point is None else point.keep_requests,
            expected_requests=self.expected_requests,
            flush_interval_s=self.flush_interval_s,
            flush_every_requests=self.flush_every_requests,
        )

    def _skipped_inputs(self, errors: list[InputError]) -> list[dict]:
        """This run's skipped lines, merged with those a resumed trace already listed."""
        merged = {}
        earlier = self.resume_point.skipped_inputs if self.resume_point else []
        for item in [*earlier, *map(_input_error_dict, errors)]:
            merged[(item.get("source"), item.get("line"))] = item
        return sorted(merged.values(), key=lambda item: (str(item["source"]), item["line"] or 0))

    def run(
        self, progress: ProgressCallback | None = None, stop: GracefulStop | None = None
    ) -> RecordResult:
        """Record every prompt; ``stop`` (armed once the file is open) ends the run early."""
        if self._lock is None:
            raise RuntimeError("a Recording runs once")
        try:
            return self._run(progress, stop)
        finally:
            self.release_output()

    def _run(self, progress: ProgressCallback | None, stop: GracefulStop | None) -> RecordResult:
        startup = {"set-up": time.perf_counter() - moetrace.STARTED}
        with _out_of_memory_is_one_line(self.device):
            ready = load_engine(self)
        startup["weights"] = ready.weights_s
        loaded, engine = ready.loaded, ready.engine
        self._check_kv_capacity(engine)
        architecture = loaded.model.architecture
        writer = self._writer(self.metadata(engine, architecture, loaded.config_digest))
        result = RecordResult(self.output)
        result.startup = {**startup, **engine.startup.seconds}
        result.kernel_variants = engine.startup.kernel_variants
        result.late_compiles = len(engine.startup.late_compiles)
        window = max(2 * self.engine_config.max_num_seqs, 64)
        errors: list[InputError] = []
        intake = Intake(self._specs(errors), threaded=self.streaming, read_ahead=window)
        # Standard input: no file before its first valid prompt, so an empty or all-bad
        # stream leaves nothing behind, as an empty or all-bad prompt file does.
        first = self._first_streamed(intake) if self.streaming else None
        pending_error: BaseException | None = None
        interrupted: int | None = None
        exhausted = False
        start = time.perf_counter()
        stop = stop or GracefulStop()  # never installed: only polled
        stop.arm()  # from here a signal ends the loop and the file is closed cleanly
        writer.start()
        result.kept = writer.kept_requests
        complete = False
        end_reason = "error"
        try:
            if first is not None:
                error = self._admit(engine, first, errors)
                exhausted, pending_error = error is not None, error
            while not stop.requested:
                if not exhausted:
                    exhausted, pending_error = self._feed(engine, intake, stop, window, errors)
                if not engine.has_unfinished():
                    if exhausted:
                        break
                    continue
                for finished in engine.step():
                    writer.submit(finished)
                    _count(result, finished)
                if progress is not None:
                    result.elapsed_s = time.perf_counter() - start
                    result.prompt_tokens_computed = engine.stats.prompt_tokens
                    result.tokens_generated = engine.stats.output_tokens
                    progress(result, self.total)
            # A signal that came before this point marks the file incomplete, even if the
            # input ended meanwhile: the run stopped on request, and --resume completes it.
            interrupted = stop.signum
            complete = pending_error is None and interrupted is None
            if interrupted is not None:
                end_reason = f"interrupted by {signal_name(interrupted)}"
            elif pending_error is not None:
                end_reason = f"input error: {pending_error}"
            else:
                end_reason = "complete"
        except BaseException as exc:
            end_reason = f"error: {_one_line(exc)}"
            raise
        finally:
            result.elapsed_s = time.perf_counter() - start
            result.skipped = sorted(errors, key=lambda err: err.line or 0)
            result.dropped_in_flight = engine.num_unfinished
            writer.close(
                complete=complete,
                end_reason=end_reason,
                skipped_inputs=self._skipped_inputs(errors),
            )
        if interrupted is not None:
            raise Interrupted(interrupted, self._interrupted_message(interrupted, result, writer))
        if pending_error is not None:
            raise pending_error
        return result

    def _feed(
        self,
        engine: LLMEngine,
        intake: Intake,
        stop: GracefulStop,
        window: int,
        errors: list[InputError],
    ) -> tuple[bool, BaseException | None]:
        """Add what is ready, up to ``window`` requests in the engine; waits only if it is idle.

        Returns (intake ended, the error that ended it).  While it waits it
        looks at the stop flag every ``_WAIT_SLICE_S``: a signal handler only
        sets the flag, so a stop while waiting returns within that slice.
        """
        while engine.num_unfinished < window:
            idle = not engine.has_unfinished()
            try:
                item = intake.take(_WAIT_SLICE_S if idle else 0.0)
            except StopIteration:
                return True, None
            except InputError as err:  # streaming input: stop intake, keep what runs
                return True, err
            if item is None:
                if idle and not stop.requested:
                    continue
                return False, None
            error = self._admit(engine, item, errors)
            if error is not None:
                return True, error
        return False, None

    def _admit(self, engine: LLMEngine, item: tuple, errors: list[InputError]) -> Exception | None:
        """Queue one prompt's samples; returns the error that ends the intake, if any."""
        spec, ids, params, samples = item
        try:
            engine.add_request(
                spec.id, ids, params, index=spec.index, samples=samples, extra=_route(spec)
            )
        except RequestRejected as err:
            bad = InputError(self.source, spec.line, err.field, err.problem)
            if not self.skip_invalid:
                return bad
            errors.append(bad)
        except CapacityError as err:
            return CapacityError(f"{self.source}:{spec.line}: {err}")
        return None

    def _first_streamed(self, intake: Intake) -> tuple | None:
        """The first valid prompt of standard input (None: it ended without any, sharded away).

        An input with no valid prompt raises its ``InputError`` here, before the
        trace file exists.
        """
        while True:
            try:
                item = intake.take(_WAIT_SLICE_S)
            except StopIteration:
                return None
            if item is not None:
                return item

    def _interrupted_message(self, signum: int, result: RecordResult, writer: TraceWriter) -> str:
        held = writer.flushed_requests
        kept = f", {result.kept} from before" if result.kept else ""
        return (
            f"interrupted by {signal_name(signum)}: {self.output} holds {held} finished requests "
            f"({result.requests} from this run{kept}); {result.dropped_in_flight} in flight were "
            "dropped; marked incomplete, rerun with --resume to finish"
        )


def _route(spec: PromptSpec) -> dict:
    """What a record keeps of how the request was asked: a chat names the chat route, so
    that ``export --format openai-batch`` answers it as vLLM's run-batch would."""
    return {"url": CHAT_URL} if spec.messages is not None else {}


@contextlib.contextmanager
def _out_of_memory_is_one_line(device: torch.device) -> Iterator[None]:
    """Loading and setting up within the memory the preflight counted can still fail
    (activations, other processes): one line that names the options, not a traceback."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        oom = not isinstance(exc, RuntimeError) or "can't allocate memory" in str(exc)
        if not oom or isinstance(exc, MoetraceError):
            raise
        raise CapacityError(
            f"out of {device.type} memory loading the model and setting up the engine "
            f"({_one_line(exc)[:160]}); lower --max-num-batched-tokens, --max-num-seqs, "
            "--num-kv-blocks or --gpu-memory-utilization"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _count(result: RecordResult, finished) -> None:
    result.requests += 1
    result.rows += finished.num_rows
    result.prompt_tokens += finished.prompt_len
    result.output_tokens += finished.output_len
    result.finish_reasons[finished.finish_reason] = (
        result.finish_reasons.get(finished.finish_reason, 0) + 1
    )
