"""New weights copied into a running engine: checked whole, in place, and then routing follows.

The reference for "routing follows" is an engine loaded fresh from the new
checkpoint by the same loader ``moetrace record`` uses: after an update the
served engine must give the same tokens and routed experts, row for row.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support.checkpoints import (
    CPU,
    PROMPTS,
    assert_same_routing,
    changed_demo,
    demo_tensors,
    engine_for,
    gate_name,
    load_tensors,
    run,
)
from support.gpt_oss import mxfp4_twins
from support.hf_reference import FAMILIES, make_tiny_checkpoint, perturb_routers

from moetrace.engine.sampling import SamplingParams
from moetrace.engine.weight_update import TensorSpec, WeightUpdateError, WeightUpdater, parse_dtype
from moetrace.errors import ModelError
from moetrace.models.demo import DEMO_DIR


@pytest.fixture(scope="module")
def changed(tmp_path_factory):
    return changed_demo(tmp_path_factory.mktemp("ck") / "v1", shift=3, scale=1.5)


@pytest.fixture(scope="module")
def fresh(changed):
    """What an engine loaded from the changed checkpoint gives (record's path)."""
    return run(engine_for(str(changed)))


def test_a_checkpoint_loads_in_place_and_routes_as_a_freshload_tensors(changed, fresh):
    engine = engine_for("demo")
    before = run(engine)
    pointers = [p.data_ptr() for p in engine.model.parameters()]
    updater = WeightUpdater(engine.model)
    updater.check_checkpoint(changed)
    assert updater.load_checkpoint(changed, CPU) is False  # no graph to capture again
    engine.reset_prefix_cache()
    assert [p.data_ptr() for p in engine.model.parameters()] == pointers  # the same storage
    after = run(engine, tag="again-")
    assert_same_routing(after, fresh)
    assert any(
        not np.array_equal(before[r].routed_experts, after[r].routed_experts) for r in PROMPTS
    ), "the changed routers should route some token elsewhere"


def test_named_tensors_load_as_a_trainer_sends_them(changed, fresh):
    engine = engine_for("demo")
    updater = WeightUpdater(engine.model)
    tensors = {k: v for k, v in demo_tensors().items() if "gate." in k or "o_proj" in k}
    new = {name: t for name, t in load_tensors(changed).items() if name in tensors}
    updater.check([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in new.items()])
    updater.load(new.items())
    assert_same_routing(run(engine), fresh)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (TensorSpec("model.layers.9.mlp.gate.weight", torch.float32, (16, 128)), "not a tensor"),
        (TensorSpec(gate_name(1), torch.float32, (16, 64)), "shape [16, 64], expected [16, 128]"),
        (TensorSpec(gate_name(1), torch.int32, (16, 128)), "dtype torch.int32"),
    ],
    ids=["name", "shape", "dtype"],
)
def test_an_update_the_model_cannot_take_is_refused_whole_and_named(spec, words):
    engine = engine_for("demo")
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = TensorSpec(gate_name(2), torch.bfloat16, (16, 128))  # another float dtype is fine
    with pytest.raises(WeightUpdateError) as err:
        WeightUpdater(engine.model).check([good, spec])
    assert words in str(err.value) and "nothing updated" in str(err.value)
    for key, value in engine.model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_a_tensor_given_twice_is_refused():
    engine = engine_for("demo")
    spec = TensorSpec(gate_name(1), torch.float32, (16, 128))
    with pytest.raises(WeightUpdateError, match="given twice"):
        WeightUpdater(engine.model).check([spec, spec])


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    engine = engine_for("demo")
    updater = WeightUpdater(engine.model)
    other = changed_demo(tmp_path / "other", shift=1)
    config = json.loads((other / "config.json").read_text())
    config["num_experts_per_tok"] = 4
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightUpdateError, match="builds another model.*top_k: 2 vs 4"):
        updater.check_checkpoint(other)
    with pytest.raises(ModelError, match="no config.json"):
        updater.check_checkpoint(tmp_path)
    lacking = changed_demo(tmp_path / "lacking", shift=1)
    tensors = load_tensors(lacking)
    del tensors[gate_name(3)]
    save_file(tensors, str(lacking / "model.safetensors"))
    with pytest.raises(ModelError, match="checkpoint lacks model.layers.3.mlp.gate.weight"):
        updater.check_checkpoint(lacking)


def test_the_prefix_cache_forgets_the_old_weights_kv(changed, fresh):
    engine = engine_for("demo", enable_prefix_caching=True)
    run(engine)
    repeat = run(engine, tag="again-")
    assert all(f.num_cached_tokens > 0 for f in repeat.values())  # the cache serves repeats
    WeightUpdater(engine.model).load_checkpoint(changed, CPU)
    assert engine.reset_prefix_cache() > 0
    after = run(engine, tag="new-")
    assert all(f.num_cached_tokens == 0 for f in after.values())
    assert_same_routing(after, fresh)


def test_a_request_alive_across_an_update_never_offers_its_blocks(changed):
    engine = engine_for("demo", enable_prefix_caching=True)
    prompt = list(range(40, 60))
    engine.add_request("old", prompt, SamplingParams(max_tokens=8))
    engine.step()  # its prefill ran under the old weights
    WeightUpdater(engine.model).load_checkpoint(changed, CPU)
    engine.reset_prefix_cache()
    list(engine.run())
    assert engine.block_manager.num_cached_blocks == 0
    engine.add_request("new", prompt, SamplingParams(max_tokens=2))
    (done,) = list(engine.run())
    assert done.num_cached_tokens == 0


def test_each_token_names_the_weight_version_that_sampled_it():
    engine = engine_for("demo")
    engine.weight_version = "v1"
    engine.add_request("r", PROMPTS["hello"], SamplingParams(max_tokens=6))
    for _ in range(3):  # prefill + two decodes: three tokens
        engine.step()
    engine.weight_version = "v2"
    (done,) = list(engine.run())
    assert done.weight_versions == [["v1", 0, 3], ["v2", 3, 6]]


def test_a_retracted_request_recomputes_to_the_same_result():
    reference = run(engine_for("demo"), max_tokens=10)
    engine = engine_for("demo")
    for i, (rid, ids) in enumerate(PROMPTS.items()):
        engine.add_request(rid, ids, SamplingParams(max_tokens=10), index=i)
    for _ in range(4):
        engine.step()
    engine.retract()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    done = {f.request_id: f for f in engine.run()}
    assert_same_routing(done, reference)
    assert all(f.num_preemptions == 1 for f in done.values())


@pytest.mark.parametrize(
    ("name", "dtype"), [("bfloat16", torch.bfloat16), ("torch.float32", torch.float32)]
)
def test_dtypes_read_as_trainers_write_them(name, dtype):
    assert parse_dtype(name) is dtype
    with pytest.raises(WeightUpdateError, match="unknown dtype 'float99'"):
        parse_dtype("float99")


def test_the_demo_checkpoint_is_the_served_one():
    """The twin check passes the shipped checkpoint itself (nothing differs)."""
    WeightUpdater(engine_for("demo").model).check_checkpoint(DEMO_DIR)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_takes_an_update_in_place(family, tmp_path):
    """Each family's own loading code (fused q/k/v, stacked experts, MXFP4, MLA) takes a
    checkpoint of changed routers in place: the result equals a fresh load of it."""
    old = make_tiny_checkpoint(family, tmp_path / "old", seed=3)
    new = perturb_routers(old, tmp_path / "new", scale=3.0, seed=1)
    assert_updates_as_fresh(old, new)


def assert_updates_as_fresh(old, new) -> None:
    """An engine on ``old`` updated in place to ``new`` routes as one loaded from ``new``."""
    prompts = {"a": list(range(5, 30)), "b": list(range(40, 52))}
    engine = engine_for(str(old))
    updater = WeightUpdater(engine.model)
    updater.check_checkpoint(new)
    updater.load_checkpoint(new, CPU)
    engine.reset_prefix_cache()
    assert_same_routing(run(engine, prompts), run(engine_for(str(new)), prompts))


def test_mxfp4_experts_take_an_update_in_place(tmp_path):
    _, quant = mxfp4_twins(tmp_path / "m")
    tensors = load_tensors(quant)
    new = tmp_path / "new"
    new.mkdir()
    save_file({k: v ^ 0x11 if k.endswith("_blocks") else v for k, v in tensors.items()},
              str(new / "model.safetensors"))  # fmt: skip
    (new / "config.json").write_text((quant / "config.json").read_text())
    assert_updates_as_fresh(quant, new)
