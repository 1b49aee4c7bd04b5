"""Decode steps as replayed CUDA graphs.

Each captured batch size has a graph that reads its inputs from static
buffers and writes logits to a static output.  A step of ``n`` decode tokens
replays the smallest graph of size ``B >= n``; rows ``n..B`` are padding that
write their KV and routing rows to a scratch block nobody reads.  The routing
capturer's buffer is static too, so capture runs inside the graph unchanged.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from moetrace.engine.step_plan import StepPlan
from moetrace.forward_context import AttentionMetadata, forward_context

if TYPE_CHECKING:
    from moetrace.engine.model_runner import ModelRunner


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (as vLLM spaces them)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        dev = runner.device
        bs = runner.block_size
        self.max_blocks = -(-runner.max_model_len // bs)
        scratch_slot = runner.scratch_block * bs
        b = self.max_batch
        # int64 inputs packed in one buffer so each replay needs one copy: ids, positions, slots.
        self.host_i64 = torch.zeros((3, b), dtype=torch.int64, pin_memory=True)
        self.dev_i64 = torch.zeros((3, b), dtype=torch.int64, device=dev)
        self.host_i64[2].fill_(scratch_slot)
        self.dev_i64[2].fill_(scratch_slot)
        # int32: seq lens, then block tables row by row.
        self.host_i32 = torch.zeros(b + b * self.max_blocks, dtype=torch.int32, pin_memory=True)
        self.dev_i32 = torch.zeros(b + b * self.max_blocks, dtype=torch.int32, device=dev)
        self.host_i32[:b].fill_(1)
        self.dev_i32[:b].fill_(1)
        self.host_tables = self.host_i32[b:].view(b, self.max_blocks)
        self.host_tables.fill_(runner.scratch_block)
        self.dev_i32[b:].fill_(runner.scratch_block)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.copied = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def fits(self, plan: StepPlan) -> bool:
        return (
            bool(self.graphs)
            and plan.decode_only
            and plan.num_tokens <= self.max_batch
            and (len(plan.sampling_requests) == plan.num_tokens)
        )

    def _meta(self, batch: int) -> AttentionMetadata:
        b = self.max_batch
        return AttentionMetadata(
            slot_mapping=self.dev_i64[2, :batch],
            query_start_loc=self.query_start[: batch + 1],
            seq_lens=self.dev_i32[:batch],
            block_tables=self.dev_i32[b:].view(b, self.max_blocks)[:batch],
            max_query_len=1,
            max_seq_len=self.runner.max_model_len,
            block_size=self.runner.block_size,
            query_start_loc_host=list(range(batch + 1)),
            seq_lens_host=[1] * batch,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        model = self.runner.model
        with forward_context(self._meta(batch)):
            hidden = model(self.dev_i64[0, :batch], self.dev_i64[1, :batch])
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller ones share its memory pool.

        No garbage collection while capturing: an earlier engine's runner
        (a reference cycle) freed mid-capture releases CUDA resources, which a
        capture in progress does not allow.
        """
        gc.collect()
        gc.disable()
        try:
            self._capture_all()
        finally:
            gc.enable()

    def _capture_all(self) -> None:
        for batch in reversed(self.sizes):
            self._forward(batch)  # warm up: kernels compiled and autotuned outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def run(self, plan: StepPlan, fill: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        n = plan.num_tokens
        batch = next(s for s in self.sizes if s >= n)
        b = self.max_batch
        width = plan.block_tables.shape[1]
        # The previous replay's input copy must be done before the staging buffers change.
        self.copied.synchronize()
        host = self.host_i64.numpy()
        host[0, :n] = plan.input_ids
        host[1, :n] = plan.positions
        host[2, :n] = plan.slots
        # Padding rows: token 0 at position 0, writing to the scratch block.  Stale
        # staging values (a placeholder's -1 from an earlier step) must not leak in.
        host[0, n:batch] = 0
        host[1, n:batch] = 0
        host[2, n:batch] = self.runner.scratch_block * self.runner.block_size
        host32 = self.host_i32.numpy()
        host32[:n] = plan.seq_lens
        host32[n:batch] = 1
        tables = self.host_tables.numpy()
        tables[:n, :width] = plan.block_tables
        tables[n:batch, 0] = self.runner.scratch_block
        self.dev_i64[:, :batch].copy_(self.host_i64[:, :batch], non_blocking=True)
        rows = batch * self.max_blocks
        self.dev_i32[:batch].copy_(self.host_i32[:batch], non_blocking=True)
        self.dev_i32[b : b + rows].copy_(self.host_i32[b : b + rows], non_blocking=True)
        self.copied.record()
        if fill is not None:
            self.dev_i64[0].index_copy_(0, *fill)
        self.graphs[batch].replay()
        return self.logits[batch][:n]
