"""The engine loop: admit requests, schedule, run, store routing, hand out finished requests."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from moetrace.capture.manager import RoutedExpertsCache, RoutedExpertsManager
from moetrace.config import EngineConfig
from moetrace.engine.block_manager import BlockManager
from moetrace.engine.memory import plan_num_blocks
from moetrace.engine.model_runner import LaunchedStep, ModelRunner
from moetrace.engine.request import Request, RequestStatus
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.scheduler import Scheduler
from moetrace.errors import CapacityError, MoetraceError
from moetrace.models.base import MoEForCausalLM
from moetrace.trace.metadata import expert_id_dtype
from moetrace.trace.records import FinishedRequest


class RequestRejected(MoetraceError):
    """A request that can never run; ``field`` names the offending input field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(problem)


@dataclass
class EngineStats:
    steps: int = 0
    output_tokens: int = 0
    preemptions: int = 0


def request_problem(
    prompt_token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int
) -> tuple[str, str] | None:
    """(input field, one-line problem) for a request that can never run, or None.

    Shared by the engine and by the CLI's check of a whole prompt file before
    the weights load, so both refuse the same requests with the same words.
    """
    if not prompt_token_ids:
        return "prompt", "empty prompt"
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
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
    ) -> None:
        config.validate()
        self.model = model
        self.config = config
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        num_blocks = config.num_kv_blocks or plan_num_blocks(
            model, config, device, self.max_model_len
        )
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
        self.runner.capture_graphs()
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self.async_scheduling = (
            device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        self._in_flight: LaunchedStep | None = None

    # --------------------------------------------------------------- requests
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Refuse, before any work, a request that could never complete."""
        problem = request_problem(
            prompt_token_ids, sampling.max_tokens, self.model.vocab_size, self.max_model_len
        )
        if problem is not None:
            raise RequestRejected(*problem)
        n = len(prompt_token_ids)
        bs = self.config.block_size
        blocks = -(-(n + sampling.max_tokens - 1) // bs)
        if blocks > self.block_manager.num_blocks:
            raise CapacityError(
                f"the KV cache holds {self.block_manager.num_blocks} blocks of {bs} tokens; one "
                f"request needs {blocks} (raise --num-kv-blocks or lower max_tokens)"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        index: int = 0,
    ) -> None:
        if request_id in self._requests:
            raise RequestRejected("id", f"duplicate request id {request_id!r}")
        self.check_request(prompt_token_ids, sampling)
        request = Request(
            request_id, prompt_token_ids, sampling, index=index, eos_token_ids=self.eos_token_ids
        )
        self._requests[request_id] = request
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def abort(self, request_ids: Iterable[str]) -> list[FinishedRequest]:
        finished = self._drain()
        aborted = self.scheduler.abort(set(request_ids))
        return finished + [self._finish(r) for r in aborted]

    # --------------------------------------------------------------- stepping
    def _before_free(self, request: Request) -> None:
        if self.routing_cache is not None:
            self.routing_cache.capture(request)

    def _complete(self, step: LaunchedStep) -> list[FinishedRequest]:
        """Wait for a launched step, store its routing rows, advance its requests."""
        sampled = step.finish()
        if step.routing is not None and self.routing_manager is not None:
            self.routing_manager.store_batch(step.routing)
        finished = self.scheduler.update(step.output, sampled)
        self.stats.steps += 1
        self.stats.output_tokens = self.scheduler.tokens_appended
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
        L, k = len(self.model.moe_layer_indices), self.model.top_k
        if self.routing_cache is None:
            rows = np.zeros((0, L, k), dtype=expert_id_dtype(self.model.num_experts))
        elif request.status is RequestStatus.FINISHED_ABORTED:
            rows = self.routing_cache.take(request)
        else:
            rows = self.routing_cache.take(request, request.num_tokens - 1)
        return FinishedRequest(
            request_id=request.request_id,
            index=request.index,
            prompt_token_ids=np.asarray(
                request.token_ids[: request.num_prompt_tokens], dtype=np.int32
            ),
            output_token_ids=np.asarray(request.output_token_ids, dtype=np.int32),
            routed_experts=rows,
            finish_reason=request.status.value,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_preemptions=request.num_preemptions,
        )

    def run(self) -> Iterator[FinishedRequest]:
        """Step until every added request has finished, yielding each as it ends."""
        while self.has_unfinished():
            yield from self.step()
