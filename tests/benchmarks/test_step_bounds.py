"""benchmarks/step_bounds.py: a step's FLOPs and bytes, worked by hand, and a model's
costs against the arithmetic of its config."""

from __future__ import annotations

import numpy as np
import torch
from support.benchmarks import benchmark_module
from support.engine import tiny_model

sb = benchmark_module("step_bounds")

# Two attention layers, the second with a 4-token window; two MoE layers.
COSTS = sb.ModelCosts(
    dense_bytes=1000,
    dense_flops_per_token=10,
    embedding_row_bytes=4,
    head_bytes=500,
    head_flops_per_row=100,
    expert_bytes=np.array([50, 60]),
    expert_flops_per_token=20,
    kv_bytes_per_token=np.array([8, 8]),
    attention_flops_per_key=np.array([3, 3]),
    windows=np.array([0, 4]),
)
# A prompt chunk at positions 2..5 beside a decode at position 9.
STEP = sb.StepShape(
    new_tokens=np.array([4, 1]),
    seq_lens=np.array([6, 10]),
    sampled_rows=2,
    experts_reached=np.array([3, 5]),
)


def test_a_steps_flops_by_hand() -> None:
    weights = 5 * (10 + 20)  # five tokens through the dense weights and their top-k experts
    head = 2 * 100
    full = 3 * ((3 + 4 + 5 + 6) + 10)  # keys each query attends: its position + 1
    window = 3 * ((3 + 4 + 4 + 4) + 4)  # at most 4
    assert sb.step_flops(COSTS, STEP) == weights + head + full + window == 491


def test_a_steps_bytes_by_hand() -> None:
    weights = 1000 + 5 * 4 + 500 + (3 * 50 + 5 * 60)
    full = 8 * ((6 + 10) + 5)  # each context once, then the five keys written
    window = 8 * ((6 + 4) + 5)  # the chunk's queries reach back to position 0; the decode 6..9
    assert sb.step_bytes(COSTS, STEP) == weights + full + window == 2258


def test_the_bound_is_the_slower_of_the_two() -> None:
    rates = sb.DeviceRates(flops_per_s=491 / 2, bytes_per_s=2258)
    assert sb.step_bound(COSTS, STEP, rates) == (2.0, 1.0)


def test_a_step_that_samples_nothing_skips_the_head() -> None:
    chunk = sb.StepShape(np.array([4]), np.array([4]), 0, np.array([2, 2]))
    assert sb.step_bytes(COSTS, chunk) == 1000 + 16 + 220 + 8 * (4 + 4) * 2
    assert sb.step_flops(COSTS, chunk) == 4 * 30 + 2 * 3 * (1 + 2 + 3 + 4)


def test_closed_forms_match_counting_every_query() -> None:
    rng = np.random.default_rng(0)
    for window in (0, 1, 5, 64):
        start = rng.integers(0, 200, 50)
        end = start + rng.integers(1, 100, 50)
        attended = [
            sum(min(p + 1, window) if window else p + 1 for p in range(s, e))
            for s, e in zip(start, end, strict=True)
        ]
        read = [
            len(
                {
                    k
                    for p in range(s, e)
                    for k in range(max(0, p - window + 1) if window else 0, p + 1)
                }
            )
            for s, e in zip(start, end, strict=True)
        ]
        assert sb.keys_attended(start, end, window).tolist() == attended
        assert sb.keys_read(start, end, window).tolist() == read


def test_model_costs_follow_the_config() -> None:
    # hidden 32, 4 heads and 2 KV heads of 8, experts of width 16 (8, top-2), a dense MLP
    # of 48 in layer 1 of 3, vocabulary 97, float32
    costs = sb.model_costs(tiny_model(torch.float32))
    attention = 32 * 32 + 2 * (16 * 32) + 32 * 32  # q, k, v, o
    matrices = 3 * attention + 2 * (8 * 32) + 3 * 32 * 48  # + routers of layers 0, 2 + MLP
    vectors = 3 * (8 + 8 + 32 + 32) + 32  # q/k norms, two norms a layer, the final norm
    assert costs.dense_bytes == 4 * (matrices + vectors)
    assert costs.dense_flops_per_token == 2 * matrices
    assert costs.embedding_row_bytes == 32 * 4
    assert (costs.head_bytes, costs.head_flops_per_row) == (97 * 32 * 4, 2 * 97 * 32)
    assert costs.expert_bytes.tolist() == [3 * 32 * 16 * 4] * 2
    assert costs.expert_flops_per_token == 2 * (2 * 2 * 3 * 32 * 16)
    assert costs.kv_bytes_per_token.tolist() == [2 * 2 * 8 * 4] * 3
    assert costs.attention_flops_per_key.tolist() == [4 * 4 * 8] * 3
    assert costs.windows.tolist() == [0, 0, 0]
