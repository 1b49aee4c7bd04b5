"""The trainer's routing as a trace, diffed by `moetrace diff` against `moetrace record`'s rollout
of the same checkpoint: identical, different once the trainer's routers drift, identical again
under replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.cli import moetrace as run_cli
from support.hf_reference import load_reference_model, make_tiny_checkpoint, perturb_routers

import moetrace.r3
from moetrace.errors import MoetraceError
from moetrace.trace.reader import open_trace


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint and its rollout trace, recorded by the CLI."""
    tmp = tmp_path_factory.mktemp("rollout")
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp / "ckpt", seed=41)
    prompts = tmp / "prompts.jsonl"
    lines = [
        {"id": f"q{i}", "prompt_token_ids": list(range(5 + i, 11 + 2 * i)), "max_tokens": 4}
        for i in range(3)
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = tmp / "rollout.h5"
    proc = run_cli("record", str(checkpoint), str(prompts), "-o", str(trace), "-q")
    assert proc.returncode == 0, proc.stderr
    return checkpoint, trace


def trainer_trace(model, rollout_trace, out, *, replay: bool) -> None:
    """Right-padded batch of the rollout's sequences through ``model``; its routing written."""
    with open_trace(rollout_trace) as trace:
        requests = list(trace)
        seqs = [np.concatenate([r.prompt_token_ids, r.output_token_ids]) for r in requests]
        length = max(len(s) for s in seqs)
        input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for b, s in enumerate(seqs):
            input_ids[b, : len(s)], mask[b, : len(s)] = torch.from_numpy(s.astype(np.int64)), 1
        with torch.no_grad(), moetrace.r3.record_routing(model) as rec:
            if replay:
                with moetrace.r3.replay_routing(model, requests):
                    model(input_ids=input_ids, attention_mask=mask)
            else:
                model(input_ids=input_ids, attention_mask=mask)
        routed = [
            moetrace.r3.RoutedSequence(r.id, r.prompt_token_ids, r.output_token_ids, rows)
            for r, rows in zip(requests, rec.sequences(), strict=True)
        ]
        moetrace.r3.write_trace(out, routed, like=trace)


def diff(a, b) -> tuple[int, dict]:
    proc = run_cli("diff", str(a), str(b), "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_the_same_checkpoint_in_transformers_routes_as_the_rollout(rollout, tmp_path):
    checkpoint, trace = rollout
    trainer_trace(load_reference_model(checkpoint), trace, tmp_path / "t.h5", replay=False)
    code, report = diff(trace, tmp_path / "t.h5")
    assert code == 0, report
    with open_trace(tmp_path / "t.h5") as mine, open_trace(trace) as theirs:
        assert [r.id for r in mine] == [r.id for r in theirs.in_input_order()]
        assert mine.metadata["engine_settings"]["routed_by"].startswith("moetrace.r3")


def test_drifted_routers_differ_until_replay(rollout, tmp_path):
    checkpoint, trace = rollout
    drifted = perturb_routers(checkpoint, tmp_path / "drifted", scale=1.0, seed=42)
    model = load_reference_model(drifted)
    trainer_trace(model, trace, tmp_path / "free.h5", replay=False)
    trainer_trace(model, trace, tmp_path / "replayed.h5", replay=True)
    assert diff(trace, tmp_path / "free.h5")[0] == 1
    assert diff(trace, tmp_path / "replayed.h5")[0] == 0


def test_rows_must_fit_the_rollout_trace(rollout, tmp_path):
    _, trace = rollout
    with open_trace(trace) as like:
        r = like["q0"]
        bad = moetrace.r3.RoutedSequence(
            "q0", r.prompt_token_ids, r.output_token_ids, r.routed_experts[:-2]
        )
        with pytest.raises(MoetraceError, match="rows for"):
            moetrace.r3.write_trace(tmp_path / "x.h5", [bad], like=like)
        assert not (tmp_path / "x.h5").exists()
        with pytest.raises(MoetraceError, match="already exists"):
            moetrace.r3.write_trace(trace, [], like=like)
