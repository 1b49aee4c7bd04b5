"""Teacher forcing: which positions of a step give wanted log-probabilities, and computing them.

A scoring request (``request.Scoring``) wants the log-probability of each of
its tokens from ``logprobs_from`` on, given the tokens before it: token
``p + 1`` is scored by the logits at position ``p``.  A step computes them for
the positions it runs, so a long request is scored chunk by chunk.  Logits are
made a slice of rows at a time, so a prefill of thousands of scored positions
never holds ``[positions, vocab]`` at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moetrace.config import EngineConfig
from moetrace.engine.request import Request
from moetrace.engine.staging import StagingRing
from moetrace.engine.step_plan import StepPlan
from moetrace.layers.forced_routing import ForcedRouting
from moetrace.models.base import MoEForCausalLM


@dataclass
class ScoreTargets:
    """The scored positions of one step, and whose they are."""

    rows: np.ndarray  # int64 [R]: packed index, in the step, of each scored position
    targets: np.ndarray  # int64 [R]: the token that follows it (the one scored)
    spans: list[tuple[Request, int, int]]  # (request, its first scored token, how many)

    def store(self, values: np.ndarray) -> None:
        """Hand each request its slice of the step's log-probabilities."""
        offset = 0
        for request, first, count in self.spans:
            request.scoring.logprobs[first : first + count] = values[offset : offset + count]
            offset += count


def score_targets(plan: StepPlan) -> ScoreTargets | None:
    """The step's positions whose next token is a wanted log-probability (None: none)."""
    rows, targets, spans = [], [], []
    for b, request in enumerate(plan.requests):
        scoring = request.scoring
        if scoring is None:
            continue
        lo, hi = int(plan.query_start[b]), int(plan.query_start[b + 1])
        start = int(plan.positions[lo])
        first = max(start, scoring.logprobs_from - 1)  # first scored position
        last = start + (hi - lo)  # one past the last position run
        if first >= last:
            continue
        rows.append(np.arange(lo + first - start, hi, dtype=np.int64))
        targets.append(np.asarray(request.token_ids[first + 1 : last + 1], dtype=np.int64))
        spans.append((request, first + 1, last - first))
    if not spans:
        return None
    return ScoreTargets(np.concatenate(rows), np.concatenate(targets), spans)


def forced_rows(plan: StepPlan) -> tuple[np.ndarray, np.ndarray] | None:
    """(``[T, L, k]`` experts, ``[T]`` mask) forcing the step's tokens of requests that force
    routing; None when no token of the step is forced."""
    owners = [(b, r.scoring.forced_experts) for b, r in enumerate(plan.requests) if r.scoring]
    owners = [(b, f) for b, f in owners if f is not None]
    if not owners:
        return None
    shape = owners[0][1].shape[1:]
    ids = np.zeros((plan.num_tokens, *shape), dtype=np.int64)
    mask = np.zeros(plan.num_tokens, dtype=np.int64)
    for b, forced in owners:
        lo, hi = int(plan.query_start[b]), int(plan.query_start[b + 1])
        ids[lo:hi] = forced[plan.positions[lo:hi]]
        mask[lo:hi] = 1
    return ids, mask


@torch.inference_mode()
def score_logprobs(
    model: MoEForCausalLM,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    slice_rows: int,
) -> torch.Tensor:
    """float32 ``[R]``: log-probability of ``targets[i]`` under the logits of ``hidden[rows[i]]``.

    From the raw distribution, computed as the sampler computes a sampled
    token's (``sampler.token_logprobs``), ``slice_rows`` rows at a time.
    """
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
    for lo in range(0, rows.shape[0], slice_rows):
        hi = min(lo + slice_rows, rows.shape[0])
        logits = model.compute_logits(hidden.index_select(0, rows[lo:hi]))
        raw = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
        out[lo:hi] = raw.gather(1, targets[lo:hi, None])[:, 0]
    return out


@dataclass
class StepScores:
    """A step's scored log-probabilities on their way to the host."""

    targets: ScoreTargets
    values: torch.Tensor  # float32 [R], on the host once ``done`` fired
    done: torch.cuda.Event | None

    def store(self) -> None:
        if self.done is not None:
            self.done.synchronize()
        self.targets.store(self.values.numpy())


class TeacherForcing:
    """The model runner's side of scoring requests: forced routing in, log-probabilities out.

    ``prepare`` says whether a step needs every position's hidden state (it
    scores or forces something) and loads the forced experts; ``score`` turns
    the hidden states into the step's log-probabilities.
    """

    def __init__(self, model: MoEForCausalLM, config: EngineConfig, device: torch.device) -> None:
        self.device = device
        # Logits of a slice in the model dtype plus their float32 log-softmax: about what the
        # memory profile's logits of max_num_seqs rows take (engine/memory.py).
        self.slice_rows = max(1, config.max_num_seqs // 4)
        self.forced: ForcedRouting | None = None
        if config.force_routing:
            self.forced = ForcedRouting(
                config.max_num_batched_tokens, len(model.moe_layer_indices), model.top_k, device
            )
        self._staging = StagingRing(0, device)

    def prepare(self, plan: StepPlan) -> tuple[bool, ScoreTargets | None]:
        """(whether the step runs scoring requests, what it scores); loads the forced experts.

        A step with a scoring request runs eagerly: forced routing and all
        positions' hidden states are not what a captured graph replays.
        """
        if not any(r.scoring is not None for r in plan.requests):
            return False, None
        forced = forced_rows(plan)
        if forced is not None:
            if self.forced is None:
                raise RuntimeError("a request forces routing; the engine was built without it")
            ids, mask = self._staging.stage(list(forced))
            self.forced.load(ids, mask)
        return True, score_targets(plan)

    def done_forcing(self) -> None:
        if self.forced is not None:
            self.forced.clear()

    def score(
        self, model: MoEForCausalLM, hidden: torch.Tensor, targets: ScoreTargets
    ) -> StepScores:
        rows, tokens = self._staging.stage([targets.rows, targets.targets])
        values = score_logprobs(model, hidden, rows, tokens, self.slice_rows)
        if self.device.type != "cuda":
            return StepScores(targets, values, None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return StepScores(targets, host, done)
