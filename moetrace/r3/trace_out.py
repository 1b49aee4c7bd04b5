"""A trace of the trainer's routing, shaped like the rollout's, for ``moetrace diff``.

The new trace takes the rollout trace's model facts (so ``diff`` compares the
two without a warning about the model) and notes in ``engine_settings``
that the trainer's transformers model routed it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrace.analysis.merge import metadata_of
from moetrace.errors import MoetraceError
from moetrace.output_files import check_new_output
from moetrace.trace.reader import Trace
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter


@dataclass
class RoutedSequence:
    """One sequence's tokens and the routing of its tokens (a row per token, or one fewer)."""

    id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    routed_experts: np.ndarray  # (rows, moe_layers, top_k)
    sample_index: int = 0


def _request(seq: RoutedSequence, index: int, like: Trace, dtype: np.dtype) -> FinishedRequest:
    prompt = np.asarray(seq.prompt_token_ids, dtype=np.int32)
    output = np.asarray(seq.output_token_ids, dtype=np.int32)
    need = prompt.size + output.size - 1
    rows = np.asarray(seq.routed_experts)
    where = f"sequence {seq.id!r}"
    if rows.ndim != 3 or rows.shape[1:] != (like.num_moe_layers, like.top_k):
        raise MoetraceError(
            f"{where}: routing of shape {rows.shape}, the trace's rows are "
            f"(rows, {like.num_moe_layers}, {like.top_k})"
        )
    if rows.shape[0] not in (need, need + 1):
        raise MoetraceError(
            f"{where}: {rows.shape[0]} rows for {prompt.size} + {output.size} tokens "
            f"(want {need}, or {need + 1} with the last token's)"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= like.num_experts):
        raise MoetraceError(f"{where}: expert ids outside 0..{like.num_experts - 1}")
    return FinishedRequest(
        request_id=str(seq.id),
        index=index,
        prompt_token_ids=prompt,
        output_token_ids=output,
        routed_experts=rows[:need].astype(dtype),
        finish_reason="length",
        sample_index=seq.sample_index,
    )


def write_trace(
    path: str | os.PathLike,
    sequences: Iterable[RoutedSequence],
    *,
    like: Trace,
    overwrite: bool = False,
) -> Path:
    """Write ``sequences`` to a new trace at ``path`` with ``like``'s model facts."""
    check_new_output(path, overwrite=overwrite)
    metadata = dataclasses.replace(
        metadata_of(like),
        engine_settings={"routed_by": "moetrace.r3.record_routing (transformers)"},
        weights_dtype=None,
        logprobs=False,
    )
    requests = [_request(s, i, like, metadata.expert_dtype) for i, s in enumerate(sequences)]
    writer = TraceWriter(path, metadata, overwrite=overwrite).start()
    try:
        for req in requests:
            writer.submit(req)
    except BaseException:
        writer.close(complete=False)
        raise
    writer.close()
    return Path(path)
