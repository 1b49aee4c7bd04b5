"""vLLM batch lines as users have them: the fields vLLM takes, and the defaults it applies.

Each recording is checked against what the field means, through a second
recording that states the same thing another way (a line's field against the
command line's option, n samples against n seeds, a stop string against the
text of an unstopped run), or against transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.reliability import run_cli, write_jsonl

from moetrace import open_trace
from moetrace.errors import InputError
from moetrace.inputs.prompts import parse_line
from moetrace.inputs.tokenizer import Tokenizer
from moetrace.models.demo import DEMO_DIR

CHAT = [{"role": "user", "content": "What is routing?"}]


def record(
    tmp: Path, lines: list, *args: str, model: str = "demo", quiet: bool = True
) -> tuple[dict, str]:
    """Record ``lines``; returns {(id, sample): request} and the command's stderr."""
    prompts = write_jsonl(tmp / "p.jsonl", lines)
    out = tmp / "t.h5"
    code, _, err = run_cli("record", model, str(prompts), "-o", str(out), "--overwrite",
                           *args, *(["-q"] if quiet else []))  # fmt: skip
    assert code == 0, err
    with open_trace(out) as trace:
        assert trace.verify() == []
        return {(r.id, r.sample_index): r for r in trace}, err


def tokens(req) -> list[int]:
    return req.output_token_ids.tolist()


def test_batch_line_fields_parse_to_vllms_settings():
    body = {
        "messages": CHAT, "stop": "\n", "n": 3, "min_tokens": 2, "ignore_eos": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logprobs": True, "top_logprobs": 4, "min_p": 0.1, "include_stop_str_in_output": True,
        "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True,
    }  # fmt: skip
    line = {"custom_id": "x", "url": "/v1/chat/completions", "body": body}
    spec = parse_line(json.dumps(line))
    assert spec.sampling == {
        "stop": ["\n"], "n": 3, "min_tokens": 2, "ignore_eos": True, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logprobs": 4, "min_p": 0.1,
        "include_stop_str_in_output": True,
    }  # fmt: skip
    assert spec.encoding == {
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
    }
    completion = {
        "custom_id": "y",
        "url": "/v1/completions",
        "body": {"prompt": "a", "logprobs": 2},
    }
    assert parse_line(json.dumps(completion)).sampling == {"logprobs": 2}
    with pytest.raises(InputError, match="field 'logit_bias': unknown field"):
        parse_line(json.dumps({"prompt": "a", "logit_bias": {}}))


def test_unknown_fields_are_refused_or_with_the_flag_named_once(tmp_path):
    lines = [{"id": "a", "prompt": "Hi", "logit_bias": {}}, {"id": "b", "prompt": "Yo", "echo": 1},
             {"id": "c", "prompt": "Ho", "logit_bias": {"1": 2}}]  # fmt: skip
    prompts = write_jsonl(tmp_path / "p.jsonl", lines)
    code, _, err = run_cli("record", "demo", str(prompts), "-o", str(tmp_path / "t.h5"), "-q")
    assert code == 1 and err.strip() == f"error: {prompts}:1: field 'logit_bias': unknown field"
    assert not (tmp_path / "t.h5").exists()
    done, err = record(tmp_path, lines, "--max-tokens", "2", "--ignore-unknown-fields")
    assert len(done) == 3
    assert f"ignored unknown field 'logit_bias' on 2 line(s) of {prompts} (first: line 1)" in err
    assert f"ignored unknown field 'echo' on 1 line(s) of {prompts} (first: line 2)" in err


def test_n_samples_are_records_with_their_sample_index(tmp_path):
    line = {"id": "q", "prompt": "def fibonacci(n):", "n": 3, "temperature": 1.0, "seed": 7}
    done, _ = record(tmp_path, [line], "--max-tokens", "8")
    assert sorted(done) == [("q", 0), ("q", 1), ("q", 2)]
    for i in range(3):  # sample i is the request with seed 7 + i (vLLM's rule)
        alone, _ = record(tmp_path, [{**line, "n": 1, "seed": 7 + i}], "--max-tokens", "8")
        assert tokens(done["q", i]) == tokens(alone["q", 0])
    assert len({tuple(tokens(r)) for r in done.values()}) == 3


def test_resume_redoes_only_the_missing_samples(tmp_path):
    line = {"id": "q", "prompt": "def fibonacci(n):", "n": 3, "temperature": 1.0}
    full, _ = record(tmp_path, [line], "--max-tokens", "6")
    shutil.copy(tmp_path / "t.h5", tmp_path / "full.h5")
    with open_trace(tmp_path / "full.h5") as trace:
        keep = [r for r in trace if r.sample_index != 1]
    from moetrace.analysis.merge import metadata_of
    from moetrace.trace.writer import TraceWriter

    with open_trace(tmp_path / "full.h5") as trace:
        md = metadata_of(trace)
    writer = TraceWriter(tmp_path / "partial.h5", md).start()
    for req in keep:
        writer.submit(req)
    writer.close(complete=False, end_reason="interrupted by SIGINT")
    prompts = write_jsonl(tmp_path / "p.jsonl", [line])
    code, _, err = run_cli("record", "demo", str(prompts), "-o", str(tmp_path / "partial.h5"),
                           "-q", "--max-tokens", "6", "--resume")  # fmt: skip
    assert code == 0, err
    with open_trace(tmp_path / "partial.h5") as trace:
        resumed = {(r.id, r.sample_index): tokens(r) for r in trace}
        assert trace.complete and trace.num_requests == 3
    assert resumed == {key: tokens(r) for key, r in full.items()}


def test_a_stop_string_ends_a_line_where_its_text_first_holds_it(tmp_path):
    base, _ = record(tmp_path, [{"id": "s", "prompt": "def f(x):"}], "--max-tokens", "30",
                     "--ignore-eos")  # fmt: skip
    tok = Tokenizer.from_dir(DEMO_DIR)
    out = tokens(base["s", 0])
    text = tok.decode(out)
    stop = text[4:6]
    cut = next(i for i in range(1, len(out) + 1) if stop in tok.decode(out[:i]))
    line = {"id": "s", "prompt": "def f(x):", "stop": stop}
    done, _ = record(tmp_path, [line], "--max-tokens", "30", "--ignore-eos")
    assert tokens(done["s", 0]) == out[:cut] and done["s", 0].finish_reason == "stop"


def test_per_line_ignore_eos_min_tokens_and_penalties_equal_their_cli_or_free_runs(tmp_path):
    line = {"id": "a", "prompt": "Hello", "max_tokens": 12}
    by_flag, _ = record(tmp_path, [line], "--ignore-eos")
    by_line, _ = record(tmp_path, [{**line, "ignore_eos": True}])
    assert tokens(by_line["a", 0]) == tokens(by_flag["a", 0])
    plain, _ = record(tmp_path, [line])
    penalized, _ = record(tmp_path, [{**line, "repetition_penalty": 1.5, "frequency_penalty": 1}])
    assert tokens(penalized["a", 0]) != tokens(plain["a", 0])
    space = 32  # a stop token the demo emits early; min_tokens holds it back
    held, _ = record(tmp_path, [{**line, "stop_token_ids": [space], "min_tokens": 6}])
    out = tokens(held["a", 0])
    assert space not in out[:6] and len(out) >= 6


def demo_with_generation_config(tmp: Path, **config) -> Path:
    model = tmp / "demo-copy"
    shutil.copytree(DEMO_DIR, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 257, **config}))
    return model


def test_generation_config_supplies_the_defaults_and_the_summary_says_so(tmp_path):
    model = demo_with_generation_config(
        tmp_path, temperature=0.7, top_k=3, max_new_tokens=5, do_sample=True
    )
    line = {"id": "g", "prompt": "The experts"}
    auto, err = record(tmp_path, [line], model=str(model), quiet=False)
    path = model / "generation_config.json"
    assert f"sampling defaults: temperature 0.7, top_k 3, max_tokens 5 ({path})" in err
    explicit, _ = record(tmp_path, [line], "--generation-config", "vllm", "--temperature", "0.7",
                         "--top-k", "3", "--max-tokens", "5", model=str(model))  # fmt: skip
    assert tokens(auto["g", 0]) == tokens(explicit["g", 0]) and len(tokens(auto["g", 0])) == 5
    neutral, err = record(
        tmp_path, [line], "--generation-config", "vllm", model=str(model), quiet=False
    )
    assert "sampling defaults: max_tokens 16, greedy (moetrace's default)" in err
    greedy, _ = record(tmp_path, [line], "--temperature", "0", model=str(model))
    assert tokens(greedy["g", 0]) == tokens(neutral["g", 0])[:5]  # the rest from the file
    line_wins, _ = record(tmp_path, [{**line, "max_tokens": 2}], model=str(model))
    assert len(tokens(line_wins["g", 0])) == 2
    with open_trace(tmp_path / "t.h5") as trace:
        sources = trace.metadata["engine_settings"]["sampling_defaults"]["sources"]
    assert sources == {"temperature": str(path), "top_k": str(path), "max_tokens": str(path)}


def test_a_bad_generation_config_is_one_line(tmp_path):
    model = demo_with_generation_config(tmp_path, temperature=-1)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    code, _, err = run_cli("record", str(model), str(prompts), "-o", str(tmp_path / "t.h5"))
    assert code == 1
    assert err.strip() == (
        f"error: {model / 'generation_config.json'}: 'temperature': expected a finite number "
        ">= 0, got -1"
    )
    assert not np.any([p.name == "t.h5" for p in tmp_path.iterdir()])


def test_a_line_asking_for_logprobs_gets_them_in_the_trace(tmp_path):
    lines = [{"id": "a", "prompt": "Hello", "logprobs": 2}, {"id": "b", "prompt": "World"}]
    by_line, err = record(tmp_path, lines, "--max-tokens", "5", quiet=False)
    assert "logprobs True (a prompt line's logprobs)" in err
    by_flag, _ = record(tmp_path, [{k: v for k, v in x.items() if k != "logprobs"} for x in lines],
                        "--max-tokens", "5", "--logprobs")  # fmt: skip
    for key, req in by_flag.items():
        np.testing.assert_array_equal(by_line[key].output_logprobs, req.output_logprobs)
        assert np.isfinite(req.output_logprobs).all() and len(req.output_logprobs) == 5
    prompts = write_jsonl(tmp_path / "p.jsonl", lines)
    code, _, err = run_cli("record", "demo", "-", "-o", str(tmp_path / "s.h5"), "--max-tokens",
                           "5", stdin=prompts.read_text())  # fmt: skip
    assert code == 0, err
    assert "1 line(s) of standard input asked for logprobs" in err
