"""``moetrace replay`` through the installed console script, checked against transformers.

- the same model and settings: no row differs, log-probabilities agree to float32 rounding;
- float64 replay of a float32 trace: rows differ only where transformers' own float64
  router has a near-tie between the k-th and the next expert;
- forced routing through a model whose routers were perturbed: the recorded ids come
  back, and the log-probabilities are transformers' forward with those experts forced
  (a hook on its router modules, tests/support/hf_reference.py), for every family.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.cli import ENV, moetrace
from support.hf_reference import (
    FAMILIES,
    build_tiny_model,
    capture_router_calls,
    load_reference_model,
    make_tiny_checkpoint,
    perturb_routers,
    reference_forced_logprobs,
    selection_scores,
)

from moetrace import open_trace
from moetrace.config import EngineConfig
from moetrace.runs.recording import Recording, SamplingDefaults
from moetrace.runs.replay import Replay
from moetrace.runs.setup import RunOptions

PROMPTS = [
    {"id": "a", "prompt_token_ids": [5, 17, 42, 8, 99, 3, 61, 7]},
    {"id": "b", "prompt_token_ids": [5, 17, 42, 8, 7, 201]},
    {"id": "c", "prompt_token_ids": [250, 1, 77]},
    {"id": "d", "prompt_token_ids": [12, 140, 33, 9, 18], "max_tokens": 3},
]
ENGINE = ["--device", "cpu", "--block-size", "4", "--num-kv-blocks", "128", "-q"]


def record(tmp_path, ckpt, name="t.h5", *options) -> str:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    out = tmp_path / name
    proc = moetrace(
        "record", str(ckpt), str(prompts), "-o", str(out), "--dtype", "float32",
        "--max-tokens", "8", "--ignore-eos", "--logprobs", *ENGINE, *options,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return str(out)


def replay(trace: str, ckpt, out, *options) -> dict:
    proc = moetrace("replay", trace, str(ckpt), "-o", str(out), "--json", *ENGINE, *options)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_same_model_and_settings_reproduce_the_trace(tmp_path, family):
    ckpt = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=8)
    trace = record(tmp_path, ckpt, "t.h5", "--record-weights", "--weights-dtype", "float32")
    out = tmp_path / "r.h5"
    # Small steps: every sequence is scored over several chunks.
    report = replay(trace, ckpt, out, "--record-weights", "--weights-dtype", "float32",
                    "--max-num-batched-tokens", "7", "--max-num-seqs", "3")  # fmt: skip
    assert report["identical"] and report["tokens_with_difference"] == 0
    assert report["tokens"] == sum(len(x["prompt_token_ids"]) + 8 - 1 for x in PROMPTS) - 5
    lp = report["logprobs"]
    assert lp["tokens"] == 8 * 3 + 3
    assert lp["max_abs_logprob_diff"] < 1e-4 and lp["mean_abs_logprob_diff"] < 1e-5
    assert abs(lp["kl_k3"]) < 1e-8 and lp["ratio_above_2"] == 0
    with open_trace(trace) as a, open_trace(out) as b:
        assert b.verify() == [] and b.weights_dtype == "float32" and b.has_logprobs
        for ra in a:
            rb = b.request(ra.id)
            np.testing.assert_array_equal(rb.output_token_ids, ra.output_token_ids)
            np.testing.assert_allclose(rb.routed_weights, ra.routed_weights, rtol=5e-5, atol=1e-6)


def near_tie_checkpoint(path):
    """Qwen3-MoE whose expert 1 is expert 0 and whose router row 1 is row 0 a few float32 ulps
    apart: the two tie to within rounding, and a float32 / float64 swap of them changes
    nothing downstream (same expert), so any other difference would be a real one."""
    model = build_tiny_model("qwen3_moe", seed=21, num_experts_per_tok=2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            if not hasattr(mlp, "gate"):
                continue
            w = mlp.gate.weight
            w[1] = w[0] * (1 + 3e-7 * torch.randn(w.shape[1], generator=gen))
            mlp.experts.gate_up_proj[1] = mlp.experts.gate_up_proj[0]
            mlp.experts.down_proj[1] = mlp.experts.down_proj[0]
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_float64_replay_of_a_float32_trace_differs_only_at_near_ties(tmp_path):
    ckpt = near_tie_checkpoint(tmp_path / "ckpt")
    trace = record(tmp_path, ckpt)
    out = tmp_path / "r64.h5"
    report = replay(trace, ckpt, out, "--dtype", "float64")
    reference = load_reference_model(ckpt, dtype=torch.float64)
    differing = 0
    with open_trace(trace) as a, open_trace(out) as b:
        assert b.metadata["dtype"] == "float64"
        for ra in a:
            rb = b.request(ra.id)
            tokens = [*ra.prompt_token_ids.tolist(), *ra.output_token_ids.tolist()]
            calls = capture_router_calls(reference, tokens[:-1])
            sets_a = np.sort(ra.routed_experts, axis=2)
            sets_b = np.sort(rb.routed_experts, axis=2)
            for t, layer in zip(*np.nonzero((sets_a != sets_b).any(axis=2)), strict=True):
                scores = selection_scores(calls[layer])[t].sort(descending=True).values
                margin = float(scores[1] - scores[2])  # k-th vs next (top_k = 2)
                assert margin < 1e-5, (ra.id, int(t), int(layer), margin)
                assert {0, 1} <= set(sets_a[t, layer]) | set(sets_b[t, layer])
                differing += 1
    assert differing > 0  # the near-ties did flip: the check above saw real differences
    assert report["tokens_with_difference"] > 0
    assert report["logprobs"]["max_abs_logprob_diff"] < 1e-4


def record_in_process(ckpt, out) -> str:
    """``record`` as the command runs it, without a process of its own (faster)."""
    prompts = out.with_suffix(".jsonl")
    prompts.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    Recording(
        RunOptions.of(
            str(ckpt),
            engine=EngineConfig(num_kv_blocks=128, block_size=4),
            device="cpu",
            dtype="float32",
        ),
        str(prompts),
        out,
        sampling=SamplingDefaults(max_tokens=8, ignore_eos=True, logprobs=True),
    ).run()
    return str(out)


def replay_in_process(trace: str, ckpt, out, *, force_routing: bool) -> dict:
    engine = EngineConfig(num_kv_blocks=128, block_size=4)
    options = RunOptions.of(str(ckpt), engine=engine, device="cpu", dtype="float32")
    run = Replay(trace, options, out, force_routing=force_routing)
    return run.run().report


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_routing_replays_the_recorded_experts(tmp_path, family):
    overrides = {"norm_topk_prob": False} if family == "olmoe" else {}
    ckpt = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=5, **overrides)
    trace = record_in_process(ckpt, tmp_path / "t.h5")
    perturbed = perturb_routers(ckpt, tmp_path / "perturbed", scale=0.5, seed=1)
    free = replay_in_process(trace, perturbed, tmp_path / "free.h5", force_routing=False)
    forced = replay_in_process(trace, perturbed, tmp_path / "forced.h5", force_routing=True)
    assert free["tokens_with_difference"] > 0  # the perturbation changes routing
    assert forced["tokens_with_difference"] == 0 and forced["identical"]
    reference = load_reference_model(perturbed)
    with open_trace(trace) as a, open_trace(tmp_path / "forced.h5") as b:
        for ra in a:
            rb = b.request(ra.id)
            np.testing.assert_array_equal(rb.routed_experts, ra.routed_experts)
            tokens = [*ra.prompt_token_ids.tolist(), *ra.output_token_ids.tolist()]
            want = reference_forced_logprobs(reference, tokens, ra.routed_experts)
            got = rb.output_logprobs
            np.testing.assert_allclose(got, want[ra.prompt_len - 1 :], rtol=1e-4, atol=2e-5)
    # What forcing leaves of the log-prob shift is the perturbed weights' share of it.
    assert forced["logprobs"]["mean_abs_logprob_diff"] > 0


def test_replay_refuses_what_it_cannot_compare(tmp_path):
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=3)
    trace = record(tmp_path, ckpt)
    other = make_tiny_checkpoint("qwen3_moe", tmp_path / "other", seed=3, num_experts=16)
    proc = moetrace("replay", trace, str(other), "-o", str(tmp_path / "r.h5"), *ENGINE)
    assert proc.returncode == 1 and "num_experts 16 vs 8" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r.h5").exists()
    proc = moetrace("replay", trace, str(ckpt), "-o", trace, *ENGINE)
    assert proc.returncode == 1 and "already exists" in proc.stderr
    proc = moetrace("replay", trace, str(ckpt), *ENGINE)
    assert proc.returncode == 2 and "Missing option" in proc.stderr
    proc = moetrace("replay", trace, str(ckpt), "-o", "x.h5", "--weights-dtype", "int8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_tensor_parallel_replay_reproduces_a_single_device_trace(tmp_path):
    """Two gloo processes (the settings a user compares against): the rows of one device."""
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=9)
    trace = record_in_process(ckpt, tmp_path / "t.h5")
    report = replay(trace, ckpt, tmp_path / "tp2.h5", "--tensor-parallel-size", "2")
    assert report["identical"] and report["logprobs"]["max_abs_logprob_diff"] < 1e-4
    with open_trace(tmp_path / "tp2.h5") as b:
        assert b.metadata["engine_settings"]["tensor_parallel_size"] == 2


def test_a_trace_with_prefix_cache_hits_and_samples_replays_exactly(tmp_path):
    """Requests that shared cached prompt blocks when recorded (and n > 1 samples of one
    prompt) share them again when replayed, and every row and log-probability comes back."""
    ckpt = make_tiny_checkpoint("olmoe", tmp_path / "ckpt", seed=12)
    shared = list(range(40, 53))  # three full blocks of 4, and one token more
    sampled = {"temperature": 1.0, "seed": 4, "max_tokens": 6, "ignore_eos": True}
    lines = [
        {"id": "s", "prompt_token_ids": [*shared, 7, 8], "n": 3, **sampled},
        {"id": "t", "prompt_token_ids": [*shared, 9], **sampled},
        {"id": "u", "prompt_token_ids": [*shared, 7, 8, 99, 100, 101, 102], **sampled},
        # Greedy twins: the second's whole sequence is cached by the first's replay, yet
        # only its prompt but the last token may be served (the rest is scored).
        *(
            {"id": g, "prompt_token_ids": [*shared, 5], "max_tokens": 6, "ignore_eos": True}
            for g in ("g1", "g2")
        ),
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    trace = str(tmp_path / "t.h5")
    proc = moetrace("record", str(ckpt), str(prompts), "-o", trace, "--dtype", "float32", "--logprobs",
                    "--max-num-seqs", "1", *ENGINE)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with open_trace(trace) as a:
        assert a.num_requests == 7 and sum(r.num_cached_tokens > 0 for r in a) >= 5
        g1, g2 = a.request("g1"), a.request("g2")
        assert g2.output_token_ids.tolist() == g1.output_token_ids.tolist()
    free = replay(trace, ckpt, tmp_path / "r.h5", "--max-num-seqs", "1")
    forced = replay(trace, ckpt, tmp_path / "f.h5", "--max-num-seqs", "2", "--force-routing")
    for report, out in ((free, "r.h5"), (forced, "f.h5")):
        assert report["identical"] and report["requests"]["compared"] == 7
        assert report["logprobs"]["tokens"] == 7 * 6
        assert report["logprobs"]["max_abs_logprob_diff"] < 1e-4
        with open_trace(trace) as a, open_trace(tmp_path / out) as b:
            assert sum(r.num_cached_tokens > 0 for r in b) >= 5  # the replay used the cache
            assert b.request("g2").num_cached_tokens == 12  # its prompt's full blocks
            for ra in a:
                rb = b.request((ra.id, ra.sample_index))
                np.testing.assert_array_equal(rb.routed_experts, ra.routed_experts)
                np.testing.assert_allclose(rb.output_logprobs, ra.output_logprobs, atol=1e-4)


def test_another_revision_of_a_cached_model_id(tmp_path, monkeypatch):
    """``--revision`` picks the checkpoint revision replayed, as record's does: the trace's
    own revision reproduces it, one with perturbed routers does not."""
    from support.hub_cache import add_snapshot

    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=8)
    perturbed = perturb_routers(ckpt, tmp_path / "perturbed", scale=0.5, seed=2)
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, "acme/Tiny-MoE", ckpt, "a" * 40, "main")
    add_snapshot(cache, "acme/Tiny-MoE", perturbed, "b" * 40, "v2")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setitem(ENV, "HF_HOME", str(tmp_path / "hf"))
    trace = record(tmp_path, "acme/Tiny-MoE")
    same = replay(trace, "acme/Tiny-MoE", tmp_path / "main.h5", "--revision", "main")
    other = replay(trace, "acme/Tiny-MoE", tmp_path / "v2.h5", "--revision", "v2")
    assert same["identical"] and other["tokens_with_difference"] > 0
    assert other["replay"]["model"] == "acme/Tiny-MoE@v2"
    with open_trace(tmp_path / "v2.h5") as b:
        assert b.metadata["engine_settings"]["model_commit"] == "b" * 40
    proc = moetrace("replay", trace, str(ckpt), "-o", str(tmp_path / "x.h5"), "--revision", "v2")
    assert proc.returncode == 1 and "is a directory, not a model id" in proc.stderr


def test_replay_says_what_it_could_not_measure_and_keeps_a_source_incomplete(tmp_path):
    """Forced replay of a trace without log-probs printed 'identical' and no word that the
    drift was never measured; a replay of an incomplete trace was marked complete."""
    import h5py

    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": "Hi " * (i + 1)}) + "\n" for i in range(3))
    )
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "-q", "--max-tokens", "4",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "t.h5", "r+") as f:
        f.attrs["complete"] = False  # as a recording stopped by a signal leaves it
    proc = moetrace("replay", "t.h5", "demo", "-o", "r.h5", "--force-routing", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = " ".join(proc.stdout.split())
    assert "identical" in shown
    assert "A holds no log-probabilities (recorded without --logprobs): the log-probability " \
        "drift was not measured" in shown  # fmt: skip
    assert "t.h5 is incomplete" in shown
    assert "marked incomplete" in proc.stderr
    assert moetrace("verify", str(tmp_path / "r.h5")).returncode == 3  # incomplete, intact
    proc = moetrace("replay", "t.h5", "demo", "-o", "j.h5", "--json", cwd=tmp_path)
    warnings = json.loads(proc.stdout)["warnings"]
    assert any("log-probability drift was not measured" in w for w in warnings)
