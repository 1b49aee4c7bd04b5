"""Token selection: greedy, temperature, top-k, top-p, reproducible per request.

Random draws come from a counter-based hash of (request seed, token position,
vocabulary index) instead of a stateful generator, so a request samples the
same tokens whatever else shares its batch, whether it was preempted, and on
any device.  Sampling is the exponential race: argmax of p / E with
E ~ Exp(1), which picks token i with probability p_i.
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


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token per row of ``logits`` [B, vocab] → int64 [B]."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    temperature = torch.where(
        batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature)
    )
    scaled = logits.to(torch.float32) / temperature[:, None]
    if batch.any_top_k:
        scaled = _apply_top_k(scaled, batch.top_k)
    if batch.any_top_p:
        scaled = _apply_top_p(scaled, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    race = probs.to(torch.float64) / -torch.log(
        uniform_noise(batch.seeds, batch.positions, logits.shape[-1])
    )
    sampled = race.argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy_ids)


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
