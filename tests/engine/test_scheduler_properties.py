"""Property-based tests of the scheduler, block manager and routing bookkeeping.

Hypothesis draws workloads (arrival steps, prompt lengths, shared prefixes,
max_tokens, aborts) and engine settings (block size, KV blocks down to the
least one request needs, step token budgets, sequence limits, prefix
caching).  For each, the invariants are:

- every request ends exactly once: finished (stop/length) or reported aborted;
- a finished request's tokens and rows equal a solo reference run's; an
  aborted one's are a prefix of them;
- after every step, reference counts equal the number of live block tables
  holding each block, the free list is exactly the unreferenced blocks, and
  every cached hash points at a block registered under it;
- at the end nothing is held: no block, no snapshot, no hash memo.

The fast tests replace the model runner with ``CausalFake``: a stand-in model
whose KV cache is real (it reads what earlier steps wrote into the slots), so
a stale row, a prefix-cache hit on the wrong block or a slot overwritten too
early changes rows and tokens and is caught.  A slower test runs the same
properties through the real tiny Qwen3-MoE model against solo runs.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine import CPU, run_requests, tiny_model

from moetrace.capture.types import RoutedExpertsLists
from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.request import RequestStatus
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.scheduler import SchedulerOutput

VOCAB = 13  # small: long shared prefixes and frequent EOS
EOS = 0
# MOETRACE_PROPERTY_EXAMPLES raises the counts for a long campaign (docs/reliability.md).
EXAMPLES = int(os.environ.get("MOETRACE_PROPERTY_EXAMPLES", "250"))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- the fake model
def _state(previous: int, token: int) -> int:
    """What a slot holds: a digest of every token up to and including this one."""
    return zlib.crc32(token.to_bytes(4, "little"), previous)


def _row(state: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    rng = np.random.default_rng(state)
    return np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)]).astype(np.uint8)


def _next_token(state: int) -> int:
    return (state * 2654435761 >> 11) % VOCAB


@dataclass
class FakeStep:
    """What ``ModelRunner.launch`` returns, as far as the engine uses it."""

    output: SchedulerOutput
    routing: RoutedExpertsLists
    sampled: dict[str, int]
    scores = None  # no scoring requests here

    def finish(self) -> dict[str, int]:
        return self.sampled

    def logprobs(self) -> None:
        return None  # no request here asks for log-probabilities


class CausalFake:
    """Stands in for ``ModelRunner``: each token's row and the next token follow from its slot.

    Computing position p reads the state the slot of p - 1 holds (in this step
    or an earlier one, possibly in a block shared through the prefix cache),
    so it only matches the reference if the KV bookkeeping is right.  A token
    still being sampled (asynchronous scheduling) is read from the step in
    flight, as the real runner reads it on the device.
    """

    def __init__(self, engine: LLMEngine) -> None:
        model = engine.model
        self.shape = (len(model.moe_layer_indices), model.top_k, model.num_experts)
        self.block_size = engine.config.block_size
        self.kv = np.full(engine.block_manager.num_blocks * self.block_size, -1, dtype=np.int64)

    def capture_graphs(self) -> None:
        return None

    def launch(
        self, output: SchedulerOutput, block_epochs: np.ndarray, previous: FakeStep | None
    ) -> FakeStep:
        bs = self.block_size
        rows, slots, epochs, sampled = [], [], [], {}
        in_flight = previous.sampled if previous is not None else {}
        for item in output.scheduled:
            request = item.request
            table = request.block_table
            start = item.num_computed_before
            for pos in range(start, start + item.num_new_tokens):
                if pos < request.num_tokens:
                    token = request.token_ids[pos]
                else:
                    assert pos == request.num_tokens, f"{request}: {pos} is two tokens ahead"
                    token = in_flight[request.request_id]
                slot = table[pos // bs] * bs + pos % bs
                if pos == 0:
                    before = 0
                else:
                    prev_slot = table[(pos - 1) // bs] * bs + (pos - 1) % bs
                    before = int(self.kv[prev_slot])
                    assert before >= 0, f"{request}: reads slot {prev_slot} never written"
                state = _state(before, token)
                self.kv[slot] = state
                rows.append(_row(state, *self.shape))
                slots.append(slot)
                epochs.append(block_epochs[table[pos // bs]])
            if item.samples:
                sampled[request.request_id] = _next_token(state)
        L, k, _ = self.shape
        routing = np.asarray(rows, dtype=np.uint8).reshape(-1, L, k)
        lists = RoutedExpertsLists(
            routing, np.asarray(slots, dtype=np.int64), np.asarray(epochs, dtype=np.int64), _noop
        )
        return FakeStep(output, lists, sampled)


def _noop() -> None:
    return None


def solo_reference(prompt: list[int], max_tokens: int, shape) -> tuple[list[int], np.ndarray]:
    """Tokens and rows of the request run alone, straight from the fake model's definition."""
    tokens, rows, state = list(prompt), [], 0
    i = 0
    while True:
        while i < len(tokens):
            state = _state(state, tokens[i])
            rows.append(_row(state, *shape))
            i += 1
        tokens.append(_next_token(state))
        out = len(tokens) - len(prompt)
        if tokens[-1] == EOS or out >= max_tokens:
            break
    L, k, _ = shape
    return tokens, np.asarray(rows[: len(tokens) - 1], dtype=np.uint8).reshape(-1, L, k)


# --------------------------------------------------------------------------- invariants
def check_block_invariants(engine: LLMEngine) -> None:
    bm = engine.block_manager
    held = np.zeros(bm.num_blocks, dtype=np.int64)
    for request in engine._requests.values():
        if request.status is RequestStatus.RUNNING:
            assert len(request.block_table) * bm.block_size >= request.num_computed_tokens
        else:
            assert request.block_table == [], f"{request} waits but holds blocks"
        for block in request.block_table:
            held[block] += 1
    np.testing.assert_array_equal(bm.ref_counts, held, err_msg="reference counts drifted")
    free = set(bm._free)
    assert free == set(np.flatnonzero(held == 0).tolist()), "free list != unreferenced blocks"
    for h, block in bm._cached.items():
        assert bm._block_key[block][0] == h, f"cached hash {h} points at block {block} keyed else"


def check_nothing_held(engine: LLMEngine) -> None:
    engine.block_manager.check_no_leaks()
    assert not engine._requests
    assert not engine.has_unfinished()
    assert not engine.routing_cache._snapshots, "routing snapshots leaked"
    assert not engine.block_manager._hashes, "per-request hash memo leaked"


# --------------------------------------------------------------------------- workloads
@st.composite
def workloads(draw, max_requests: int = 8, max_prompt: int = 24):
    """Requests (prompt, max_tokens, arrival step) with shared stems, plus abort events."""
    stems = draw(
        st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_prompt),
            min_size=1,
            max_size=3,
        )
    )
    n = draw(st.integers(1, max_requests))
    requests = []
    for i in range(n):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=6))
        prompt = (stem[:cut] + tail)[:max_prompt] or [draw(st.integers(1, VOCAB - 1))]
        requests.append((f"r{i}", prompt, draw(st.integers(1, 8)), draw(st.integers(0, 12))))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, n - 1)), max_size=3))
    return requests, aborts


@st.composite
def engine_settings(draw, requests):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    need = max(-(-(len(p) + m - 1) // block_size) for _, p, m, _ in requests)
    return dict(
        block_size=block_size,
        num_kv_blocks=need + draw(st.integers(0, 12)),  # down to one request's worth
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
    )


def drive(engine: LLMEngine, requests, aborts, *, check_every_step: bool = True):
    """Add requests at their arrival steps, abort on schedule, step until idle."""
    by_step: dict[int, list] = {}
    for req in requests:
        by_step.setdefault(req[3], []).append(req)
    abort_at: dict[int, set[str]] = {}
    for step, i in aborts:
        abort_at.setdefault(step, set()).add(requests[i][0])
    ended: dict[str, object] = {}
    step = 0
    while by_step or engine.has_unfinished():
        if not engine.has_unfinished() and step not in by_step:
            step = min(by_step)  # idle: jump to the next arrival
        for rid, prompt, max_tokens, _ in by_step.pop(step, []):
            engine.add_request(
                rid, prompt, SamplingParams(max_tokens=max_tokens), index=int(rid[1:])
            )
        if step in abort_at:
            for f in engine.abort(abort_at[step]):
                assert f.request_id not in ended, f"{f.request_id} ended twice"
                ended[f.request_id] = f
        if engine.has_unfinished():
            for f in engine.step():
                assert f.request_id not in ended, f"{f.request_id} ended twice"
                ended[f.request_id] = f
            if check_every_step:
                check_block_invariants(engine)
        step += 1
        assert step < 20_000, "no progress"
    return ended


def fake_engine(model, **settings_) -> LLMEngine:
    engine = LLMEngine(model, EngineConfig(**settings_), CPU, eos_token_ids=(EOS,))
    engine.runner = CausalFake(engine)
    return engine


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.float32)


# --------------------------------------------------------------------------- properties
@FAST
@given(data=st.data())
def test_every_request_ends_once_with_the_solo_rows(model, data):
    requests, aborts = data.draw(workloads())
    engine = fake_engine(model, **data.draw(engine_settings(requests)))
    runner = engine.runner
    ended = drive(engine, requests, aborts)
    check_nothing_held(engine)
    assert set(ended) == {rid for rid, *_ in requests}
    for rid, prompt, max_tokens, _ in requests:
        f = ended[rid]
        tokens, rows = solo_reference(prompt, max_tokens, runner.shape)
        got = np.concatenate([f.prompt_token_ids, f.output_token_ids]).tolist()
        if f.finish_reason == "abort":
            assert got == tokens[: len(got)], rid
            assert f.num_rows <= len(got)
            np.testing.assert_array_equal(f.routed_experts, rows[: f.num_rows], err_msg=rid)
        else:
            assert f.finish_reason == ("stop" if tokens[-1] == EOS else "length"), rid
            assert got == tokens, rid
            assert f.num_rows == len(tokens) - 1
            np.testing.assert_array_equal(f.routed_experts, rows, err_msg=rid)


@FAST
@given(data=st.data())
def test_pressure_without_aborts_finishes_everything(model, data):
    """Tight KV and one-token budgets: every request still finishes, by preemption if need be."""
    requests, _ = data.draw(workloads(max_requests=6, max_prompt=16))
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    need = max(-(-(len(p) + m - 1) // block_size) for _, p, m, _ in requests)
    engine = fake_engine(
        model,
        block_size=block_size,
        num_kv_blocks=need + data.draw(st.integers(0, 2)),
        max_num_seqs=data.draw(st.integers(2, 6)),
        max_num_batched_tokens=data.draw(st.integers(1, 6)),
        enable_prefix_caching=data.draw(st.booleans()),
        async_scheduling=data.draw(st.booleans()),
    )
    ended = drive(engine, requests, [])
    check_nothing_held(engine)
    assert all(f.finish_reason in ("stop", "length") for f in ended.values())
    assert len(ended) == len(requests)


def test_prefix_hit_on_a_reused_block_is_never_stale(model):
    """A freed, cached block handed to another request must not serve its old rows."""
    engine = fake_engine(
        model, block_size=2, num_kv_blocks=4, max_num_seqs=1, enable_prefix_caching=True
    )
    a = ("r0", [1, 2, 3, 4, 5], 1, 0)
    b = ("r1", [6, 7, 8, 9, 10], 1, 1)  # evicts a's blocks
    c = ("r2", [1, 2, 3, 4, 6], 1, 2)  # same prefix as a: must not hit the evicted blocks
    ended = drive(engine, [a, b, c], [])
    check_nothing_held(engine)
    for rid, prompt, max_tokens, _ in (a, b, c):
        tokens, rows = solo_reference(prompt, max_tokens, engine.runner.shape)
        np.testing.assert_array_equal(ended[rid].routed_experts, rows, err_msg=rid)


# --------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def model64():
    return tiny_model(torch.float64)


_SOLO: dict = {}


def real_solo(model, prompt: list[int], max_tokens: int):
    key = (tuple(prompt), max_tokens)
    if key not in _SOLO:
        done, _ = run_requests(
            model, {"x": prompt}, max_tokens=max_tokens, enable_prefix_caching=False
        )
        _SOLO[key] = done["x"]
    return _SOLO[key]


@settings(
    max_examples=max(12, EXAMPLES // 20),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_real_model_rows_equal_solo_runs(model64, data):
    requests, aborts = data.draw(workloads(max_requests=5, max_prompt=14))
    requests = [(rid, [t + 20 for t in p], m, arr) for rid, p, m, arr in requests]
    config = EngineConfig(**data.draw(engine_settings(requests)))
    engine = LLMEngine(model64, config, CPU)
    ended = drive(engine, requests, aborts)
    check_nothing_held(engine)
    assert set(ended) == {rid for rid, *_ in requests}
    for rid, prompt, max_tokens, _ in requests:
        f, ref = ended[rid], real_solo(model64, prompt, max_tokens)
        ref_tokens = np.concatenate([ref.prompt_token_ids, ref.output_token_ids])
        got = np.concatenate([f.prompt_token_ids, f.output_token_ids])
        np.testing.assert_array_equal(got, ref_tokens[: len(got)], err_msg=rid)
        np.testing.assert_array_equal(f.routed_experts, ref.routed_experts[: f.num_rows])
        if f.finish_reason != "abort":
            assert len(got) == len(ref_tokens) and f.num_rows == ref.num_rows
