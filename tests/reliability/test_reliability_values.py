"""Values the checks used to accept but a run could not hold: one line each, before any work.

A prompt line and the command line are held to the same rules
(``moetrace.engine.sampling.SAMPLING_RULES``); engine options and over-long
lines are refused before the model loads, and nothing is written.
"""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest
from support.reliability import (
    assert_one_line_error,
    record_args,
    requests_by_id,
    run_cli,
    run_proc,
    tiny_checkpoint,
    write_jsonl,
)

from moetrace.inputs.prompts import iter_prompts

OK = {"id": "ok", "prompt_token_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


# (field, value as JSON, value as an option, what both messages say)
SAME_RULES = [
    ("temperature", float("nan"), "nan", "expected a finite number >= 0"),
    ("temperature", float("inf"), "inf", "expected a finite number >= 0"),
    ("top_k", -5, "-5", "0 or -1 to disable"),
    ("top_k", 10**30, str(10**30), "at most 2147483647"),
    ("seed", 10**20 * 2, str(10**20 * 2), "expected a 64-bit integer"),
    ("max_tokens", 0, "0", "expected a positive integer"),
    ("top_p", 0, "0", "expected a number in (0, 1]"),
]


@pytest.mark.parametrize("field, value, option, says", SAME_RULES)
def test_a_line_and_the_command_line_refuse_the_same_values(
    tmp_path, model, field, value, option, says
):
    out = tmp_path / "t.h5"
    line = tmp_path / "line.jsonl"
    line.write_text(json.dumps({**OK, field: value}, allow_nan=True) + "\n")
    code, _, err = run_cli(*record_args(model, line, out))
    assert_one_line_error(code, err, f"line.jsonl:1: field '{field}'", says)
    plain = write_jsonl(tmp_path / "p.jsonl", [OK])
    code, _, err = run_cli(*record_args(model, plain, out, f"--{field.replace('_', '-')}", option))
    assert_one_line_error(code, err, f"--{field.replace('_', '-')}", says)
    assert not out.exists()


def test_top_k_of_1e30_on_a_line_is_refused(tmp_path, model):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2], "top_k": 1e30, "temperature": 1}\n')
    code, _, err = run_cli(*record_args(model, path, tmp_path / "t.h5"))
    assert_one_line_error(code, err, "p.jsonl:1: field 'top_k'")


def test_a_64_bit_seed_the_line_check_accepts_also_runs(tmp_path, model):
    """2**64 - 1 passed the line check, then overflowed the sampler's int64 mid-run.

    It is the bit pattern of -1 (torch's manual_seed reads seeds so), and samples as -1 does.
    """
    lines = [
        {"id": "big", "prompt_token_ids": [1, 2, 3], "seed": 2**64 - 1, "temperature": 1.0},
        {"id": "neg", "prompt_token_ids": [1, 2, 3], "seed": -1, "temperature": 1.0},
        {"id": "other", "prompt_token_ids": [1, 2, 3], "seed": 5, "temperature": 1.0},
    ]
    out = tmp_path / "t.h5"
    code, _, err = run_cli(*record_args(model, write_jsonl(tmp_path / "p.jsonl", lines), out))
    assert code == 0, err
    got = requests_by_id(out)
    assert (got["big"][0] == got["neg"][0]).all()
    assert not (got["big"][0] == got["other"][0]).all()


@pytest.mark.parametrize(
    "extra, needles",
    [
        (("--max-model-len", "0"), ("--max-model-len must be in 1..",)),
        (("--max-model-len", "-3"), ("--max-model-len must be in 1..",)),
        (("--num-kv-blocks", "1000000000000"), ("--num-kv-blocks must be in 1..",)),
        (("--num-kv-blocks", "200000000"), ("--num-kv-blocks 200000000", "2147483647 KV slots")),
        (("--num-kv-blocks", "100000000", "--block-size", "16"), ("GiB of KV cache", "memory")),
        (("--max-num-batched-tokens", "2000000000"), ("--max-num-batched-tokens", "memory")),
        (
            ("--block-size", str(1 << 20)),
            (
                "--block-size",
                "power of two up to",
            ),
        ),
        (("--flush-interval", "nan"), ("--flush-interval",)),
    ],
)
def test_engine_options_out_of_range_are_refused_before_the_model_loads(
    tmp_path, model, extra, needles
):
    out = tmp_path / "t.h5"
    prompts = write_jsonl(tmp_path / "p.jsonl", [OK])
    code, _, err = run_cli(*record_args(model, prompts, out, *extra))
    assert_one_line_error(code, err, *needles)
    assert not out.exists()


def test_closed_standard_input_is_one_line_and_no_file(tmp_path, model):
    """``record ... - <&-`` was a TypeError traceback from the intake thread, after the file."""
    out = tmp_path / "t.h5"
    proc = run_proc(*record_args(model, "-", out), preexec_fn=lambda: os.close(0))
    assert_one_line_error(proc.returncode, proc.stderr, "<stdin>", "standard input is closed")
    assert not out.exists() and not list(tmp_path.glob(".*"))


# ---------------------------------------------------------------------- over-long lines
def test_an_over_long_line_is_refused_as_it_is_read_in_bounded_memory(tmp_path):
    path = tmp_path / "p.jsonl"
    with path.open("w") as f:
        f.write(json.dumps(OK) + "\n")
        f.write('{"prompt_token_ids": [' + "7, " * 10_000_000 + "7]}\n")  # 30 MB
        f.write(json.dumps({"id": "after", "prompt_token_ids": [4]}) + "\n")
    reader = iter_prompts(path, skip_invalid=True, max_line_bytes=1 << 20)
    tracemalloc.start()
    try:
        specs = list(reader)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [s.id for s in specs] == ["ok", "after"]  # the next line is read as usual
    assert [e.line for e in reader.errors] == [2]
    assert "longer than 1,048,576 bytes" in str(reader.errors[0])
    assert peak < 4 << 20, f"peak {peak:,} bytes while reading a 30 MB line"


def test_record_refuses_a_line_longer_than_the_context_can_use(tmp_path, model):
    """The tiny model's context is 512 tokens: a 2 MB line cannot be a prompt for it."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(OK) + "\n" + json.dumps({"prompt_token_ids": [3] * 700_000}) + "\n")
    out = tmp_path / "t.h5"
    code, _, err = run_cli(*record_args(model, path, out))
    assert_one_line_error(code, err, "p.jsonl:2", "longer than 1,048,576 bytes")
    assert not out.exists()
