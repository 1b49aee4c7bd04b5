"""Token selection (greedy, temperature, min-p, top-k, top-p, penalties), reproducible per request.

Random draws come from a counter-based hash of (request seed, token position,
vocabulary index) instead of a stateful generator, so a request samples the
same tokens whatever else shares its batch, whether it was preempted, and on
any device.  Sampling is the exponential race: argmax of p / E with
E ~ Exp(1), which picks token i with probability p_i.  Penalties, banned
stop tokens and log-probabilities are row-wise too, so they keep that
property; everything runs on the device, with no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser with good avalanche (xor-shift-multiply)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 in (0, 1), shape [B, vocab]: a pure function of its three inputs."""
    seeds = seeds.to(torch.int64)
    key = mix32(mix32(mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)) ^ (positions & _MASK32))
    vocab = mix32(
        (torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x9E3779B9) & _MASK32
    )
    bits = mix32(key[:, None] ^ vocab[None, :])
    return (bits.to(torch.float64) + 0.5) / float(1 << 32)


@dataclass
class Penalties:
    """The penalized rows of a step, with their requests' token counts on the device.

    ``counts`` and ``prompt_mask`` are the rows of ``PenaltyState`` (one per
    penalized request, kept between steps); ``slots`` picks each batch row's.
    """

    rows: torch.Tensor  # int64 [P]: batch rows with a penalty
    slots: torch.Tensor  # int64 [P]: their rows in counts / prompt_mask
    presence: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    repetition: torch.Tensor  # float32 [P]
    counts: torch.Tensor  # int32 [S, vocab]: occurrences in each request's output
    prompt_mask: torch.Tensor  # bool [S, vocab]: tokens of each request's prompt

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's order: repetition, then frequency, then presence; other rows untouched."""
        sub = logits.index_select(0, self.rows)  # [P, vocab]
        counts = self.counts.index_select(0, self.slots)
        in_output = counts > 0
        seen = in_output | self.prompt_mask.index_select(0, self.slots)
        rep = self.repetition[:, None]
        sub = sub * torch.where(seen, torch.where(sub > 0, 1.0 / rep, rep), 1.0)
        sub = sub - self.frequency[:, None] * counts - self.presence[:, None] * in_output
        return logits.index_put((self.rows,), sub)

    def count(self, sampled: torch.Tensor) -> None:
        """Add each penalized row's new token to its request's counts, on the device."""
        tokens = sampled.index_select(0, self.rows)
        ones = torch.ones_like(tokens, dtype=self.counts.dtype)
        self.counts.index_put_((self.slots, tokens), ones, accumulate=True)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors."""

    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    top_k: torch.Tensor  # int64 [B]; <= 0 = off
    top_p: torch.Tensor  # float32 [B]; 1 = off
    seeds: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]: index of the token being chosen in its request
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None  # float32 [B]; 0 = off; None: off for every row
    # (rows, token ids) that may not be chosen yet: stop tokens before min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    num_logprobs: int | None = None  # top log-probabilities to return per row; None: none


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token per row of ``logits`` [B, vocab] → int64 [B].

    vLLM's order: stop tokens banned before ``min_tokens``, penalties, then
    greedy or temperature, ``min_p``, top-k, top-p and the draw.  Rows are
    independent of each other throughout.  With penalties, the counts of the
    penalized requests take the chosen tokens (on the device).
    """
    if batch.banned is not None or batch.penalties is not None:
        if logits.dtype in (torch.float16, torch.bfloat16):  # as vLLM: adjust in float32
            logits = logits.to(torch.float32)
        if batch.banned is not None:
            logits = logits.index_put(batch.banned, logits.new_full((), float("-inf")))
        if batch.penalties is not None:
            logits = batch.penalties.apply(logits)
    chosen = logits.argmax(dim=-1)
    if not batch.all_greedy:
        chosen = torch.where(batch.temperature > 0, _draw(logits, batch), chosen)
    if batch.penalties is not None:
        batch.penalties.count(chosen)
    return chosen


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temperature = torch.where(
        batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature)
    )
    scaled = logits.to(torch.float32) / temperature[:, None]
    if batch.min_p is not None:
        scaled = _apply_min_p(scaled, batch.min_p)
    if batch.any_top_k:
        scaled = _apply_top_k(scaled, batch.top_k)
    if batch.any_top_p:
        scaled = _apply_top_p(scaled, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    race = probs.to(torch.float64) / -torch.log(
        uniform_noise(batch.seeds, batch.positions, logits.shape[-1])
    )
    return race.argmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@dataclass
class Logprobs:
    """Log-probabilities of one step's sampled tokens, as vLLM returns them (device tensors)."""

    token_logprob: torch.Tensor  # float32 [B]: of the sampled token
    token_rank: torch.Tensor  # int64 [B]: 1 + tokens more likely than it (ties count)
    top_ids: torch.Tensor  # int64 [B, N]: the N most likely tokens, most likely first
    top_logprobs: torch.Tensor  # float32 [B, N]

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_logprob, self.token_rank, self.top_ids, self.top_logprobs]


def token_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num: int) -> Logprobs:
    """From the model's raw distribution (before penalties and temperature), as vLLM's default."""
    raw = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    chosen = raw.gather(1, sampled[:, None])
    rank = (raw >= chosen).sum(dim=-1)
    top_logprobs, top_ids = raw.topk(num, dim=-1) if num else (raw[:, :0], sampled[:, None][:, :0])
    return Logprobs(chosen[:, 0], rank, top_ids, top_logprobs)
