"""Routing rows must not depend on how the engine batched, cached or preempted.

float64 makes ties and batch-order rounding differences impossible, so every
setting must give bit-identical rows, gate weights and tokens per request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import run_requests, shared_prefix_prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.float64)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=3, count=12)


@pytest.fixture(scope="module")
def baseline(model, prompts):
    done, engine = run_requests(
        model,
        prompts,
        enable_prefix_caching=False,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        capture_weights="float32",
    )
    engine.block_manager.check_no_leaks()
    return done


SETTINGS = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "small-steps": dict(max_num_batched_tokens=5, max_num_seqs=3),
    "many-seqs": dict(max_num_seqs=64, max_num_batched_tokens=2048),
    "block-size-16": dict(block_size=16, num_kv_blocks=64),
    "kv-pressure": dict(num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=16),
    "kv-pressure-prefix": dict(num_kv_blocks=12, max_num_seqs=8, enable_prefix_caching=True),
    "async": dict(async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=16),
    "async-kv-pressure": dict(
        async_scheduling=True, num_kv_blocks=12, max_num_seqs=8, enable_prefix_caching=True
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rows_and_tokens_identical_across_engine_settings(model, prompts, baseline, name):
    done, engine = run_requests(model, prompts, capture_weights="float32", **SETTINGS[name])
    engine.block_manager.check_no_leaks()
    assert set(done) == set(prompts)
    assert engine.stats.output_tokens == sum(f.output_len for f in done.values())
    for rid, ref in baseline.items():
        got = done[rid]
        np.testing.assert_array_equal(got.output_token_ids, ref.output_token_ids, err_msg=rid)
        np.testing.assert_array_equal(got.routed_experts, ref.routed_experts, err_msg=rid)
        np.testing.assert_array_equal(got.routed_weights, ref.routed_weights, err_msg=rid)
        assert got.routed_weights.dtype == np.float32 and got.routed_weights.min() > 0
        assert got.num_rows == got.prompt_len + got.output_len - 1


def test_kv_pressure_really_preempts(model, prompts):
    done, engine = run_requests(model, prompts, **SETTINGS["kv-pressure"])
    assert engine.stats.preemptions > 0
    assert any(f.num_preemptions for f in done.values())


def test_prefix_caching_really_hits(model, prompts):
    done, _ = run_requests(model, prompts, enable_prefix_caching=True, max_num_seqs=1)
    assert sum(f.num_cached_tokens for f in done.values()) > 0


def test_sampled_requests_are_batch_invariant(model, prompts):
    sampling = dict(temperature=0.9, top_p=0.95, top_k=20)
    a, _ = run_requests(model, prompts, sampling=sampling, max_num_seqs=1)
    b, _ = run_requests(model, prompts, sampling=sampling, **SETTINGS["kv-pressure"])
    for rid in prompts:
        np.testing.assert_array_equal(a[rid].output_token_ids, b[rid].output_token_ids)
        np.testing.assert_array_equal(a[rid].routed_experts, b[rid].routed_experts)


def test_aborted_requests_keep_the_rows_they_computed(model, prompts, baseline):
    from moetrace.config import EngineConfig
    from moetrace.engine.llm_engine import LLMEngine
    from moetrace.engine.sampling import SamplingParams

    engine = LLMEngine(
        model,
        EngineConfig(num_kv_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=16),
        torch.device("cpu"),
    )
    for i, (rid, ids) in enumerate(prompts.items()):
        engine.add_request(rid, ids, SamplingParams(max_tokens=6), index=i)
    finished = {}
    for _ in range(6):
        finished.update({f.request_id: f for f in engine.step()})
    live = [rid for rid in prompts if rid not in finished]
    assert live, "abort test needs requests still in flight"
    aborted = {f.request_id: f for f in engine.abort(live)}
    engine.block_manager.check_no_leaks()
    assert not engine.has_unfinished()
    for rid, f in aborted.items():
        assert f.finish_reason == "abort"
        ref = baseline[rid].routed_experts
        # Every row it kept is the row the uninterrupted run computed for that token.
        np.testing.assert_array_equal(f.routed_experts, ref[: f.num_rows])
    assert any(f.num_rows > 0 for f in aborted.values())


def test_two_live_engines_on_one_model_keep_their_own_cache_and_capture(model, prompts, baseline):
    """The benchmark keeps a capture and a no-capture engine on one model, stepped in turn.

    Each must run on its own KV cache and capturer: before the runner rebound
    them per step, creating the second engine took both from the first (the
    first then recorded nothing, and on the GPU its graphs replayed into a
    freed cache).
    """
    from moetrace.config import EngineConfig
    from moetrace.engine.llm_engine import LLMEngine
    from moetrace.engine.sampling import SamplingParams

    def engine(capture: bool) -> LLMEngine:
        config = EngineConfig(
            num_kv_blocks=64, block_size=4, max_num_seqs=3, capture_routing=capture
        )
        eng = LLMEngine(model, config, torch.device("cpu"))
        for index, (rid, ids) in enumerate(prompts.items()):
            eng.add_request(rid, ids, SamplingParams(max_tokens=6), index=index)
        return eng

    capturing, plain = engine(True), engine(False)
    done: dict[bool, dict] = {True: {}, False: {}}
    while capturing.has_unfinished() or plain.has_unfinished():
        for capture, eng in ((True, capturing), (False, plain)):
            if eng.has_unfinished():
                done[capture].update({f.request_id: f for f in eng.step()})
    for rid, ref in baseline.items():
        np.testing.assert_array_equal(done[True][rid].routed_experts, ref.routed_experts)
        for capture in (True, False):
            np.testing.assert_array_equal(done[capture][rid].output_token_ids, ref.output_token_ids)


def test_async_stats_count_only_the_tokens_kept(model, prompts):
    """A request that stops on a sampled token already has its next step in flight;
    the token that step samples is dropped, and must not count as output."""
    sampling = dict(temperature=1.0, seed=11, stop_token_ids=list(range(0, 97, 3)))
    done, engine = run_requests(
        model, prompts, max_tokens=12, sampling=sampling, async_scheduling=True, max_num_seqs=4
    )
    kept = sum(f.output_len for f in done.values())
    assert any(f.finish_reason == "stop" and f.output_len < 12 for f in done.values())
    assert engine.stats.output_tokens == kept


def test_samples_admitted_in_one_step_share_their_prompt_and_route_alike(model):
    """A prompt's n samples start in the same step: all but the first take its prompt blocks
    from the prefix cache (the first fills them in that very step), and every sample's rows,
    gate weights and tokens equal those of a run that caches nothing."""
    from moetrace.config import EngineConfig
    from moetrace.engine.llm_engine import LLMEngine
    from moetrace.engine.sampling import SamplingParams

    prompt = np.random.default_rng(5).integers(0, 97, size=29).tolist()  # 7 full blocks of 4
    params = SamplingParams(max_tokens=5, n=4, temperature=1.0, seed=3)
    runs = {}
    for caching in (False, True):
        config = EngineConfig(
            num_kv_blocks=64,
            block_size=4,
            enable_prefix_caching=caching,
            capture_weights="float32",
        )
        engine = LLMEngine(model, config, torch.device("cpu"))
        engine.add_request("p", prompt, params)
        runs[caching] = {(f.request_id, f.sample_index): f for f in engine.run()}
        engine.block_manager.check_no_leaks()
    shared, alone = runs[True], runs[False]
    assert sorted(f.num_cached_tokens for f in shared.values()) == [0, 28, 28, 28]
    assert all(f.num_cached_tokens == 0 for f in alone.values())
    for rid, want in alone.items():
        got = shared[rid]
        np.testing.assert_array_equal(got.output_token_ids, want.output_token_ids)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
        np.testing.assert_array_equal(got.routed_weights, want.routed_weights)
