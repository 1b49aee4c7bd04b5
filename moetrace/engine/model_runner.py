"""Runs one scheduled step on the model: inputs, forward, logits, sampling, capture.

Inputs are built on the host with numpy (positions, ``slot_mapping =
block_id * block_size + offset``, block tables) and moved in one go; the
forward reads them through the forward context.  Routing rows leave the
device through ``RoutingTransfer`` without a host sync.
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
from moetrace.engine.sampler import SamplingBatch, sample
from moetrace.engine.scheduler import SchedulerOutput
from moetrace.models.base import MoEForCausalLM


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    slots: np.ndarray
    logits_indices: torch.Tensor
    sampling: SamplingBatch | None
    sampling_request_ids: list[str]


@dataclass
class StepResult:
    sampled: dict[str, int]
    routing: RoutedExpertsLists | None


def request_seed(global_seed: int, index: int) -> int:
    """Seed of a request that gave none: fixed by the run seed and its input position."""
    return (global_seed * 1_000_003 + index * 7919 + 17) & 0x7FFFFFFFFFFFFFFF


class ModelRunner:
    def __init__(
        self, model: MoEForCausalLM, config: EngineConfig, num_blocks: int, device: torch.device
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.dtype = next(model.parameters()).dtype
        self._allocate_kv_cache()
        num_moe = len(model.moe_layer_indices)
        self.capturer: RoutingCapturer | None = None
        self.transfer: RoutingTransfer | None = None
        if config.capture_routing:
            self.capturer = RoutingCapturer(
                config.max_num_batched_tokens, num_moe, model.top_k, device
            )
            self.transfer = RoutingTransfer(
                config.max_num_batched_tokens, num_moe, model.top_k, device
            )
        model.set_capturer(self.capturer)

    def _allocate_kv_cache(self) -> None:
        # A slot is read only after it was written, so the CPU cache need not be
        # cleared (its pages stay untouched until used); on the GPU, zeros keep
        # masked kernel lanes finite.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        for layer in self.model.attention_layers():
            shape = (self.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = alloc(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = alloc(shape, dtype=self.dtype, device=self.device)

    # ----------------------------------------------------------------- inputs
    def prepare(self, output: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampling_rows = []
        max_blocks = max(len(s.request.block_table) for s in output.scheduled)
        tables = np.zeros((len(output.scheduled), max_blocks), dtype=np.int32)
        for b, item in enumerate(output.scheduled):
            req = item.request
            start, n = item.num_computed_before, item.num_new_tokens
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(req.block_table, dtype=np.int64)
            tables[b, : len(table)] = table
            ids.append(np.asarray(req.token_ids[start : start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            if item.samples:
                logits_rows.append(query_start[-1] - 1)
                sampling_rows.append(req)
        slot_array = np.concatenate(slots)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_array).to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(s.num_new_tokens for s in output.scheduled),
            max_seq_len=max(seq_lens),
            block_size=bs,
            query_start_loc_host=query_start,
            seq_lens_host=seq_lens,
        )
        return StepInputs(
            input_ids=torch.from_numpy(np.concatenate(ids)).to(dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            meta=meta,
            slots=slot_array,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            sampling=self._sampling_batch(sampling_rows) if sampling_rows else None,
            sampling_request_ids=[r.request_id for r in sampling_rows],
        )

    def _sampling_batch(self, requests: list) -> SamplingBatch:
        dev = self.device
        params = [r.sampling for r in requests]
        seeds = [
            p.seed if p.seed is not None else request_seed(self.config.seed, r.index)
            for p, r in zip(params, requests, strict=True)
        ]
        return SamplingBatch(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=dev
            ),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=dev),
            positions=torch.tensor([r.num_tokens for r in requests], dtype=torch.int64, device=dev),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
        )

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, block_epochs: np.ndarray) -> StepResult:
        inputs = self.prepare(output)
        slot_epochs = block_epochs[inputs.slots // self.block_size]
        if self.transfer is not None:
            self.transfer.fence_before_forward()
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        routing = None
        if self.capturer is not None and self.transfer is not None:
            routing = self.transfer.start(
                self.capturer.tensors(inputs.input_ids.shape[0]), inputs.slots, slot_epochs
            )
        sampled: dict[str, int] = {}
        if inputs.sampling is not None:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            tokens = sample(logits, inputs.sampling).tolist()
            sampled = dict(zip(inputs.sampling_request_ids, tokens, strict=True))
        return StepResult(sampled, routing)
