"""The sampler: right distribution, filters, and draws that depend only on (seed, position)."""

from __future__ import annotations

import numpy as np
import torch

from moetrace.engine.sampler import SamplingBatch, sample, uniform_noise


def batch(
    n: int, *, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None
) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        seeds=torch.as_tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
        positions=torch.as_tensor(
            positions if positions is not None else [0] * n, dtype=torch.int64
        ),
        all_greedy=temperature == 0,
        any_top_k=top_k > 0,
        any_top_p=top_p < 1,
    )


def test_noise_is_uniform_and_a_function_of_its_inputs():
    seeds = torch.arange(64, dtype=torch.int64) * 1_000_003
    u = uniform_noise(seeds, torch.arange(64), 1000)
    assert ((u > 0) & (u < 1)).all()
    hist = np.histogram(u.numpy().ravel(), bins=10, range=(0, 1))[0]
    assert hist.min() > 0.9 * hist.mean()
    again = uniform_noise(seeds[10:20], torch.arange(10, 20), 1000)
    torch.testing.assert_close(u[10:20], again, rtol=0, atol=0)


def test_sampled_frequencies_follow_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().repeat(n, 1)
    picks = sample(logits, batch(n, seeds=np.arange(n) * 7 + 1))
    freq = torch.bincount(picks, minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.015), freq


def test_greedy_top_k_and_top_p():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 4000)
    assert (sample(logits, batch(4000, temperature=0.0)) == 1).all()
    top2 = sample(logits, batch(4000, top_k=2, seeds=np.arange(4000)))
    assert set(top2.tolist()) == {1, 2}
    # p = softmax([1, 3, 2, 0.5]) ≈ [0.087, 0.644, 0.237, 0.032]; top_p 0.7 keeps tokens 1 and 2.
    nucleus = sample(logits, batch(4000, top_p=0.7, seeds=np.arange(4000)))
    assert set(nucleus.tolist()) == {1, 2}


def test_a_row_samples_the_same_token_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    full = sample(logits, batch(8, seeds=[11] * 8, positions=list(range(8))))
    for i in range(8):
        alone = sample(logits[i : i + 1], batch(1, seeds=[11], positions=[i]))
        assert alone.item() == full[i].item()
