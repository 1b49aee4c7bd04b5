"""What the engine hands to the trace writer when a request ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


class RequestLengths:
    """Lengths read off a request's arrays, for the engine's and the reader's request types."""

    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    routed_experts: np.ndarray

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def output_len(self) -> int:
        return int(self.output_token_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.routed_experts.shape[0])


@dataclass
class FinishedRequest(RequestLengths):
    """One ended request: its tokens and one routing row per token run through the model.

    ``routed_experts`` has shape ``(num_rows, num_moe_layers, top_k)`` in the
    trace's narrow dtype, rows in token order, experts in router order.  A
    request that finished normally has ``num_rows == len(prompt) + len(output) - 1``
    (the last sampled token is never run through the model); an aborted one has
    a row for each token it computed.
    """

    request_id: str
    index: int  # position of the request in the input (0-based), stable across resumes
    prompt_token_ids: np.ndarray  # int32 (prompt_len,)
    output_token_ids: np.ndarray  # int32 (output_len,)
    routed_experts: np.ndarray  # (num_rows, num_moe_layers, top_k), narrow unsigned dtype
    finish_reason: str  # one of FINISH_REASONS
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)
