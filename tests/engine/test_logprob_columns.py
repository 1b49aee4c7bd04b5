"""A request's log-probabilities kept as columns: each token's values come back as given."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.engine.logprob_columns import LogprobColumns, StepLogprobs


def step(rng: np.random.Generator, batch: int, width: int, rid_row: dict[str, int]) -> StepLogprobs:
    return StepLogprobs(
        rid_row,
        rng.standard_normal(batch).astype(np.float32),
        rng.integers(1, 1000, batch),
        rng.integers(0, 50_000, (batch, width)),
        rng.standard_normal((batch, width)).astype(np.float32),
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5), st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), max_size=60))
def test_columns_hold_each_tokens_row(num, steps):
    """Rows taken from steps of any batch size and top-N width (>= num), past several
    growths, read back per token and as ``OutputLogprobs`` exactly as given."""
    rng = np.random.default_rng(len(steps))
    cols = LogprobColumns(num)
    want = []
    for batch, extra in steps:
        row = int(rng.integers(0, batch))
        s = step(rng, batch, num + extra, {"r": row})
        cols.append(s, row)
        want.append(
            (
                s.token_logprob[row],
                s.token_rank[row],
                s.top_ids[row, :num],
                s.top_logprobs[row, :num],
            )
        )
    out = cols.output()
    assert len(cols) == len(want) == len(out.token_logprob)
    assert out.token_logprob.dtype == np.float32 and out.token_rank.dtype == np.int64
    assert out.top_ids.dtype == np.int32 and out.top_ids.shape == (len(want), num)
    assert out.top_logprobs.dtype == np.float32 and out.top_logprobs.shape == (len(want), num)
    for i, (lp, rank, ids, lps) in enumerate(want):
        assert out.token_logprob[i] == lp and out.token_rank[i] == rank
        np.testing.assert_array_equal(out.top_ids[i], ids)
        np.testing.assert_array_equal(out.top_logprobs[i], lps)
    start = len(want) // 3
    for i, token in enumerate(cols[start:], start):
        assert token.logprob == float(want[i][0]) and token.rank == int(want[i][1])
        np.testing.assert_array_equal(token.top_ids, want[i][2])
    assert len(cols.output(start).token_logprob) == start


def test_output_is_a_copy():
    """A finished request's arrays do not change when the columns grow or are reused."""
    rng = np.random.default_rng(0)
    cols = LogprobColumns(2)
    cols.append(step(rng, 3, 2, {"r": 1}), 1)
    out = cols.output()
    before = out.token_logprob.copy()
    for _ in range(40):
        cols.append(step(rng, 3, 2, {"r": 0}), 0)
    np.testing.assert_array_equal(out.token_logprob, before)
