"""Each step's ``SamplingBatch``, built from the requests that sample in it.

Per-row settings travel to the device in one pinned, non-blocking copy (a
copy from pageable memory would wait for the stream, stalling asynchronous
scheduling).  Penalties need each request's output token counts; those stay
on the device in ``PenaltyState`` between steps and take each sampled token
there, so even a token still in flight (asynchronous scheduling) is counted
without the host ever waiting for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moetrace.engine.request import Request
from moetrace.engine.sampler import Penalties, SamplingBatch
from moetrace.engine.staging import StagingRing

_U64 = 1 << 64


def request_seed(global_seed: int, index: int) -> int:
    """Seed of a request that gave none: fixed by the run seed and its input position."""
    return (global_seed * 1_000_003 + index * 7919 + 17) & 0x7FFFFFFFFFFFFFFF


def effective_seed(request: Request, global_seed: int) -> int:
    """The seed a request samples with: its own, else one the run seed gives its position."""
    if request.sampling.seed is not None:
        return request.sampling.seed
    return request_seed(global_seed, request.index) + request.sample_index


def _signed64(value: int) -> int:
    """A seed in [0, 2**64) (or any int) as the int64 with the same bits."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


def _floats(values: Sequence[float]) -> np.ndarray:
    """float64 values carried as int64 bits through the int64 staging buffer."""
    return np.asarray(values, dtype=np.float64).view(np.int64)


class PenaltyState:
    """Output token counts and prompt masks of penalized requests, one device row each.

    A row is given to a request when it first samples and taken back only
    once that request has finished, so a row is never reused while a step
    that samples for its owner may still be in flight.  Rows grow in number
    as needed (``vocab_size`` int32 counts and bools each).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._owners: list[Request | None] = []

    def slots(self, requests: Sequence[Request]) -> tuple[list[int], list[Request]]:
        """Each request's row, and the requests that just got a fresh one (to fill)."""
        held = {id(r): i for i, r in enumerate(self._owners) if r is not None}
        slots, fresh = [], []
        for request in requests:
            slot = held.get(id(request))
            if slot is None:
                slot = self._free_slot()
                self._owners[slot] = request
                held[id(request)] = slot
                fresh.append(request)
            slots.append(slot)
        return slots, fresh

    def _free_slot(self) -> int:
        for i, owner in enumerate(self._owners):
            if owner is None or owner.is_finished:
                self._owners[i] = None
                return i
        grow = max(1, len(self._owners))
        self.counts = torch.cat([self.counts, self.counts.new_zeros((grow, self.vocab_size))])
        self.prompt_mask = torch.cat(
            [self.prompt_mask, self.prompt_mask.new_zeros((grow, self.vocab_size))]
        )
        self._owners.extend([None] * grow)
        return len(self._owners) - grow

    def fill(
        self,
        slots: torch.Tensor,
        prompt: tuple[torch.Tensor, torch.Tensor],
        output: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Reset fresh rows, mark their prompt tokens, count their output tokens known so far.

        ``prompt`` and ``output`` are (row, token id) pairs, staged from the host.
        """
        self.counts.index_fill_(0, slots, 0)
        self.prompt_mask.index_fill_(0, slots, False)
        self.prompt_mask.index_put_(prompt, self.prompt_mask.new_ones(()))
        ones = torch.ones_like(output[1], dtype=torch.int32)
        self.counts.index_put_(output, ones, accumulate=True)


class SamplingInputs:
    """Builds the sampling batch of each step (owned by the model runner)."""

    def __init__(self, vocab_size: int, device: torch.device, global_seed: int) -> None:
        self.device = device
        self.global_seed = global_seed
        self.staging = StagingRing(1024, device)
        self.penalty_state = PenaltyState(vocab_size, device)

    def seed(self, request: Request) -> int:
        return effective_seed(request, self.global_seed)

    def build(self, requests: Sequence[Request]) -> SamplingBatch:
        params = [r.sampling for r in requests]
        num = len(params)
        dev = self.device
        all_greedy = all(p.greedy for p in params)
        # Tokens chosen before this one: the scheduler already counts this step's placeholder.
        before = [r.num_scheduled_tokens - 1 - r.num_prompt_tokens for r in requests]
        banned = [
            (row, token)
            for row, (r, p, n) in enumerate(zip(requests, params, before, strict=True))
            if n < p.min_tokens
            for token in sorted(r.stop_token_ids)
        ]
        penalized = [row for row, p in enumerate(params) if p.penalized]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        arrays: dict[str, np.ndarray] = {}
        if not all_greedy:
            arrays.update(
                temperature=_floats([p.temperature for p in params]),
                top_k=np.asarray([p.top_k for p in params], dtype=np.int64),
                top_p=_floats([p.top_p for p in params]),
                min_p=_floats([p.min_p for p in params]),
                seeds=np.asarray([_signed64(self.seed(r)) for r in requests], dtype=np.int64),
                positions=np.asarray([r.num_scheduled_tokens - 1 for r in requests], np.int64),
            )
        if banned:
            arrays["banned"] = np.asarray(banned, dtype=np.int64).T.copy()
        fresh: list[Request] = []
        if penalized:
            slots, fresh = self.penalty_state.slots([requests[i] for i in penalized])
            arrays.update(
                pen_rows=np.asarray(penalized, dtype=np.int64),
                pen_slots=np.asarray(slots, dtype=np.int64),
                presence=_floats([params[i].presence_penalty for i in penalized]),
                frequency=_floats([params[i].frequency_penalty for i in penalized]),
                repetition=_floats([params[i].repetition_penalty for i in penalized]),
            )
            if fresh:
                arrays.update(
                    self._fresh_rows(fresh, dict(zip(penalized, slots, strict=True)), requests)
                )
        staged = (
            dict(zip(arrays, self.staging.stage(list(arrays.values())), strict=True))
            if arrays
            else {}
        )

        def as_float(name: str) -> torch.Tensor:
            return staged[name].view(torch.float64).to(torch.float32)

        if all_greedy:
            zeros_f = torch.zeros(num, device=dev)
            zeros_i = torch.zeros(num, dtype=torch.int64, device=dev)
            batch = SamplingBatch(zeros_f, zeros_i, zeros_f, zeros_i, zeros_i, True, False, False)
        else:
            batch = SamplingBatch(
                temperature=as_float("temperature"),
                top_k=staged["top_k"],
                top_p=as_float("top_p"),
                seeds=staged["seeds"],
                positions=staged["positions"],
                all_greedy=False,
                any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
                any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
                min_p=as_float("min_p") if any(p.min_p > 0 for p in params) else None,
            )
        if banned:
            batch.banned = (staged["banned"][0], staged["banned"][1])
        if penalized:
            state = self.penalty_state
            if fresh:
                state.fill(
                    staged["fresh_slots"],
                    (staged["prompt_slots"], staged["prompt_ids"]),
                    (staged["output_slots"], staged["output_ids"]),
                )
            batch.penalties = Penalties(
                rows=staged["pen_rows"],
                slots=staged["pen_slots"],
                presence=as_float("presence"),
                frequency=as_float("frequency"),
                repetition=as_float("repetition"),
                counts=state.counts,
                prompt_mask=state.prompt_mask,
            )
        batch.num_logprobs = max(logprobs) if logprobs else None
        return batch

    def _fresh_rows(
        self, fresh: list[Request], slot_of_row: dict[int, int], requests: Sequence[Request]
    ) -> dict[str, np.ndarray]:
        """Host arrays that fill the penalty rows of requests sampling for the first time."""
        slot_of = {id(requests[row]): slot for row, slot in slot_of_row.items()}
        fresh_slots = [slot_of[id(r)] for r in fresh]
        prompts = [r.token_ids[: r.num_prompt_tokens] for r in fresh]
        outputs = [r.output_token_ids for r in fresh]  # those already on the host (normally none)
        return {
            "fresh_slots": np.asarray(fresh_slots, dtype=np.int64),
            "prompt_slots": np.repeat(fresh_slots, [len(p) for p in prompts]).astype(np.int64),
            "prompt_ids": np.asarray([t for p in prompts for t in p], dtype=np.int64),
            "output_slots": np.repeat(fresh_slots, [len(o) for o in outputs]).astype(np.int64),
            "output_ids": np.asarray([t for o in outputs for t in o], dtype=np.int64),
        }
