"""benchmarks/workloads.py's grpo workload: long-tailed output lengths, seeded and clipped
to their range; each prompt's samples queued together with equal ids."""

from __future__ import annotations

import argparse

import numpy as np
from support.benchmarks import benchmark_module

workloads = benchmark_module("workloads")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    workloads.add_workload_arguments(parser, num_prompts=4, choices=workloads.WORKLOADS)
    return parser.parse_args(["--workload", "grpo", *argv])


def test_rollout_lengths_are_seeded() -> None:
    draw = workloads.rollout_lengths
    same = draw(1000, 256, 8192, np.random.default_rng(3))
    assert same.tolist() == draw(1000, 256, 8192, np.random.default_rng(3)).tolist()
    assert same.tolist() != draw(1000, 256, 8192, np.random.default_rng(4)).tolist()


def test_rollout_lengths_are_clipped_to_the_range_and_long_tailed() -> None:
    lengths = workloads.rollout_lengths(100_000, 256, 8192, np.random.default_rng(0))
    assert lengths.min() == 256 and lengths.max() == 8192
    # Two sigmas out on either side: about 2.3% of draws land on each end.
    for end in (256, 8192):
        assert 0.018 < np.mean(lengths == end) < 0.028
    assert abs(np.median(lengths) / np.sqrt(256 * 8192) - 1) < 0.02
    assert lengths.mean() > 1.3 * np.median(lengths)  # the long tail pulls the mean up
    assert workloads.rollout_lengths(10, 300, 300, np.random.default_rng(0)).tolist() == [300] * 10


def test_grpo_queues_each_prompts_samples_together_with_equal_ids() -> None:
    args = _args(
        "--num-prompts",
        "3",
        "--samples-per-prompt",
        "4",
        "--prompt-len",
        "20",
        "--output-range",
        "5-50",
    )
    prompts, output_lens = workloads.prompts(args, vocab_size=1000)
    assert len(prompts) == len(output_lens) == 12
    groups = [prompts[i : i + 4] for i in range(0, 12, 4)]
    assert all(len(p) == 20 for p in prompts)
    assert all(g.count(g[0]) == 4 for g in groups)  # one prompt's samples: equal ids
    assert len({tuple(g[0]) for g in groups}) == 3  # distinct prompts
    assert len({id(p) for p in prompts}) == 12  # each request its own list
    assert all(5 <= n <= 50 for n in output_lens)
    assert len(set(output_lens)) > 1  # each sample its own length


def test_one_sample_workloads_draw_as_before() -> None:
    """Adding grpo left the other workloads' draws alone (figures stay comparable)."""
    args = _args("--workload", "mixed", "--num-prompts", "5")
    prompts, output_lens = workloads.prompts(args, vocab_size=1000)
    rng = np.random.default_rng(0)
    prompt_lens, expected_out = rng.integers(64, 449, 5), rng.integers(64, 193, 5)
    ids = np.random.default_rng(1)
    assert prompts == [ids.integers(100, 900, int(n)).tolist() for n in prompt_lens]
    assert output_lens == expected_out.tolist()
