"""``record --record-weights`` and ``--logprobs`` through the installed console script.

The trace's gate weights must equal transformers' router outputs for the same
tokens (float16 storage: within half a float16 ulp of them), and its output
log-probabilities transformers' log-softmax of the logits; both read back
with plain h5py as docs/trace-format.md describes.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from support.cli import moetrace
from support.hf_reference import (
    FAMILIES,
    load_reference_model,
    make_tiny_checkpoint,
    reference_logprobs,
    reference_routing,
)
from support.parity import assert_weights_match, record

from moetrace import open_trace

PROMPTS = [
    {"id": "a", "prompt_token_ids": [5, 17, 42, 8, 99, 3]},
    {"id": "b", "prompt_token_ids": [5, 17, 42, 8, 7]},
    {"id": "c", "prompt_token_ids": [250, 1, 77]},
]


def _record(tmp_path, ckpt, name, *options):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    out = tmp_path / name
    proc = moetrace(
        "record", str(ckpt), str(prompts), "-o", str(out), "-q", "--device", "cpu",
        "--dtype", "float32", "--max-tokens", "5", "--ignore-eos", "--block-size", "4",
        "--num-kv-blocks", "64", *options,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


def test_weights_and_logprobs_equal_transformers(tmp_path):
    ckpt = make_tiny_checkpoint("qwen2_moe", tmp_path / "ckpt", seed=11, norm_topk_prob=False)
    out = _record(tmp_path, ckpt, "t.h5", "--record-weights", "--logprobs")
    with h5py.File(out, "r") as f:
        assert f.attrs["format_version"] == 2
        assert f["routed_weights"].dtype == np.float16
    with open_trace(out) as trace:
        assert trace.verify() == []
        for req in trace:
            tokens = [*req.prompt_token_ids.tolist(), *req.output_token_ids.tolist()]
            ref = reference_routing(ckpt, tokens[:-1])
            np.testing.assert_array_equal(req.routed_experts, ref["topk_ids"])
            assert_weights_match(req.routed_weights, ref["topk_weights"], req.id)
            # Without norm_topk_prob a row's weights are raw softmax shares: below 1 in sum.
            assert (req.routed_weights.astype(np.float32).sum(axis=2) < 1).all()
            want = reference_logprobs(ckpt, tokens)[req.prompt_len - 1 :]
            np.testing.assert_allclose(req.output_logprobs, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_float16_weights_of_every_family_are_transformers_rounded_once(tmp_path, family):
    """The default storage: each family's router outputs within float16's tolerance
    (tests/support/parity.py checks float32 storage, family by family and shape by shape)."""
    ckpt = make_tiny_checkpoint(family, tmp_path / family, seed=17)
    prompts = {"a": [5, 17, 42, 8, 99, 3, 61], "b": [250, 1, 77, 5]}
    done = record(ckpt, prompts, 3, capture_weights="float16", max_num_batched_tokens=8)["done"]
    for rid, prompt in prompts.items():
        got = done[rid]
        assert got.routed_weights.dtype == np.float16
        ref = reference_routing(ckpt, prompt + got.output_token_ids.tolist()[:-1])
        np.testing.assert_array_equal(got.routed_experts, ref["topk_ids"])
        assert_weights_match(got.routed_weights, ref["topk_weights"], f"{family} {rid}")


def test_float32_weights_and_a_trace_without_them(tmp_path):
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=4)
    out = _record(tmp_path, ckpt, "t32.h5", "--record-weights", "--weights-dtype", "float32")
    plain = _record(tmp_path, ckpt, "plain.h5")
    with open_trace(out) as weighted, open_trace(plain) as bare:
        assert weighted.weights_dtype == "float32" and not weighted.has_logprobs
        assert bare.weights_dtype is None and bare.metadata["format_version"] == 1
        for a, b in zip(weighted, bare, strict=True):  # capturing weights changes nothing else
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
            np.testing.assert_array_equal(a.output_token_ids, b.output_token_ids)
            # Mixtral renormalises over the k: every row's weights sum to 1.
            np.testing.assert_allclose(a.routed_weights.sum(axis=2), 1, rtol=1e-6)


def test_resume_refuses_to_mix_traces_with_and_without_weights(tmp_path):
    ckpt = make_tiny_checkpoint("olmoe", tmp_path / "ckpt", seed=2)
    out = _record(tmp_path, ckpt, "t.h5", "--record-weights")
    with h5py.File(out, "r+") as f:  # as if the run had stopped early
        f.attrs["complete"] = False
    prompts = tmp_path / "p.jsonl"
    proc = moetrace(
        "record", str(ckpt), str(prompts), "-o", str(out), "-q", "--device", "cpu",
        "--dtype", "float32", "--max-tokens", "5", "--ignore-eos", "--resume",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "routed_weights" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_weights_dtype_is_a_usage_error(tmp_path):
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "--weights-dtype", "bfloat16")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "bfloat16" in proc.stderr and "float16" in proc.stderr


def test_logprobs_are_the_raw_distribution_under_temperature_and_penalties(tmp_path):
    """As vLLM's default (``logprobs_mode`` raw_logprobs): the log-softmax of the model's own
    logits, before penalties, temperature, top-k and top-p reshape what is sampled from."""
    ckpt = make_tiny_checkpoint("olmoe", tmp_path / "ckpt", seed=6)
    sampling = {"temperature": 2.5, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.8,
                "frequency_penalty": 0.7, "max_tokens": 8, "ignore_eos": True}  # fmt: skip
    lines = [{"id": f"s{i}", "prompt_token_ids": [5, 17 + i, 42, 8], "seed": i, **sampling}
             for i in range(3)]  # fmt: skip
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "t.h5"
    proc = moetrace("record", str(ckpt), str(prompts), "-o", str(out), "-q", "--device", "cpu",
                    "--dtype", "float32", "--logprobs")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model = load_reference_model(ckpt)
    with open_trace(out) as trace:
        for req in trace:
            tokens = torch.tensor([[*req.prompt_token_ids, *req.output_token_ids]])
            with torch.no_grad():
                logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[0].double()
            rows = slice(req.prompt_len - 1, None)
            chosen = tokens[0, req.prompt_len :, None]
            raw = logits[rows].log_softmax(-1).gather(1, chosen)[:, 0].numpy()
            tempered = (logits[rows] / 2.5).log_softmax(-1).gather(1, chosen)[:, 0].numpy()
            np.testing.assert_allclose(req.output_logprobs, raw, rtol=1e-5, atol=1e-5)
            assert np.abs(tempered - raw).max() > 0.1  # the two readings are told apart
