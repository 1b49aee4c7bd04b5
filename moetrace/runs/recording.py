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

import torch

import moetrace
from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.errors import CapacityError, InputError, MoetraceError
from moetrace.inputs.intake import Intake
from moetrace.inputs.prompts import CHAT_URL, STDIN, PromptSpec, iter_prompts, line_limit
from moetrace.inputs.shards import select_shard, shard_settings
from moetrace.models.fingerprint import weights_digest
from moetrace.models.loader import resolve_dtype
from moetrace.output_files import check_new_output, check_not_an_input, model_inputs
from moetrace.runs.preflight import MemoryAsk, preflight
from moetrace.runs.prompt_plan import PromptPlan, SamplingDefaults
from moetrace.runs.setup import (
    RunOptions,
    load_engine,
    load_tokenizer,
    model_metadata,
    resolve_device,
)
from moetrace.signals import GracefulStop, Interrupted, on_signal_exit, signal_name
from moetrace.trace.lock import TraceLock
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.resume import ResumePoint, check_settings, open_resume_point, result_settings
from moetrace.trace.writer import TraceWriter


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


class Recording:
    """Everything one ``record`` run needs, opened in the order that fails fastest."""

    def __init__(
        self,
        run: RunOptions,
        prompts: str,
        output: str | Path,
        *,
        sampling: SamplingDefaults,
        overwrite: bool = False,
        skip_invalid: bool = False,
        resume: bool = False,
        flush_interval_s: float = 5.0,
        flush_every_requests: int = 64,
        num_shards: int = 1,
        shard_index: int = 0,
        ignore_unknown_fields: bool = False,
    ) -> None:
        run.engine.validate()
        if resume and overwrite:
            raise MoetraceError("--resume and --overwrite exclude each other")
        if not 0 < flush_interval_s < math.inf or flush_every_requests < 1:
            raise MoetraceError("--flush-interval must be > 0 and --flush-every at least 1")
        self.model = run.model
        self.engine_config = run.engine
        self.sampling = sampling
        self.output = Path(output)
        self.device = resolve_device(run.device)
        self.dtype = run.dtype
        self.load_format = run.load_format
        self.overwrite = overwrite
        self.flush_interval_s = flush_interval_s
        self.flush_every_requests = flush_every_requests
        # Settings recorded beside the engine's (tensor parallelism, data-parallel shard,
        # the cache's commit): kept in the trace, not compared on --resume.
        self.extra_settings = {**run.extra_settings, **run.model.provenance()}
        if num_shards > 1:
            self.extra_settings.update(shard_settings(num_shards, shard_index))
        self.resume = resume and self.output.exists()
        self._lock: TraceLock | None = None
        self._check_output(prompts)
        self.prompt_reader = iter_prompts(
            prompts, skip_invalid=skip_invalid, ignore_unknown_fields=ignore_unknown_fields
        )
        self.streaming = prompts == STDIN
        self._preflight()
        self.tokenizer = load_tokenizer(run.model)
        self.max_model_len = run.model.context_length(run.engine.max_model_len)
        self.prompt_reader.max_line_bytes = line_limit(self.max_model_len)
        self.plan = PromptPlan(
            select_shard(self.prompt_reader, num_shards, shard_index),
            tokenizer=self.tokenizer,
            sampling=sampling,
            vocab_size=int(run.model.config["vocab_size"]),
            max_model_len=self.max_model_len,
            skip_invalid=skip_invalid,
            num_shards=num_shards,
        )
        self.source = self.plan.source
        self.total: int | None = None  # requests this run will record, when known
        # From here this run owns the output: a second run on it is refused (trace/lock.py).
        self._lock = TraceLock(self.output).acquire()
        self._forget_lock = on_signal_exit(self._lock.release)
        try:
            if self.resume:
                self.plan.resume_point = open_resume_point(self.output, self._expected_settings())
            if not self.streaming:
                self.total = self.plan.count(self.output)
        except BaseException:
            self.release_output()
            raise

    @property
    def resume_point(self) -> ResumePoint | None:
        return self.plan.resume_point

    @property
    def logprobs_not_kept(self) -> int:
        return self.plan.logprobs_not_kept

    @property
    def expected_requests(self) -> int | None:
        return self.plan.expected_requests

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
            self.model,
            dtype=resolve_dtype(self.dtype, self.model.config, self.device),
            device=self.device,
            load_format=self._effective_load_format(),
            ask=MemoryAsk(engine.num_kv_blocks, engine.block_size, engine.max_num_batched_tokens),
            whole_model_on_device=int(self.extra_settings.get("tensor_parallel_size", 1)) <= 1,
        )

    def _check_output(self, prompts: str) -> None:
        inputs = [*model_inputs(self.model.path)]
        inputs.append(("the prompt file", 0) if prompts == STDIN else ("the prompt file", prompts))
        check_not_an_input(self.output, inputs)
        check_new_output(self.output, overwrite=self.overwrite or self.resume, resume=True)

    def _expected_settings(self) -> dict:
        """What this run will record with, known before the weights load (for --resume)."""
        dtype = resolve_dtype(self.dtype, self.model.config, self.device)
        return result_settings(
            self.model.config_digest,
            str(dtype).removeprefix("torch."),
            self._engine_settings(self.max_model_len, None),
        )

    @functools.cached_property
    def weights_digest(self) -> str:
        """Computed when first needed, so that config errors are reported before weight ones."""
        return weights_digest(self.model.path, self._effective_load_format())

    def _effective_load_format(self) -> str:
        """auto and safetensors load the same weights; only dummy differs."""
        return "dummy" if self.load_format == "dummy" else "safetensors"

    def _engine_settings(self, max_model_len: int, num_kv_blocks: int | None) -> dict:
        tokenizer = self.model.tokenizer_name
        return {
            **self.engine_config.to_dict(),
            "device": self.device.type,
            "load_format": self._effective_load_format(),
            "weights_digest": self.weights_digest,
            "sampling_defaults": self.sampling.__dict__,
            **({"tokenizer": tokenizer} if tokenizer else {}),
            "max_model_len": max_model_len,
            "num_kv_blocks": num_kv_blocks,
            **self.extra_settings,
        }

    def metadata(self, engine: LLMEngine) -> TraceMetadata:
        settings = self._engine_settings(engine.max_model_len, engine.block_manager.num_blocks)
        return model_metadata(
            self.model,
            engine,
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
            expected_requests=self.plan.expected_requests,
            flush_interval_s=self.flush_interval_s,
            flush_every_requests=self.flush_every_requests,
        )

    def _skipped_inputs(self, errors: list[InputError]) -> list[dict]:
        """This run's skipped lines, merged with those a resumed trace already listed."""
        merged = {}
        point = self.resume_point
        earlier = point.skipped_inputs if point else []
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
        engine = ready.engine
        self.plan.check_kv_capacity(engine.block_manager.num_blocks, engine.config.block_size)
        writer = self._writer(self.metadata(engine))
        result = RecordResult(self.output)
        result.startup = {**startup, **engine.startup.seconds}
        result.kernel_variants = engine.startup.kernel_variants
        result.late_compiles = len(engine.startup.late_compiles)
        window = max(2 * self.engine_config.max_num_seqs, 64)
        errors: list[InputError] = []
        intake = Intake(self.plan.specs(errors), threaded=self.streaming, read_ahead=window)
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
            if not self.plan.skip_invalid:
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
