"""Control calls carried out on an engine between steps: what each leaves behind.

Driven directly (no HTTP), on the demo engine, as the engine thread or
process drives them; the routes' sequences are in test_weights_api.py and
test_vllm_control_api.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.checkpoints import PROMPTS, changed_demo, engine_for, run

from moetrace.engine.sampling import SamplingParams
from moetrace.serving.engine_control import (
    DEFAULT_VERSION,
    EngineControl,
    FlushCache,
    LeaveGroup,
    Pause,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    SetVersion,
    UpdateFromDisk,
    UpdateFromGroup,
)


def started(max_tokens: int = 30, *, async_scheduling: bool = False) -> EngineControl:
    """An engine with two requests a few steps in (with asynchronous scheduling, as on CUDA:
    a step is still in flight when the call comes)."""
    engine = engine_for("demo", enable_prefix_caching=True, async_scheduling=async_scheduling)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens))
    for _ in range(3):
        engine.step()
    return EngineControl(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pause_abort_ends_every_request_with_what_it_computed(async_scheduling):
    control = started(async_scheduling=async_scheduling)
    result = control.handle(Pause("abort"))
    assert result.ok and result.state.paused == "abort"
    assert sorted(f.request_id for f in result.finished) == sorted(PROMPTS)
    assert result.num_paused_requests == 2
    want = run(engine_for("demo"), max_tokens=3)
    for done in result.finished:
        assert done.finish_reason == "abort"
        assert done.output_token_ids.tolist() == want[done.request_id].output_token_ids.tolist()
        np.testing.assert_array_equal(done.routed_experts, want[done.request_id].routed_experts)
    bm = control.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing left in the KV cache
    assert control.blocks_steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["in_place", "keep", "retract"])
def test_a_frozen_pause_keeps_its_requests_for_resume(mode, async_scheduling):
    control = started(async_scheduling=async_scheduling)
    result = control.handle(Pause(mode))
    assert result.ok and result.finished == [] and control.blocks_steps
    assert sorted(control.engine.request_ids) == sorted(PROMPTS)
    refused = control.handle(FlushCache(when_idle=True))
    assert not refused.ok and "2 requests are in the engine" in refused.message
    assert control.handle(Resume()).ok and not control.blocks_steps
    done = {f.request_id: f for f in control.engine.run()}
    want = run(engine_for("demo"), max_tokens=30)
    for rid in PROMPTS:
        assert done[rid].output_token_ids.tolist() == want[rid].output_token_ids.tolist()
        np.testing.assert_array_equal(done[rid].routed_experts, want[rid].routed_experts)


def test_a_failed_update_says_the_old_version_still_serves(tmp_path):
    control = EngineControl(engine_for("demo"))
    control.handle(SetVersion("7"))
    result = control.handle(UpdateFromDisk(str(tmp_path), version="8"))
    assert not result.ok and result.state.weight_version == "7"
    assert "no config.json" in result.message
    assert result.message.endswith("the weights are unchanged (version '7' still serves)")
    missing = control.handle(UpdateFromGroup(("a",), ("float32",), ((1,),), "nowhere"))
    assert not missing.ok and "no weight update group 'nowhere'" in missing.message
    assert not control.handle(LeaveGroup("nowhere")).ok


def test_an_update_stamps_its_version_and_aborts_when_asked(tmp_path):
    control = started()
    changed = changed_demo(tmp_path / "v1", shift=2)
    result = control.handle(UpdateFromDisk(str(changed), version="1", abort_all=True))
    assert result.ok, result.message
    assert result.state.weight_version == "1" == control.engine.weight_version
    assert len(result.finished) == 2 and not control.engine.has_unfinished()
    assert control.engine.block_manager.num_cached_blocks == 0


def test_memory_is_released_only_when_idle_and_weights_wait_for_it(tmp_path):
    control = started()
    assert not control.handle(ReleaseMemory()).ok  # requests still in the engine
    assert control.handle(ReleaseMemory(abort_all=True)).ok
    assert control.state.released == ("kv_cache", "weights") and control.blocks_steps
    refused = control.handle(UpdateFromDisk(str(changed_demo(tmp_path / "v", 1))))
    assert not refused.ok and "resume it (tags weights) first" in refused.message
    assert control.handle(ResumeMemory()).ok and not control.blocks_steps
    assert not control.handle(ReleaseMemory(("gpu",))).ok


def test_the_first_label_is_the_engines_and_an_unknown_pause_is_refused():
    control = EngineControl(engine_for("demo"))
    assert control.state.weight_version == DEFAULT_VERSION == "default"
    result = control.handle(Pause("sideways"))
    assert not result.ok and "pause mode 'sideways'" in result.message
    assert control.state.paused is None
