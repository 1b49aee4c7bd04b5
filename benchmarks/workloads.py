"""Prompt and output lengths of the benchmark workloads, seeded, shared by the benchmarks.

- ``uniform``: every prompt ``prompt_len`` tokens, every output ``output_len``;
- ``mixed``: prompt and output lengths uniform in ``[lo, hi]`` ranges (by
  default 64-448 and 64-192, the same means as the uniform 256 -> 128);
- ``longtail``: log-normal lengths around the same means, clipped to
  ``[8, 4 x mean]`` prompts and ``[4, 4 x mean]`` outputs, like chat logs;
- ``grpo``: RL rollouts (``benchmarks/rollouts.py``): ``--num-prompts`` prompts of
  ``--prompt-len`` tokens, each sampled ``--samples-per-prompt`` times as that many
  requests with the same prompt ids (so the prefix cache can share it); outputs
  long-tailed over ``--output-range`` (``rollout_lengths``).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

# What the one-sample benchmarks offer; ``grpo`` samples each prompt several times, which
# only a benchmark that samples (not greedy) and shares prefixes measures for what it is.
BATCH_WORKLOADS = ("uniform", "mixed", "longtail")
WORKLOADS = (*BATCH_WORKLOADS, "grpo")


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    *,
    num_prompts: int,
    choices: tuple[str, ...] = BATCH_WORKLOADS,
) -> None:
    parser.add_argument("--workload", choices=choices, default=choices[0])
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--prompt-len", type=int, default=256, help="uniform (and longtail mean)")
    parser.add_argument("--output-len", type=int, default=128, help="uniform (and longtail mean)")
    parser.add_argument("--prompt-range", default="64-448", help="mixed: prompt lengths lo-hi")
    parser.add_argument("--output-range", default="64-192", help="mixed: output lengths lo-hi")
    parser.add_argument("--workload-seed", type=int, default=0)
    if "grpo" in choices:
        parser.add_argument(
            "--samples-per-prompt", type=int, default=8, help="grpo: requests per prompt (n)"
        )


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    return lo, hi


def lengths(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths) of the workload, one pair per request."""
    n = args.num_prompts
    rng = np.random.default_rng(args.workload_seed)
    if args.workload == "grpo":
        n *= args.samples_per_prompt
        return np.full(n, args.prompt_len), rollout_lengths(n, *_range(args.output_range), rng)
    if args.workload == "uniform":
        return np.full(n, args.prompt_len), np.full(n, args.output_len)
    if args.workload == "mixed":
        (plo, phi), (olo, ohi) = _range(args.prompt_range), _range(args.output_range)
        return rng.integers(plo, phi + 1, n), rng.integers(olo, ohi + 1, n)
    p = rng.lognormal(np.log(args.prompt_len) - 0.5, 1.0, n)
    o = rng.lognormal(np.log(args.output_len) - 0.5, 1.0, n)
    p = np.clip(p, 8, 4 * args.prompt_len).astype(int)
    o = np.clip(o, 4, 4 * args.output_len).astype(int)
    return p, o


def rollout_lengths(count: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` output lengths of RL rollouts: log-normal, its median the geometric middle
    of ``[lo, hi]`` and its sigma a quarter of ``ln(hi / lo)``, so the range's ends lie two
    sigmas out and about 2.3% of draws are clipped to each (the long answers that hit the
    length limit, as rollouts do)."""
    mu = (np.log(lo) + np.log(hi)) / 2
    sigma = (np.log(hi) - np.log(lo)) / 4
    return np.clip(np.rint(rng.lognormal(mu, sigma, count)), lo, hi).astype(int)


def prompts(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Random token ids for each request (seeded), and each request's output length; the
    samples of one grpo prompt come one after another, with equal ids."""
    prompt_lens, output_lens = lengths(args)
    rng = np.random.default_rng(args.workload_seed + 1)
    group = args.samples_per_prompt if args.workload == "grpo" else 1
    distinct = [rng.integers(100, vocab_size - 100, int(n)).tolist() for n in prompt_lens[::group]]
    ids = [list(prompt) for prompt in distinct for _ in range(group)]
    return ids, [int(o) for o in output_lens]


def keep_last_plans(graphs) -> dict:
    """Remember the last step each padded size ran, so a benchmark can stage it again
    before replaying that size's graph alone (sizes share the static input buffers);
    ``with_known_tokens`` makes such a plan replayable once the run is over."""
    last: dict = {}
    run = graphs.run

    def remembering(plan, fill):
        last[graphs.bucket(plan.num_tokens)] = plan
        return run(plan, fill)

    graphs.run = remembering
    return last


def with_known_tokens(plan):
    """``plan`` with the tokens it left to the device (-1: still being sampled when it
    ran, filled in on the device) set to what was sampled, read from its requests."""
    missing = np.flatnonzero(plan.input_ids < 0)
    ids = plan.input_ids.copy()
    seq = np.searchsorted(plan.query_start, missing, side="right") - 1
    for i, b in zip(missing, seq, strict=True):
        ids[i] = plan.requests[b].token_ids[int(plan.positions[i])]
    return dataclasses.replace(plan, input_ids=ids)
