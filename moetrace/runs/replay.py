"""One replay: every sequence of a trace teacher-forced through a model, into a new trace.

``moetrace replay TRACE MODEL -o NEW.h5`` answers R3's question before a
training run: the trace's tokens were sampled by one engine (dtype, device,
kernels); how do routing and log-probabilities come out under other settings
(another dtype, device, tensor-parallel size, checkpoint revision, or the
same)?  Each recorded request becomes a scoring request (``LLMEngine.
add_scoring_request``): its prompt and output run as one prefill, batched
and chunked like any other, prefix hits included, and nothing is sampled.
The new trace holds the same requests with the rows and log-probabilities
the model computed; the report is ``diff_traces`` of the two.

``force_routing`` routes every MoE layer through the recorded experts (the
model's own weights over them), as routing replay does in training, so the
report shows the log-probability shift that remains once routing agrees.

Rows of the new trace: one per token but the last, as a recording's.  An
aborted request whose trace holds fewer rows than that is replayed, when
forced, only as far as its rows go (its later log-probabilities stay NaN).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moetrace import __version__
from moetrace.analysis.diff import diff_traces
from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.errors import MoetraceError
from moetrace.output_files import check_new_output
from moetrace.runs.setup import (
    RunOptions,
    load_engine,
    load_tokenizer,
    model_metadata,
    resolve_device,
)
from moetrace.signals import GracefulStop, Interrupted, signal_name
from moetrace.trace.reader import TraceRequest, open_trace
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter

# What the replayed model must share with the trace for rows to be comparable.
ROUTING_SHAPE = ("moe_layer_indices", "num_experts", "top_k")


@dataclass
class ReplayResult:
    path: Path
    requests: int = 0
    rows: int = 0
    scored_tokens: int = 0
    elapsed_s: float = 0.0
    startup: dict[str, float] = field(default_factory=dict)
    report: dict = field(default_factory=dict)  # diff_traces(original, replayed)
    complete: bool = True  # False: the trace replayed was incomplete, and so is this one


ProgressCallback = Callable[[ReplayResult, int], None]


class Replay:
    """Everything one ``replay`` run needs; ``run`` writes the trace and returns the report."""

    def __init__(
        self,
        trace: str | Path,
        run: RunOptions,
        output: str | Path,
        *,
        overwrite: bool = False,
        force_routing: bool = False,
    ) -> None:
        engine = dataclasses.replace(run.engine, force_routing=force_routing)
        engine.validate()
        if not engine.capture_routing:
            raise MoetraceError("replay compares routing: it needs routing capture")
        self.trace_path = Path(trace)
        self.output = Path(output)
        check_new_output(self.output, overwrite=overwrite)
        if self.output.exists() and self.output.resolve() == self.trace_path.resolve():
            raise MoetraceError(f"the output {self.output} is the trace being replayed")
        self.model = run.model
        self.engine_config = engine
        self.device = resolve_device(run.device)
        self.dtype = run.dtype
        self.load_format = run.load_format
        self.overwrite = overwrite
        self.force_routing = force_routing
        self.extra_settings = {**run.extra_settings, **run.model.provenance()}
        if force_routing and self.extra_settings.get("tensor_parallel_size", 1) > 1:
            raise MoetraceError(
                "--force-routing runs on one device for now (tensor-parallel workers would "
                "need the forced experts too)"
            )
        self.tokenizer = load_tokenizer(run.model)
        with open_trace(self.trace_path) as source:
            self.total = source.num_requests
            self.source_metadata = dict(source.metadata)
            self.source_complete = source.complete

    # -- what the run checks and writes ----------------------------------------

    def _check_routing_shape(self, engine: LLMEngine) -> None:
        model = engine.model
        have = {
            "moe_layer_indices": [int(x) for x in self.source_metadata["moe_layer_indices"]],
            "num_experts": int(self.source_metadata["num_experts"]),
            "top_k": int(self.source_metadata["top_k"]),
        }
        mine = {
            "moe_layer_indices": list(model.moe_layer_indices),
            "num_experts": model.num_experts,
            "top_k": model.top_k,
        }
        for key in ROUTING_SHAPE:
            if have[key] != mine[key]:
                raise MoetraceError(
                    f"{self.model.name} routes differently from the model of {self.trace_path}: "
                    f"{key} {mine[key]} vs {have[key]}"
                )

    def _engine_settings(self, engine: LLMEngine) -> dict:
        return {
            **self.engine_config.to_dict(),
            "device": self.device.type,
            "load_format": "dummy" if self.load_format == "dummy" else "safetensors",
            "max_model_len": engine.max_model_len,
            "num_kv_blocks": engine.block_manager.num_blocks,
            "replay": {
                "trace": str(self.trace_path),
                "trace_model": self.source_metadata.get("model"),
                "trace_dtype": self.source_metadata.get("dtype"),
                "force_routing": self.force_routing,
            },
            **self.extra_settings,
        }

    # -- the run -------------------------------------------------------------------

    def run(
        self, progress: ProgressCallback | None = None, stop: GracefulStop | None = None
    ) -> ReplayResult:
        """Replay every request of the trace into the new trace, then diff the two."""
        clock = time.perf_counter()
        ready = load_engine(self)
        engine = ready.engine
        result = ReplayResult(self.output)
        result.startup = {"weights": ready.weights_s, **engine.startup.seconds}
        self._check_routing_shape(engine)
        metadata = model_metadata(
            self.model,
            engine,
            self.tokenizer,
            self._engine_settings(engine),
            logprobs=True,
        )
        writer = TraceWriter(
            self.output, metadata, overwrite=self.overwrite, expected_requests=self.total
        )
        stop = stop or GracefulStop()
        stop.arm()
        writer.start()
        start = time.perf_counter()
        complete, end_reason, interrupted = False, "error", None
        try:
            self._replay_requests(engine, writer, result, stop, progress, start)
            complete, end_reason, interrupted = self._ending(stop)
        except BaseException as exc:
            end_reason = f"error: {' '.join(str(exc).split())[:300]}"
            raise
        finally:
            result.elapsed_s = time.perf_counter() - start
            writer.close(complete=complete, end_reason=end_reason)
        if interrupted is not None:
            raise Interrupted(
                stop.signum,
                f"interrupted by {signal_name(stop.signum)}: {self.output} holds "
                f"{writer.flushed_requests} replayed requests; marked incomplete",
            )
        self._attach_report(result, metadata.dtype, complete, clock)
        return result

    def _replay_requests(
        self,
        engine: LLMEngine,
        writer: TraceWriter,
        result: ReplayResult,
        stop: GracefulStop,
        progress: ProgressCallback | None,
        start: float,
    ) -> None:
        """Feed the trace's requests to the engine a window ahead and write each as it
        finishes, until the trace runs out or a stop is asked for."""
        originals: dict[str, TraceRequest] = {}
        with open_trace(self.trace_path) as source:
            pending = iter(source)
            window = max(2 * self.engine_config.max_num_seqs, 64)
            exhausted = False
            while not stop.requested:
                while not exhausted and engine.num_unfinished < window:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                    elif not self._submit(engine, req, originals):
                        self._write(writer, result, self._replayed(req, None))
                if not engine.has_unfinished():
                    if exhausted:
                        break
                    continue
                for done in engine.step():
                    self._write(
                        writer, result, self._replayed(originals.pop(done.request_id), done)
                    )
                if progress is not None:
                    result.elapsed_s = time.perf_counter() - start
                    progress(result, self.total)

    def _ending(self, stop: GracefulStop) -> tuple[bool, str, int | None]:
        """Whether the new trace is complete, the end reason it records, and the signal
        that interrupted it (None: none did)."""
        interrupted = stop.signum if stop.requested else None
        complete = interrupted is None
        end_reason = "complete" if complete else f"interrupted by {signal_name(interrupted)}"
        if complete and not self.source_complete:  # it holds no more than its source
            complete, end_reason = False, f"replay of an incomplete trace ({self.trace_path})"
        return complete, end_reason, interrupted

    def _attach_report(
        self, result: ReplayResult, dtype: str, complete: bool, clock: float
    ) -> None:
        """The diff of the two traces, with what this replay ran, into ``result.report``."""
        with open_trace(self.trace_path) as a, open_trace(self.output) as b:
            result.report = diff_traces(a, b)
        result.complete = complete
        if not complete:
            result.report["warnings"].append(
                f"{self.trace_path} is incomplete (its recording did not finish): "
                f"{self.output} holds its requests and is marked incomplete too"
            )
        result.report["replay"] = {
            "model": self.model.name,
            "dtype": dtype,
            "device": self.device.type,
            "force_routing": self.force_routing,
            "moetrace_version": __version__,
            "seconds": time.perf_counter() - clock,
        }

    def _submit(self, engine: LLMEngine, req: TraceRequest, originals: dict) -> bool:
        """Queue ``req`` as a scoring request; False when it has no token to run."""
        tokens = [*req.prompt_token_ids.tolist(), *req.output_token_ids.tolist()]
        run = len(tokens) - 1  # tokens run through the model: all but the last
        if self.force_routing:
            run = min(run, req.num_rows)  # an aborted request: only as far as its rows go
        if run < 1:
            return False
        key = f"#{req.position}"  # engine ids are unique even where samples share an id
        try:
            engine.add_scoring_request(
                key,
                tokens[: run + 1],
                logprobs_from=min(max(1, req.prompt_len), run + 1),
                forced_experts=req.routed_experts if self.force_routing else None,
                index=req.index,
                sample_index=req.sample_index,
            )
        except RequestRejected as exc:
            raise MoetraceError(
                f"{self.trace_path}: request {req.id!r} (record {req.position}) cannot be "
                f"replayed: {exc.problem}"
            ) from None
        originals[key] = req
        return True

    def _replayed(self, original: TraceRequest, done: FinishedRequest | None) -> FinishedRequest:
        """The original request with the replay's rows, weights and log-probabilities."""
        p, o = original.prompt_len, original.output_len
        logprobs = np.full(o, np.nan, dtype=np.float32)
        rows = original.routed_experts[:0]
        weights = None
        if done is not None:
            rows, weights = done.routed_experts, done.routed_weights
            scored = done.prompt_logprobs[p:]
            logprobs[: len(scored)] = scored
        elif self.engine_config.capture_weights is not None:
            weights = np.zeros(rows.shape, dtype=self.engine_config.capture_weights)
        return FinishedRequest(
            request_id=original.id,
            index=original.index,
            prompt_token_ids=original.prompt_token_ids,
            output_token_ids=original.output_token_ids,
            routed_experts=rows,
            routed_weights=weights,
            finish_reason=original.finish_reason,
            num_cached_tokens=0 if done is None else done.num_cached_tokens,
            num_preemptions=0 if done is None else done.num_preemptions,
            extra=original.extra,
            sample_index=original.sample_index,
            stop_reason=original.stop_reason,  # where its tokens ended; nothing is sampled here
            output_logprobs=logprobs,
        )

    @staticmethod
    def _write(writer: TraceWriter, result: ReplayResult, req: FinishedRequest) -> None:
        writer.submit(req)
        result.requests += 1
        result.rows += req.num_rows
        result.scored_tokens += int(np.isfinite(req.output_logprobs).sum())
