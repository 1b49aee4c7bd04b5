"""Runs one scheduled step on the model: inputs, forward, logits, sampling, capture.

Inputs come from a host-side ``StepPlan``.  Decode-only steps on CUDA replay a
captured graph for the smallest captured batch size that fits (padding rows
write to a scratch KV block); everything else runs eagerly.  Routing rows
leave the device through ``RoutingTransfer`` without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moetrace.capture.capturer import RoutingCapturer
from moetrace.capture.transfer import RoutingTransfer
from moetrace.capture.types import RoutedExpertsLists
from moetrace.config import EngineConfig
from moetrace.engine.context import AttentionMetadata, forward_context
from moetrace.engine.cuda_graphs import DecodeGraphs
from moetrace.engine.sampler import SamplingBatch, sample
from moetrace.engine.scheduler import SchedulerOutput
from moetrace.engine.step_plan import StepPlan, build_plan
from moetrace.models.base import MoEForCausalLM


@dataclass
class StepResult:
    sampled: dict[str, int]
    routing: RoutedExpertsLists | None


def request_seed(global_seed: int, index: int) -> int:
    """Seed of a request that gave none: fixed by the run seed and its input position."""
    return (global_seed * 1_000_003 + index * 7919 + 17) & 0x7FFFFFFFFFFFFFFF


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
        self._set_kernel_paths()
        # One block past those the block manager hands out: where padding rows write.
        self.scratch_block = num_blocks
        self._allocate_kv_cache(num_blocks + 1)
        num_moe = len(model.moe_layer_indices)
        self.capturer: RoutingCapturer | None = None
        self.transfer: RoutingTransfer | None = None
        if config.capture_routing:
            self.capturer = RoutingCapturer(
                config.max_num_batched_tokens, num_moe, model.top_k, device
            )
            self.transfer = RoutingTransfer(
                config.max_num_batched_tokens,
                num_moe,
                model.top_k,
                device,
                ring_size=config.capture_ring_size,
            )
        model.set_capturer(self.capturer)
        self.graphs: DecodeGraphs | None = None
        if self.use_kernels and not config.enforce_eager:
            self.graphs = DecodeGraphs(
                self, max_batch=min(config.max_num_seqs, config.max_num_batched_tokens)
            )

    def _set_kernel_paths(self) -> None:
        for module in self.model.modules():
            if hasattr(module, "use_triton"):
                module.use_triton = self.use_kernels and getattr(module, "kernel_capable", True)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        # A slot is read only after it was written, so the CPU cache need not be
        # cleared (its pages stay untouched until used); on the GPU, zeros keep
        # masked kernel lanes finite.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, *layer.kv_cache_shape())
            layer.k_cache = alloc(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = alloc(shape, dtype=self.dtype, device=self.device)

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, block_epochs: np.ndarray) -> StepResult:
        plan = build_plan(output, self.block_size)
        slot_epochs = block_epochs[plan.slots // self.block_size]
        if self.transfer is not None:
            self.transfer.fence_before_forward()
        if self.graphs is not None and self.graphs.fits(plan):
            logits = self.graphs.run(plan)
        else:
            logits = self._run_eager(plan)
        routing = None
        if self.capturer is not None and self.transfer is not None:
            routing = self.transfer.start(
                self.capturer.tensors(plan.num_tokens), plan.slots, slot_epochs
            )
        sampled: dict[str, int] = {}
        if plan.sampling_requests:
            tokens = sample(logits, self._sampling_batch(plan)).tolist()
            ids = [r.request_id for r in plan.sampling_requests]
            sampled = dict(zip(ids, tokens, strict=True))
        return StepResult(sampled, routing)

    def metadata(self, plan: StepPlan) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(plan.slots).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(plan.query_start).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(plan.seq_lens).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(plan.block_tables).to(dev, non_blocking=True),
            max_query_len=plan.max_query_len,
            max_seq_len=int(plan.seq_lens.max()),
            block_size=self.block_size,
            query_start_loc_host=plan.query_start.tolist(),
            seq_lens_host=plan.seq_lens.tolist(),
        )

    def _run_eager(self, plan: StepPlan) -> torch.Tensor:
        meta = self.metadata(plan)
        input_ids = torch.from_numpy(plan.input_ids).to(self.device, non_blocking=True)
        positions = torch.from_numpy(plan.positions).to(self.device, non_blocking=True)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        if not plan.sampling_requests:
            return hidden[:0]
        rows = torch.from_numpy(plan.logits_rows).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    def _sampling_batch(self, plan: StepPlan) -> SamplingBatch:
        dev = self.device
        requests = plan.sampling_requests
        params = [r.sampling for r in requests]
        seeds = [
            p.seed if p.seed is not None else request_seed(self.config.seed, r.index)
            for p, r in zip(params, requests, strict=True)
        ]
        all_greedy = all(p.greedy for p in params)
        if all_greedy:
            empty_f = torch.zeros(len(params), device=dev)
            empty_i = torch.zeros(len(params), dtype=torch.int64, device=dev)
            return SamplingBatch(empty_f, empty_i, empty_f, empty_i, empty_i, True, False, False)
        return SamplingBatch(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=dev
            ),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=dev),
            positions=torch.tensor([r.num_tokens for r in requests], dtype=torch.int64, device=dev),
            all_greedy=False,
            any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
        )
