"""What a recorded request keeps of how it ran, and its output text, checked against the engine.

``moetrace record`` writes each request's stop reason and sampling settings;
the reader decodes its output text (trace/output_text.py).  The reference is
the engine itself, run again in this process on the same checkpoint: each
stored request's settings, given to a fresh engine on their own, must sample
the same tokens and end for the same reason, and the engine's own incremental
text (its stop-string matcher) must equal the text the reader decodes.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import moetrace

from moetrace import open_trace
from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.inputs.tokenizer import BYTE_EOS_ID, Tokenizer
from moetrace.models.demo import DEMO_DIR
from moetrace.models.loader import load_model

CPU = torch.device("cpu")
LINES = [
    {"id": "cut", "prompt": "Hello there, é!", "max_tokens": 24, "stop": ["zz", " "]},
    {
        "id": "kept",
        "prompt": "Experts route tokens",
        "max_tokens": 24,
        "stop": ["e", "th"],
        "include_stop_str_in_output": True,
        "min_tokens": 3,
    },
    {"id": "token", "prompt": "Hi", "max_tokens": 30, "stop_token_ids": [32], "ignore_eos": True},
    {"id": "samples", "prompt": "def f(x):", "max_tokens": 10, "n": 2, "temperature": 0.9},
    {"id": "seeded", "prompt": "Routing", "max_tokens": 10, "temperature": 0.8, "seed": 11},
    {"id": "long", "prompt_token_ids": [72, 101, 108, 108, 111], "max_tokens": 12},
    {"id": "chat", "messages": [{"role": "user", "content": "What is routing?"}]},
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("output_text")
    (tmp / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "-q", "--seed", "3", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    with open_trace(tmp / "t.h5") as trace:
        return list(trace.in_input_order())


@pytest.fixture(scope="module")
def engine_rerun():
    """Each stored request alone through a fresh engine, with only its stored settings."""
    model = load_model(str(DEMO_DIR), device=CPU, dtype="float32").model
    tokenizer = Tokenizer.from_dir(DEMO_DIR)

    def rerun(req):
        engine = LLMEngine(
            model,
            EngineConfig(num_kv_blocks=64, block_size=16),
            CPU,
            eos_token_ids=(BYTE_EOS_ID,),
            tokenizer=tokenizer,
        )
        engine.add_request(
            "again", req.prompt_token_ids.tolist(), SamplingParams(**req.sampling_params)
        )
        (done,) = list(engine.run())
        return done

    return rerun, tokenizer


def test_every_request_keeps_its_stop_reason_and_the_settings_that_reproduce_it(
    recorded, engine_rerun
):
    rerun, _ = engine_rerun
    assert len(recorded) == len(LINES) + 1  # n=2
    for req in recorded:
        again = rerun(req)
        assert again.output_token_ids.tolist() == req.output_token_ids.tolist(), req.id
        assert (again.finish_reason, again.stop_reason) == (req.finish_reason, req.stop_reason)
    by_id = {(r.id, r.sample_index): r for r in recorded}
    assert isinstance(by_id["cut", 0].stop_reason, str)  # a stop string ended it
    assert by_id["token", 0].stop_reason == 32 == by_id["token", 0].output_token_ids[-1]
    assert by_id["long", 0].finish_reason == "length" and by_id["long", 0].stop_reason is None
    seeded = by_id["seeded", 0].sampling_params
    assert (seeded["seed"], seeded["temperature"]) == (11, 0.8)
    samples = [by_id["samples", i] for i in (0, 1)]  # the run seed gave each its own
    assert samples[0].sampling_params["seed"] != samples[1].sampling_params["seed"]
    assert samples[0].output_token_ids.tolist() != samples[1].output_token_ids.tolist()


def test_the_output_text_is_the_engines(recorded, engine_rerun):
    rerun, tokenizer = engine_rerun
    for req in recorded:
        again = rerun(req)
        if req.sampling_params["stop"]:  # the engine's incremental text, cut where it cut
            assert req.output_text == again.output_text, req.id
        else:  # what ended it (a stop token, EOS) adds no text
            ids = req.output_token_ids.tolist()
            if req.finish_reason == "stop":
                ids = ids[:-1]
            assert req.output_text == tokenizer.decode(ids, skip_special_tokens=True), req.id
    kept = next(r for r in recorded if r.id == "kept")
    assert kept.output_text.endswith(kept.stop_reason)  # include_stop_str_in_output
    cut = next(r for r in recorded if r.id == "cut")
    assert cut.stop_reason not in cut.output_text


def test_a_trace_without_a_tokenizer_has_no_text(recorded, tmp_path):
    import h5py

    source = tmp_path / "t.h5"
    proc = moetrace(
        "record", "demo", "-", "-o", str(source), "-q", input='{"prompt": "Hi", "max_tokens": 3}\n'
    )
    assert proc.returncode == 0, proc.stderr
    with h5py.File(source, "r+") as f:
        del f["tokenizer"]
        f.attrs["tokenizer"] = ""
    with open_trace(source, verify=False) as trace:
        assert trace.request(0).output_text is None
