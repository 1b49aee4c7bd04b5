"""The engine loop: admit requests, schedule, run, store routing, hand out finished requests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from moetrace.capture.manager import RoutedExpertsCache, RoutedExpertsManager, RoutingRows
from moetrace.config import EngineConfig
from moetrace.engine.block_manager import BlockManager
from moetrace.engine.memory import plan_num_blocks
from moetrace.engine.model_runner import LaunchedStep, ModelRunner, set_kernel_paths
from moetrace.engine.precompile import count_compiles, precompile
from moetrace.engine.request import Request, RequestStatus, Scoring
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.sampling_inputs import effective_seed
from moetrace.engine.scheduler import Scheduler
from moetrace.engine.stop_strings import StopStringMatcher, StreamingDecoder
from moetrace.errors import CapacityError, MoetraceError, UsageError
from moetrace.models.base import MoEForCausalLM
from moetrace.trace.metadata import expert_id_dtype
from moetrace.trace.records import FinishedRequest, OutputLogprobs


def check_capacity(tokens: int, block_size: int, num_blocks: int) -> None:
    """Refuse a request whose KV (``tokens`` of it) could never fit ``num_blocks`` blocks."""
    blocks = -(-tokens // block_size)
    if blocks > num_blocks:
        raise CapacityError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens; one "
            f"request needs {blocks} (raise --num-kv-blocks or lower max_tokens)"
        )


class RequestRejected(MoetraceError):
    """A request that can never run; ``field`` names the offending input field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(problem)


@dataclass
class StartupTimes:
    """Where the engine's start-up went, in seconds (``record`` prints it)."""

    seconds: dict[str, float] = field(default_factory=dict)
    kernel_variants: int = 0  # compiled (or loaded from Triton's cache) ahead of the first step
    late_compiles: list[str] = field(default_factory=list)  # compiled in-process, by phase

    def clock(self) -> Callable[[str], None]:
        """A function that books the time since its previous call under a name."""
        last = [time.perf_counter()]

        def book(name: str) -> None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + now - last[0]
            last[0] = now

        return book


@dataclass
class EngineStats:
    steps: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (not served by the prefix cache)
    preemptions: int = 0


def refuse_request(
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    has_tokenizer: bool,
) -> None:
    """Refuse, before any work, a request that could never complete: the engine's rule,
    also applied by the server's handle on an engine in another process."""
    problem = request_problem(prompt_token_ids, sampling.max_tokens, vocab_size, max_model_len)
    if problem is not None:
        raise RequestRejected(*problem)
    check_capacity(len(prompt_token_ids) + sampling.max_tokens - 1, block_size, num_blocks)
    if sampling.stop and not has_tokenizer:
        raise RequestRejected("stop", "stop strings need the model's tokenizer (tokenizer.json)")


def request_problem(
    prompt_token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int
) -> tuple[str, str] | None:
    """(input field, one-line problem) for a request that can never run, or None.

    Shared by the engine and by the CLI's check of a whole prompt file before
    the weights load, so both refuse the same requests with the same words.
    """
    if not prompt_token_ids:
        return "prompt", "empty prompt"
    # min/max first: one C-level pass each; the scan for the first bad id runs only on failure
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        return "prompt_token_ids", f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
    n = len(prompt_token_ids)
    if n >= max_model_len:
        return "prompt", f"prompt has {n} tokens; the model's context is {max_model_len}"
    if n + max_tokens > max_model_len:
        return (
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_model_len}",
        )
    return None


class LLMEngine:
    def __init__(
        self,
        model: MoEForCausalLM,
        config: EngineConfig,
        device: torch.device,
        *,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: StreamingDecoder | None = None,
    ) -> None:
        """``tokenizer`` detokenizes outputs for stop strings (refused without one)."""
        config.validate()
        self.model = model
        self.config = config
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        if config.max_model_len and config.max_model_len > model.max_model_len:
            raise UsageError(
                f"--max-model-len {config.max_model_len}: above the model's context "
                f"({model.max_model_len} tokens)"
            )
        self.max_model_len = config.max_model_len or model.max_model_len
        self.startup = StartupTimes()
        clock = self.startup.clock()
        with count_compiles(self.startup.late_compiles):
            self._start(model, config, device, clock)
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._samples: dict[str, list[str]] = {}  # prompt id -> its unfinished samples' ids
        self.async_scheduling = (
            device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        self._in_flight: LaunchedStep | None = None

    def _start(
        self,
        model: MoEForCausalLM,
        config: EngineConfig,
        device: torch.device,
        clock: Callable[[str], None],
    ) -> None:
        """Kernels, KV cache, scheduler, runner and graphs, each phase booked on ``clock``."""
        # Kernel paths first, so the memory profile measures (and compiles) what the steps run.
        set_kernel_paths(model, device.type == "cuda" and config.use_kernels)
        report = precompile(model, config, device, self.max_model_len)
        if report is not None:
            self.startup.kernel_variants = report.variants
            clock("kernel_compile")
        num_blocks = config.num_kv_blocks or plan_num_blocks(
            model, config, device, self.max_model_len
        )
        clock("kv_sizing")
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.routing_manager: RoutedExpertsManager | None = None
        self.routing_cache: RoutedExpertsCache | None = None
        if config.capture_routing:
            self.routing_manager = RoutedExpertsManager(
                num_blocks * config.block_size,
                len(model.moe_layer_indices),
                model.top_k,
                expert_id_dtype(model.num_experts),
                config.block_size,
                self.block_manager.epochs,
                None if config.capture_weights is None else np.dtype(config.capture_weights),
            )
            self.routing_cache = RoutedExpertsCache(self.routing_manager)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            before_free=self._before_free,
        )
        self.runner = ModelRunner(
            model, config, num_blocks, device, max_model_len=self.max_model_len
        )
        clock("kv_allocation")
        self.runner.capture_graphs()
        clock("graph_capture")

    # --------------------------------------------------------------- requests
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Refuse, before any work, a request that could never complete."""
        refuse_request(
            prompt_token_ids,
            sampling,
            vocab_size=self.model.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_blocks=self.block_manager.num_blocks,
            has_tokenizer=self.tokenizer is not None,
        )

    def _check_capacity(self, tokens: int) -> None:
        """Refuse a request whose KV (``tokens`` of it) could never fit the cache."""
        check_capacity(tokens, self.config.block_size, self.block_manager.num_blocks)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        index: int = 0,
        samples: Sequence[int] | None = None,
        extra: dict | None = None,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """Queue a prompt; ``sampling.n`` > 1 queues that many samples of it (ids ``"i_<id>"``).

        ``samples``: only these sample indices (a resumed run redoes the missing ones).
        ``extra``: JSON-able facts about the request its finished record carries (``extra``).
        ``cache_salt``: prefix-cache hits only among requests with the same salt (vLLM's).
        Returns the queued samples' ``Request``s, which show their tokens as steps complete.
        """
        if request_id in self._samples:
            raise RequestRejected("id", f"duplicate request id {request_id!r}")
        self.check_request(prompt_token_ids, sampling)
        n = sampling.n
        chosen = range(n) if samples is None else sorted(set(samples))
        if not chosen or not all(0 <= i < n for i in chosen):
            raise ValueError(f"samples {list(chosen)} are not a choice among n={n}")
        # vLLM's names for the samples of one prompt; a clash with another id is refused.
        ids = {i: request_id if n == 1 else f"{i}_{request_id}" for i in chosen}
        clash = next((e for e in ids.values() if e in self._requests), None)
        if clash is not None:
            raise RequestRejected("id", f"duplicate request id {clash!r}")
        queued = []
        for i, engine_id in ids.items():
            params = sampling.for_sample(i) if n > 1 else sampling
            request = Request(
                engine_id,
                prompt_token_ids,
                params,
                index=index,
                eos_token_ids=self.eos_token_ids,
                sample_index=i,
                parent_id=request_id,
                stop_strings=self._stop_strings(prompt_token_ids, params),
                cache_salt=cache_salt,
            )
            request.extra = dict(extra or {})
            self._requests[engine_id] = request
            self.scheduler.add(request)
            queued.append(request)
        self._samples[request_id] = list(ids.values())
        return queued

    def add_scoring_request(
        self,
        request_id: str,
        token_ids: list[int],
        *,
        logprobs_from: int,
        forced_experts: np.ndarray | None = None,
        index: int = 0,
        sample_index: int = 0,
    ) -> Request:
        """Queue a teacher-forced sequence: nothing is sampled (``request.Scoring``).

        The finished request has ``token_ids`` as its prompt, no output, one
        routing row per token but the last, and in ``prompt_logprobs`` each
        token's log-probability given the tokens before it, from
        ``logprobs_from`` on (NaN before).  ``forced_experts`` (``[>= n - 1, L,
        k]``) routes every MoE layer through those experts (the engine must be
        built with ``force_routing``).
        """
        if request_id in self._samples or request_id in self._requests:
            raise RequestRejected("id", f"duplicate request id {request_id!r}")
        n = len(token_ids)
        if n < 2:
            raise RequestRejected("prompt", "a scored sequence needs at least 2 tokens")
        if not 1 <= logprobs_from <= n:
            raise ValueError(f"logprobs_from {logprobs_from} is outside 1..{n}")
        vocab = self.model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                "token_ids", f"token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        if n > self.max_model_len:
            raise RequestRejected(
                "token_ids", f"sequence has {n} tokens; the model's context is {self.max_model_len}"
            )
        self._check_capacity(n - 1)
        if forced_experts is not None:
            self._check_forced(forced_experts, n - 1)
        request = Request(
            request_id,
            token_ids,
            SamplingParams(max_tokens=1),  # never used: nothing is sampled
            index=index,
            sample_index=sample_index,
            scoring=Scoring(n, logprobs_from, forced_experts),
        )
        self._requests[request_id] = request
        self._samples[request_id] = [request_id]
        self.scheduler.add(request)
        return request

    def _check_forced(self, forced: np.ndarray, rows: int) -> None:
        shape = (len(self.model.moe_layer_indices), self.model.top_k)
        if not self.config.force_routing:
            raise RequestRejected("forced_experts", "the engine was built without force_routing")
        if forced.ndim != 3 or forced.shape[1:] != shape or forced.shape[0] < rows:
            raise RequestRejected(
                "forced_experts",
                f"forced experts of shape {list(forced.shape)}, need [>= {rows}, {shape[0]}, "
                f"{shape[1]}]",
            )
        if forced.size and not 0 <= int(forced.min()) <= int(forced.max()) < self.model.num_experts:
            raise RequestRejected(
                "forced_experts", f"an expert id is outside 0..{self.model.num_experts - 1}"
            )

    def _stop_strings(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> StopStringMatcher | None:
        if not params.stop or self.tokenizer is None:
            return None
        decode_next = self.tokenizer.decode_stream(
            prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        return StopStringMatcher(
            decode_next,
            params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def abort(self, request_ids: Iterable[str]) -> list[FinishedRequest]:
        """Stop these prompts (every sample of each) now; what they computed is kept."""
        finished = self._drain()
        engine_ids = {i for rid in request_ids for i in self._samples.get(rid, [rid])}
        aborted = self.scheduler.abort(engine_ids)
        return finished + [self._finish(r) for r in aborted]

    @property
    def request_ids(self) -> list[str]:
        """The prompts (parent ids) not finished yet, in arrival order."""
        return list(self._samples)

    def drain(self) -> list[FinishedRequest]:
        """Complete the step in flight (asynchronous scheduling), so nothing runs on the device."""
        return self._drain()

    def retract(self) -> list[FinishedRequest]:
        """Drain, then send every running request back to wait: its KV blocks are freed and
        it recomputes its tokens when it runs again (the same tokens: sampling is seeded by
        position).  Returns what the drained step finished."""
        finished = self._drain()
        self.stats.preemptions += len(self.scheduler.retract())
        return finished

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry (new weights: their KV is stale); the requests
        alive keep their own blocks but never offer them for reuse.  Returns entries dropped."""
        return self.block_manager.reset_prefix_cache(self._requests.values())

    @property
    def weight_version(self) -> str | None:
        """The label of the weights the next step samples with (stamped on each token)."""
        return self.scheduler.weight_version

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        self.scheduler.weight_version = version

    # --------------------------------------------------------------- stepping
    def _before_free(self, request: Request) -> None:
        if self.routing_cache is not None:
            self.routing_cache.capture(request)

    def _complete(self, step: LaunchedStep) -> list[FinishedRequest]:
        """Wait for a launched step, store its routing rows, advance its requests."""
        sampled = step.finish()
        if step.scores is not None:
            step.scores.store()
        if step.routing is not None and self.routing_manager is not None:
            self.routing_manager.store_batch(step.routing)
        finished = self.scheduler.update(step.output, sampled, step.logprobs())
        self.stats.steps += 1
        self.stats.output_tokens = self.scheduler.tokens_appended
        self.stats.prompt_tokens += step.output.num_prompt_tokens
        return [self._finish(r) for r in finished]

    def _drain(self) -> list[FinishedRequest]:
        step, self._in_flight = self._in_flight, None
        return [] if step is None else self._complete(step)

    def step(self) -> list[FinishedRequest]:
        """Run one step.  With asynchronous scheduling the step launched here completes
        at the next call, while this call completes the one launched before."""
        finished: list[FinishedRequest] = []
        if self._in_flight is not None and self.scheduler.needs_preemption():
            finished = self._drain()  # preemption needs every token known on the host
        output = self.scheduler.schedule()
        self.stats.preemptions += len(output.preempted)
        launched = None
        if output:
            launched = self.runner.launch(output, self.block_manager.epochs, self._in_flight)
        finished += self._drain()
        if launched is None and self.scheduler.has_work() and not finished and not output.preempted:
            raise CapacityError(
                f"no request fits in the KV cache ({self.block_manager.num_blocks} blocks of "
                f"{self.config.block_size}); raise --num-kv-blocks"
            )
        if self.async_scheduling:
            self._in_flight = launched
        elif launched is not None:
            finished += self._complete(launched)
        return finished

    def _finish(self, request: Request) -> FinishedRequest:
        self._requests.pop(request.request_id, None)
        samples = self._samples.get(request.parent_id)
        if samples is not None and request.request_id in samples:
            samples.remove(request.request_id)
            if not samples:
                del self._samples[request.parent_id]
        L, k = len(self.model.moe_layer_indices), self.model.top_k
        if self.routing_cache is None:
            rows = RoutingRows(
                np.zeros((0, L, k), dtype=expert_id_dtype(self.model.num_experts)), None
            )
        elif request.status is RequestStatus.FINISHED_ABORTED:
            rows = self.routing_cache.take(request)
        else:
            rows = self.routing_cache.take(request, request.num_tokens - 1)
        logprobs = _output_logprobs(request)
        return FinishedRequest(
            request_id=request.parent_id,
            index=request.index,
            prompt_token_ids=np.asarray(
                request.token_ids[: request.num_prompt_tokens], dtype=np.int32
            ),
            output_token_ids=np.asarray(request.output_token_ids, dtype=np.int32),
            routed_experts=rows.ids,
            routed_weights=rows.weights,
            finish_reason=request.status.value,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_preemptions=request.num_preemptions,
            extra=request.extra,
            sample_index=request.sample_index,
            stop_reason=request.stop_reason,
            sampling_params=(
                {}
                if request.scoring is not None  # teacher-forced: nothing was sampled
                else request.sampling.recorded(effective_seed(request, self.config.seed))
            ),
            output_text=request.output_text,
            logprobs=logprobs,
            output_logprobs=None if logprobs is None else logprobs.token_logprob,
            prompt_logprobs=None if request.scoring is None else request.scoring.logprobs,
            queue_s=_since(request.arrival_time, request.first_scheduled_time),
            first_token_s=_since(request.arrival_time, request.first_token_time),
            weight_versions=[list(span) for span in request.weight_versions],
        )

    def run(self) -> Iterator[FinishedRequest]:
        """Step until every added request has finished, yielding each as it ends."""
        while self.has_unfinished():
            yield from self.step()


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


def _output_logprobs(request: Request) -> OutputLogprobs | None:
    """The request's per-token log-probabilities as arrays, when it asked for them."""
    if request.sampling.logprobs is None:
        return None
    return request.logprobs.output(request.num_output_tokens)
