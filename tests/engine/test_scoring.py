"""Scoring requests (teacher forcing): every given token runs, nothing is sampled.

float64 on the CPU, so rows and log-probabilities do not depend on batching:
a sequence scored equals the same sequence generated (rows bit for bit, the
generated tokens' log-probabilities to float32 rounding), under any engine
setting, chunked over many steps or not, with prefix hits, preemption and
asynchronous scheduling.  Forced routing routes through the given experts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import CPU, run_requests, shared_prefix_prompts, tiny_model

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.float64)


@pytest.fixture(scope="module")
def generated(model):
    """Requests generated with their log-probabilities: what scoring must reproduce."""
    prompts = shared_prefix_prompts(seed=4, count=10)
    done, _ = run_requests(model, prompts, sampling={"logprobs": 0}, max_tokens=7)
    return done


def score(model, sequences: dict, logprobs_from: dict, forced: dict | None = None, **engine):
    config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 4, **engine})
    eng = LLMEngine(model, config, CPU)
    for i, (rid, tokens) in enumerate(sequences.items()):
        eng.add_scoring_request(
            rid,
            tokens,
            logprobs_from=logprobs_from[rid],
            forced_experts=None if forced is None else forced[rid],
            index=i,
        )
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return done, eng


SETTINGS = {
    "one-step": dict(max_num_batched_tokens=512),
    "chunked": dict(max_num_batched_tokens=5, max_num_seqs=3),
    "prefix-cache": dict(enable_prefix_caching=True, max_num_seqs=2),
    "async": dict(async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_scoring_a_generated_sequence_gives_back_its_rows_and_logprobs(model, generated, name):
    sequences = {rid: [*f.prompt_token_ids, *f.output_token_ids] for rid, f in generated.items()}
    starts = {rid: f.prompt_len for rid, f in generated.items()}
    done, _ = score(model, {k: list(map(int, v)) for k, v in sequences.items()}, starts,
                         **SETTINGS[name])  # fmt: skip
    for rid, ref in generated.items():
        got = done[rid]
        n = ref.prompt_len + ref.output_len
        assert got.prompt_len == n and got.output_len == 0
        np.testing.assert_array_equal(got.routed_experts, ref.routed_experts, err_msg=rid)
        lp = got.prompt_logprobs
        assert lp.shape == (n,) and np.isnan(lp[: ref.prompt_len]).all()
        np.testing.assert_allclose(lp[ref.prompt_len :], ref.output_logprobs, rtol=1e-6)
    if name == "prefix-cache":  # shared prompts were served from the cache, short of the scores
        assert any(f.num_cached_tokens for f in done.values())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scoring_beside_generation_under_kv_pressure(model, generated, async_scheduling):
    """Generating requests grow into a small cache and preempt scoring ones mid-sequence."""
    config = EngineConfig(
        num_kv_blocks=12,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=8,
        async_scheduling=async_scheduling,
    )
    eng = LLMEngine(model, config, CPU)
    for rid, ref in generated.items():
        tokens = list(map(int, [*ref.prompt_token_ids, *ref.output_token_ids]))
        eng.add_request(f"gen-{rid}", tokens[:5], SamplingParams(max_tokens=20, ignore_eos=True))
        eng.add_scoring_request(rid, tokens, logprobs_from=ref.prompt_len)
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    assert sum(done[rid].num_preemptions for rid in generated) > 0
    for rid, ref in generated.items():
        np.testing.assert_array_equal(done[rid].routed_experts, ref.routed_experts, err_msg=rid)
        np.testing.assert_allclose(
            done[rid].prompt_logprobs[ref.prompt_len :], ref.output_logprobs, rtol=1e-6
        )


def test_scoring_from_the_first_token(model):
    """logprobs_from=1 scores every token but the first: a one-token prompt's generation."""
    gen, _ = run_requests(model, {"g": [5]}, max_tokens=8, sampling={"logprobs": 0})
    tokens = [5, *map(int, gen["g"].output_token_ids)]
    done, _ = score(model, {"s": tokens}, {"s": 1}, max_num_batched_tokens=3)
    lp = done["s"].prompt_logprobs
    assert np.isnan(lp[0]) and (lp[1:] <= 0).all()
    np.testing.assert_allclose(lp[1:], gen["g"].output_logprobs, rtol=1e-6)


def test_forcing_the_experts_the_router_picks_changes_nothing(model, generated):
    rid, ref = next(iter(generated.items()))
    tokens = list(map(int, [*ref.prompt_token_ids, *ref.output_token_ids]))
    free, _ = score(model, {rid: tokens}, {rid: 1})
    forced, _ = score(model, {rid: tokens}, {rid: 1}, {rid: ref.routed_experts},
                      force_routing=True)  # fmt: skip
    np.testing.assert_array_equal(forced[rid].routed_experts, ref.routed_experts)
    np.testing.assert_allclose(forced[rid].prompt_logprobs, free[rid].prompt_logprobs, rtol=1e-12)


def test_forced_experts_are_used_and_the_prefix_cache_keeps_them_apart(model):
    """Two requests with the same tokens and other forced experts never share a cached block."""
    tokens = list(range(3, 30))
    rng = np.random.default_rng(0)
    layers, k = len(model.moe_layer_indices), model.top_k
    rows = {
        rid: np.stack([rng.permutation(model.num_experts)[:k] for _ in range(len(tokens) * layers)])
        .reshape(len(tokens), layers, k)
        .astype(np.uint8)
        for rid in ("a", "b")
    }
    starts = {"a": 20, "b": 20}
    both, engine = score(model, {"a": tokens, "b": tokens}, starts, rows,
                         force_routing=True, max_num_seqs=1)  # fmt: skip
    alone, _ = score(model, {"b": tokens}, starts, rows, force_routing=True)
    for rid in ("a", "b"):
        np.testing.assert_array_equal(both[rid].routed_experts, rows[rid][: len(tokens) - 1])
    assert both["b"].num_cached_tokens == 0
    np.testing.assert_array_equal(both["b"].prompt_logprobs, alone["b"].prompt_logprobs)
    assert not np.allclose(both["a"].prompt_logprobs[20:], both["b"].prompt_logprobs[20:])
    same, _ = score(model, {"a": tokens, "b": tokens}, starts, {"a": rows["a"], "b": rows["a"]},
                    force_routing=True, max_num_seqs=1)  # fmt: skip
    assert same["b"].num_cached_tokens == 16  # same tokens and experts: served, short of scoring


def test_scoring_requests_are_checked(model):
    eng = LLMEngine(model, EngineConfig(num_kv_blocks=8, block_size=4), CPU)
    with pytest.raises(RequestRejected, match="at least 2 tokens"):
        eng.add_scoring_request("a", [5], logprobs_from=1)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        eng.add_scoring_request("a", [5, 500], logprobs_from=1)
    rows = np.zeros((3, len(model.moe_layer_indices), model.top_k), dtype=np.uint8)
    with pytest.raises(RequestRejected, match="without force_routing"):
        eng.add_scoring_request("a", [5, 6, 7, 8], logprobs_from=1, forced_experts=rows)
    forcing = LLMEngine(model, EngineConfig(num_kv_blocks=8, block_size=4, force_routing=True), CPU)
    with pytest.raises(RequestRejected, match="need \\[>= 4"):
        forcing.add_scoring_request("a", [5, 6, 7, 8, 9], logprobs_from=1, forced_experts=rows)
    with pytest.raises(RequestRejected, match="outside 0..7"):
        forcing.add_scoring_request("a", [5, 6, 7, 8], logprobs_from=1, forced_experts=rows + 8)
