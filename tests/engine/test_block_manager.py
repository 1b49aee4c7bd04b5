"""Block manager and routing-row bookkeeping: sharing, reuse, and stale rows."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.capture.manager import RoutedExpertsCache, RoutedExpertsManager, StaleRoutingError
from moetrace.capture.types import RoutedExpertsLists
from moetrace.engine.block_manager import BlockManager
from moetrace.engine.request import Request
from moetrace.engine.sampling import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def computed(bm: BlockManager, request: Request, n: int) -> None:
    request.num_computed_tokens = n
    bm.register_computed_blocks(request)


def test_full_computed_blocks_are_shared_and_refcounted():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))
    assert bm.allocate(a, 10)
    computed(bm, a, 10)
    b = make_request("b", list(range(9)) + [99])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 10, hits)
    assert [int(bm.ref_counts[x]) for x in hits] == [2, 2]
    bm.free(a)
    bm.free(b)
    bm.check_no_leaks()


def test_hit_stops_short_of_the_last_token():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    bm.allocate(a, 8)
    computed(bm, a, 8)
    same = make_request("b", list(range(8)))
    # Both blocks are cached, but the last token must run to give logits.
    assert len(bm.find_cached_prefix(same)) == 1


def test_uncomputed_block_is_not_cached():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    bm.allocate(a, 8)
    computed(bm, a, 7)  # second block full of tokens but its last token not run yet
    assert len(bm.find_cached_prefix(make_request("b", list(range(9))))) == 1


def test_reallocation_bumps_epoch_and_evicts_hash():
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(5)))
    bm.allocate(a, 5)
    computed(bm, a, 5)
    first = a.block_table[0]
    epoch = int(bm.epochs[first])
    bm.free(a)
    # The freed cached block is reused by a hit without a new epoch...
    b = make_request("b", list(range(4)) + [7, 7])
    hits = bm.find_cached_prefix(b)
    assert hits == [first]
    bm.allocate(b, 6, hits)
    assert int(bm.epochs[first]) == epoch
    bm.free(b)
    # ...but handing it out fresh evicts the hash and bumps the epoch.
    c = make_request("c", [50] * 8)
    assert bm.allocate(c, 8)
    assert int(bm.epochs[first]) == epoch + 1
    assert bm.find_cached_prefix(make_request("d", list(range(6)))) == []


def test_allocation_fails_cleanly_when_blocks_run_out():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    a = make_request("a", list(range(12)))
    assert bm.allocate(a, 12)
    b = make_request("b", [1, 2])
    assert not bm.allocate(b, 2)
    assert b.block_table == []
    bm.free(a)
    bm.check_no_leaks()


def _store(
    manager: RoutedExpertsManager,
    bm: BlockManager,
    request: Request,
    rows: np.ndarray,
    weights: np.ndarray | None = None,
) -> None:
    positions = np.arange(rows.shape[0])
    table = np.asarray(request.block_table)
    slots = table[positions // 4] * 4 + positions % 4
    epochs = bm.epochs[slots // 4]
    manager.store_batch(RoutedExpertsLists(rows, slots, epochs, lambda: None, weights=weights))


def test_stale_rows_of_a_previous_owner_are_never_returned():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    manager = RoutedExpertsManager(8, 2, 2, np.dtype(np.uint8), 4, bm.epochs)
    cache = RoutedExpertsCache(manager)
    a = make_request("a", list(range(8)))
    bm.allocate(a, 8)
    _store(manager, bm, a, np.full((8, 2, 2), 5, dtype=np.int32))
    bm.free(a)
    b = make_request("b", list(range(8)))
    bm.allocate(b, 8)  # gets a's blocks back with new epochs; a's rows are still in the slots
    rows, fresh = manager.gather(b.block_table, 8)
    assert fresh == 0
    b.num_computed_tokens = 8
    cache.capture(b)
    with pytest.raises(StaleRoutingError):
        cache.take(b, 7)
    _store(manager, bm, b, np.full((8, 2, 2), 3, dtype=np.int32))
    cache.capture(b)
    assert (cache.take(b, 7).ids == 3).all()


@pytest.mark.parametrize("with_weights", [False, True])
def test_snapshot_rows_win_over_recomputed_ones(with_weights):
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    weights_dtype = np.dtype(np.float16) if with_weights else None
    manager = RoutedExpertsManager(16, 1, 1, np.dtype(np.uint8), 4, bm.epochs, weights_dtype)
    cache = RoutedExpertsCache(manager)
    r = make_request("r", list(range(6)))
    bm.allocate(r, 6)

    def weights(ids: np.ndarray) -> np.ndarray | None:
        return (ids / 1000).astype(np.float16) if with_weights else None

    first = np.arange(6, dtype=np.int32).reshape(6, 1, 1)
    _store(manager, bm, r, first, weights(first))
    r.num_computed_tokens = 6
    cache.capture(r)  # preemption
    bm.free(r)
    r.num_computed_tokens = 0
    bm.allocate(r, 8)
    again = (np.arange(8, dtype=np.int32) + 100).reshape(8, 1, 1)
    _store(manager, bm, r, again, weights(again))
    r.num_computed_tokens = 8
    cache.capture(r)
    rows = cache.take(r, 8)
    np.testing.assert_array_equal(rows.ids.ravel(), [0, 1, 2, 3, 4, 5, 106, 107])
    if with_weights:  # each weight stays with the id it was captured with
        np.testing.assert_array_equal(rows.weights, weights(rows.ids.astype(np.int32)))
    else:
        assert rows.weights is None
