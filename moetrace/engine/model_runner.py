"""Runs one scheduled step on the model: inputs, forward, logits, sampling, capture.

Inputs come from a host-side ``StepPlan``.  When every layer runs on the CUDA
kernels, each step runs at a padded size and replays the CUDA graph captured
for it (``cuda_graphs.StepGraphs``); otherwise (the CPU, the plain-torch
layers, tensor parallelism) it runs eagerly at its own size.  Routing rows
leave the device through ``RoutingTransfer`` without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moetrace.capture.capturer import RoutingCapturer, capture_dtype, weights_capture_dtype
from moetrace.capture.transfer import RoutingTransfer
from moetrace.capture.types import RoutedExpertsLists
from moetrace.config import EngineConfig
from moetrace.distributed.state import get_parallel_state
from moetrace.engine.cuda_graphs import StepGraphs
from moetrace.engine.logprob_columns import StepLogprobs
from moetrace.engine.sampler import Logprobs, SamplingBatch, sample, token_logprobs
from moetrace.engine.sampling_inputs import SamplingInputs
from moetrace.engine.scheduler import SchedulerOutput
from moetrace.engine.scoring import StepScores, TeacherForcing
from moetrace.engine.staging import StagingRing
from moetrace.engine.step_plan import StepPlan, build_plan
from moetrace.engine.step_sync import publish_step, share_sampled, wrap_capturer
from moetrace.forward_context import AttentionMetadata, forward_context
from moetrace.models.base import MoEForCausalLM


@dataclass
class LaunchedStep:
    """A step queued on the device; ``finish`` waits for it and returns what it sampled."""

    output: SchedulerOutput
    plan: StepPlan
    routing: RoutedExpertsLists | None
    sampled_device: torch.Tensor | None  # int64 [S], rows in plan.sampling_requests order
    sampled_host: torch.Tensor | None
    done: torch.cuda.Event | None
    logprobs_host: list[torch.Tensor] | None = None  # Logprobs.tensors(), on the host
    scores: StepScores | None = None  # scoring requests' log-probabilities (teacher forcing)

    def finish(self) -> dict[str, int]:
        if self.sampled_host is None:
            return {}
        if self.done is not None:
            self.done.synchronize()
        ids = [r.request_id for r in self.plan.sampling_requests]
        return dict(zip(ids, self.sampled_host.tolist(), strict=True))

    def logprobs(self) -> StepLogprobs | None:
        """The sampled tokens' log-probabilities, for the requests that asked (after finish)."""
        if self.logprobs_host is None:
            return None
        rows = {
            r.request_id: i
            for i, r in enumerate(self.plan.sampling_requests)
            if r.sampling.logprobs is not None
        }
        return StepLogprobs(rows, *(t.numpy() for t in self.logprobs_host))


def set_kernel_paths(model: MoEForCausalLM, use_kernels: bool) -> None:
    """Turn each module's kernel path on where a kernel serves it.

    Some kernels are for 16-bit weights only (the fused-MoE tiles are tuned
    for them; the norm kernel rounds like the plain path only there): with
    float32 or float64 those modules take the plain path (no graphs then).
    """
    dtype = next(model.parameters()).dtype
    half = dtype in (torch.bfloat16, torch.float16)
    for module in model.modules():
        if hasattr(module, "use_triton"):
            capable = getattr(module, "kernel_capable", True)
            if getattr(module, "kernel_half_only", False):
                capable = capable and half
            module.use_triton = use_kernels and capable


class ModelRunner:
    def __init__(
        self,
        model: MoEForCausalLM,
        config: EngineConfig,
        num_blocks: int,
        device: torch.device,
        *,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.dtype = next(model.parameters()).dtype
        self.use_kernels = device.type == "cuda" and config.use_kernels
        self.parallel = get_parallel_state()  # None unless tensor parallel (then rank 0 drives)
        set_kernel_paths(model, self.use_kernels)
        # One block past those the block manager hands out: where padding rows write.
        self.scratch_block = num_blocks
        self._allocate_kv_cache(num_blocks + 1)
        self.staging = StagingRing(4 * config.max_num_batched_tokens, device)
        self.fill_staging = StagingRing(2 * config.max_num_seqs, device)
        self.sampling_inputs = SamplingInputs(model.vocab_size, device, config.seed)
        num_moe = len(model.moe_layer_indices)
        self.capturer: RoutingCapturer | None = None
        self.transfer: RoutingTransfer | None = None
        if config.capture_routing:
            dtype = capture_dtype(model.num_experts)
            weights_dtype = weights_capture_dtype(config.capture_weights)
            self.capturer = RoutingCapturer(
                config.max_num_batched_tokens, num_moe, model.top_k, device, dtype, weights_dtype
            )
            # Tensor parallel experts may see other ids than the router's: copy those.
            self.capturer.in_kernel = self.use_kernels and self.parallel is None
            self.transfer = RoutingTransfer(
                config.max_num_batched_tokens,
                num_moe,
                model.top_k,
                device,
                ring_size=config.capture_ring_size,
                dtype=dtype,
                weights_dtype=weights_dtype,
            )
        if self.parallel is not None:
            self.capturer = wrap_capturer(self.capturer, self.parallel)
        self.teacher = TeacherForcing(model, config, device)
        self._binding = object()  # marks the model as holding this runner's caches
        self.bind()
        self.graphs: StepGraphs | None = None
        # The plain-torch paths read host-side lengths and counts, which a graph would freeze.
        all_kernel = all(m.use_triton for m in model.modules() if hasattr(m, "use_triton"))
        # Tensor parallel runs eager: graphs with collectives inside are untested (docs/distributed.md).
        self.padded_steps = self.use_kernels and all_kernel and self.parallel is None
        if self.padded_steps:
            self.graphs = self._new_graphs()

    def _new_graphs(self) -> StepGraphs:
        config = self.config
        return StepGraphs(
            self.model,
            self.device,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            block_size=self.block_size,
            scratch_block=self.scratch_block,
            max_model_len=self.max_model_len,
            max_graph_tokens=config.max_cudagraph_capture_size,
            use_graphs=not config.enforce_eager,
        )

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        # A slot is read only after it was written, so the CPU cache need not be
        # cleared (its pages stay untouched until used); on the GPU, zeros keep
        # masked kernel lanes finite.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        self.kv_caches: list[list[torch.Tensor]] = [
            [
                alloc(shape, dtype=self.dtype, device=self.device)
                for shape in layer.kv_cache_shapes(num_blocks, self.block_size)
            ]
            for layer in self.model.attention_layers()
        ]

    def bind(self) -> None:
        """Point the model's layers at this runner's KV cache and capturer.

        The caches and capturer live on the model's modules, so a second engine
        on the same model (the benchmark's capture-on and capture-off engines)
        rebinds them.  The runner keeps its own references, so its captured
        graphs never point at freed memory, and every step rebinds first.
        """
        if getattr(self.model, "_moetrace_binding", None) is self._binding:
            return
        for layer, caches in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            layer.bind_kv_cache(caches)
        self.model.set_capturer(self.capturer)
        self.model.set_forced_routing(self.teacher.forced)
        self.model._moetrace_binding = self._binding

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.bind()
            self.graphs.capture()

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they point at memory about to move); see ``recapture``."""
        self.graphs = None

    def recapture(self) -> None:
        """Capture the step graphs anew: the weights or KV cache moved, or what a step
        launches changed (an MXFP4 scale past the fast decoder's range)."""
        if self.padded_steps:
            self.graphs = None  # the old graphs and their memory pool go first
            self.graphs = self._new_graphs()
            self.capture_graphs()

    def free_kv_cache(self) -> None:
        """Let the KV cache's memory go: the layers are pointed at empty tensors."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for layer, caches in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            layer.bind_kv_cache([empty] * len(caches))
        self.kv_caches = []
        self._binding = object()  # the next step binds the new cache

    def allocate_kv_cache(self) -> None:
        """A KV cache of the size the engine planned (after ``free_kv_cache``)."""
        self._allocate_kv_cache(self.num_blocks + 1)
        self._binding = object()
        self.bind()

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def launch(
        self, output: SchedulerOutput, block_epochs: np.ndarray, previous: LaunchedStep | None
    ) -> LaunchedStep:
        """Queue one step; tokens still being sampled by ``previous`` are read on the device."""
        self.bind()
        plan = build_plan(output, self.block_size)
        slot_epochs = block_epochs[plan.slots // self.block_size]
        fill_index = self._fill_index(plan, previous)
        if self.parallel is not None:  # the workers start the same step from its host inputs
            publish_step(self.parallel, plan, fill_index)
        fill = self._stage_fill(fill_index, previous)
        scoring, targets = self.teacher.prepare(plan)
        scores = None
        if scoring:  # teacher forcing: every position's hidden state, eagerly
            hidden, rows = self._run_hidden(plan, fill)
            self.teacher.done_forcing()
            logits = self.model.compute_logits(hidden[rows]) if plan.sampling_requests else None
            if targets is not None:
                scores = self.teacher.score(self.model, hidden, targets)
        elif self.graphs is not None:
            logits = self.graphs.run(plan, fill)
        else:
            logits = self._run_eager(plan, fill)
        routing = None
        if self.capturer is not None and self.transfer is not None:
            routing = self.transfer.start(
                self.capturer.tensors(plan.num_tokens), plan.slots, slot_epochs
            )
        sampled_device = sampled_host = done = None
        logprobs_host = None
        if plan.sampling_requests:
            batch = self._sampling_batch(plan)
            sampled_device = sample(logits, batch)
            logprobs = None
            if batch.num_logprobs is not None:
                logprobs = token_logprobs(logits, sampled_device, batch.num_logprobs)
            if self.parallel is not None:  # workers fill their next step's tokens from these
                share_sampled(self.parallel, sampled_device)
            if self.device.type == "cuda":
                sampled_host = _to_pinned(sampled_device)
                logprobs_host = None if logprobs is None else _pinned_logprobs(logprobs)
                done = torch.cuda.Event()
                done.record()
            else:
                sampled_host = sampled_device
                logprobs_host = None if logprobs is None else logprobs.tensors()
        return LaunchedStep(
            output, plan, routing, sampled_device, sampled_host, done, logprobs_host, scores
        )

    def _fill_index(
        self, plan: StepPlan, previous: LaunchedStep | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(token positions in this step, rows of the previous step's samples), on the host."""
        missing = np.flatnonzero(plan.input_ids < 0)
        if missing.size == 0:
            return None
        if previous is None or previous.sampled_device is None:
            raise RuntimeError("a step needs tokens that no step in flight is sampling")
        row_of = {r.request_id: i for i, r in enumerate(previous.plan.sampling_requests)}
        seq_of_token = np.searchsorted(plan.query_start, missing, side="right") - 1
        owners = [plan.requests[s].request_id for s in seq_of_token]
        src = np.asarray([row_of[o] for o in owners], dtype=np.int64)
        return missing.astype(np.int64), src

    def _stage_fill(
        self, index: tuple[np.ndarray, np.ndarray] | None, previous: LaunchedStep | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fill on the device: positions, and the sampled ids to copy there."""
        if index is None or previous is None or previous.sampled_device is None:
            return None
        dst, src_rows = self.fill_staging.stage(list(index))
        return dst, previous.sampled_device.index_select(0, src_rows)

    def staged_inputs(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, logits rows) on the device, in one copy."""
        ids, positions, slots, query_start, seq_lens, tables, rows = self.staging.stage(
            [
                plan.input_ids,
                plan.positions,
                plan.slots,
                plan.query_start,
                plan.seq_lens,
                plan.block_tables,
                plan.logits_rows,
            ]
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.to(torch.int32),
            max_query_len=plan.max_query_len,
            max_seq_len=int(plan.seq_lens.max()),
            block_size=self.block_size,
            query_start_loc_host=plan.query_start.tolist(),
            seq_lens_host=plan.seq_lens.tolist(),
        )
        return ids, positions, meta, rows

    def _run_eager(
        self, plan: StepPlan, fill: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        hidden, rows = self._eager_hidden(plan, fill)
        if not plan.sampling_requests:
            return hidden[:0]
        return self.model.compute_logits(hidden[rows])

    def _eager_hidden(
        self, plan: StepPlan, fill: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's hidden state, and the sampling rows' indices into them."""
        input_ids, positions, meta, rows = self.staged_inputs(plan)
        if fill is not None:
            input_ids.index_copy_(0, *fill)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        return hidden, rows

    def _run_hidden(
        self, plan: StepPlan, fill: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_eager_hidden``, at the padded size on the kernel path (no graph replay)."""
        if self.graphs is not None:
            return self.graphs.run_hidden(plan, fill)
        return self._eager_hidden(plan, fill)

    def _sampling_batch(self, plan: StepPlan) -> SamplingBatch:
        return self.sampling_inputs.build(plan.sampling_requests)


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy to pinned host memory; read it after the step's event."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _pinned_logprobs(logprobs: Logprobs) -> list[torch.Tensor]:
    return [_to_pinned(t) for t in logprobs.tensors()]
