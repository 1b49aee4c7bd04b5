"""Host-side description of one step: the arrays the model runner moves to the device.

Built with numpy from the scheduler's output, before the step runs, so a step
can be prepared while the previous one is still on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.engine.request import Request
from moetrace.engine.scheduler import SchedulerOutput


@dataclass
class StepPlan:
    input_ids: np.ndarray  # int64 [T]; -1 where the token is still being sampled on the device
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]: block_id * block_size + offset
    query_start: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, max_blocks]
    logits_rows: np.ndarray  # int64 [S]: packed index of each sampling request's last token
    sampling_requests: list[Request]
    requests: list[Request]  # in batch order
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def build_plan(output: SchedulerOutput, block_size: int) -> StepPlan:
    scheduled = output.scheduled
    counts = np.fromiter(
        (s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled)
    )
    starts = np.fromiter(
        (s.num_computed_before for s in scheduled), dtype=np.int64, count=len(scheduled)
    )
    query_start = np.zeros(len(scheduled) + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])
    width = max(len(s.request.block_table) for s in scheduled)
    tables = np.zeros((len(scheduled), width), dtype=np.int32)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    for b, item in enumerate(scheduled):
        req = item.request
        table = req.block_table
        tables[b, : len(table)] = table
        lo, hi = int(query_start[b]), int(query_start[b + 1])
        start = item.num_computed_before
        known = req.token_ids[start : start + item.num_new_tokens]
        input_ids[lo : lo + len(known)] = known
        input_ids[lo + len(known) : hi] = -1
        positions[lo:hi] = np.arange(start, start + item.num_new_tokens)
    seq_of_token = np.repeat(np.arange(len(scheduled)), counts)
    block_ids = tables[seq_of_token, positions // block_size].astype(np.int64)
    slots = block_ids * block_size + positions % block_size
    samples = [i for i, s in enumerate(scheduled) if s.samples]
    return StepPlan(
        input_ids=input_ids,
        positions=positions,
        slots=slots,
        query_start=query_start,
        seq_lens=(starts + counts).astype(np.int32),
        block_tables=tables,
        logits_rows=query_start[1:][samples].astype(np.int64) - 1,
        sampling_requests=[scheduled[i].request for i in samples],
        requests=[s.request for s in scheduled],
        max_query_len=int(counts.max()),
    )
