"""Weights and KV cache given up and taken back: the engine then answers as before.

On the CPU the memory is the same memory either way; what is checked here is
that nothing is left holding it (every parameter and cache tensor is empty
while released) and that the engine comes back to the same results, or, with
the weights dropped, to those of the weights loaded next.  The freed GPU
memory is measured in tests/engine/test_gpu_weight_update.py.
"""

from __future__ import annotations

import pytest
from support.checkpoints import CPU, assert_same_routing, changed_demo, engine_for, run

from moetrace.engine.memory_release import KV_CACHE, TAGS, WEIGHTS, MemoryRelease
from moetrace.engine.weight_update import WeightUpdater


def test_released_memory_comes_back_to_the_same_results():
    engine = engine_for("demo", enable_prefix_caching=True)
    before = run(engine)
    memory = MemoryRelease(engine)
    memory.release(TAGS)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    assert engine.runner.kv_caches == []
    assert all(layer.k_cache.numel() == 0 for layer in engine.model.attention_layers())
    assert engine.block_manager.num_cached_blocks == 0  # the cached KV went with the cache
    memory.resume([WEIGHTS])
    assert memory.released == {KV_CACHE}
    memory.resume([KV_CACHE])
    assert_same_routing(run(engine, tag="after-"), before)


def test_dropped_weights_take_the_next_update(tmp_path):
    changed = changed_demo(tmp_path / "v1", shift=2)
    want = run(engine_for(str(changed)))
    engine = engine_for("demo")
    memory = MemoryRelease(engine)
    memory.release(TAGS, keep_weights=False)
    memory.resume(TAGS)
    WeightUpdater(engine.model).load_checkpoint(changed, CPU)
    assert_same_routing(run(engine), want)


def test_releasing_twice_or_resuming_what_was_kept_changes_nothing():
    engine = engine_for("demo")
    before = run(engine)
    memory = MemoryRelease(engine)
    memory.resume(TAGS)  # nothing released: nothing to do
    memory.release([KV_CACHE])
    memory.release([KV_CACHE])
    memory.resume(TAGS)
    assert memory.released == set()
    assert_same_routing(run(engine, tag="again-"), before)


@pytest.mark.parametrize("tag", TAGS)
def test_one_tag_leaves_the_other_in_place(tag):
    engine = engine_for("demo")
    memory = MemoryRelease(engine)
    memory.release([tag])
    weights_gone = all(p.numel() == 0 for p in engine.model.parameters())
    assert weights_gone == (tag == WEIGHTS)
    assert (engine.runner.kv_caches == []) == (tag == KV_CACHE)
