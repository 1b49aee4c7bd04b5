"""Prompt input: every accepted form, and an exact, located message for every mistake."""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.prompt_lines import MSGS, NAME, _valid_or_input_error, keyed, lines, near_valid

from moetrace.errors import InputError
from moetrace.inputs.prompts import (
    PromptReader,
    PromptSpec,
    iter_prompts,
    parse_line,
    read_prompts,
)


@pytest.fixture
def write(tmp_path, monkeypatch):
    """Write lines to ./prompts.jsonl, so error messages carry the short name."""
    monkeypatch.chdir(tmp_path)

    def _write(*lines: str | dict, raw: bytes | None = None) -> str:
        if raw is None:
            text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
            raw = text.encode("utf-8")
        Path(NAME).write_bytes(raw)
        return NAME

    return _write


def error_of(line: str | dict) -> str:
    """The message for ``line`` when it is line 3 of prompts.jsonl."""
    text = line if isinstance(line, str) else json.dumps(line)
    with pytest.raises(InputError) as info:
        parse_line(text, source=NAME, line=3)
    return str(info.value)


# --- accepted forms -----------------------------------------------------------------


def test_prompt_text(write):
    (spec,) = read_prompts(write({"prompt": "Hello"}))
    assert spec == PromptSpec(id="0", line=1, index=0, text="Hello")
    assert spec.token_ids is None and spec.messages is None and spec.sampling == {}


def test_token_ids_and_messages(write):
    path = write(
        {"prompt_token_ids": [1, 2, 3]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
    )
    a, b = read_prompts(path)
    assert a.token_ids == [1, 2, 3] and a.text is None
    assert b.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert (b.id, b.index, b.line) == ("1", 1, 2)


def test_every_sampling_override():
    spec = parse_line(
        json.dumps(
            {
                "id": "x",
                "prompt": "p",
                "max_tokens": 4,
                "temperature": 0,
                "top_p": 1,
                "top_k": 5,
                "seed": -3,
                "stop_token_ids": [0, 7],
            }
        )
    )
    assert spec.sampling == {
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 5,
        "seed": -3,
        "stop_token_ids": [0, 7],
    }
    assert isinstance(spec.sampling["temperature"], float)


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_off_is_zero(off):
    assert parse_line(json.dumps({"prompt": "p", "top_k": off})).sampling == {"top_k": 0}


def test_aliases_nulls_and_int_ids():
    spec = parse_line(
        json.dumps(
            {"id": 7, "prompt": "p", "max_completion_tokens": 9, "seed": None, "top_p": None}
        )
    )
    assert spec.id == "7"
    assert spec.sampling == {"max_tokens": 9}


def test_text_content_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    spec = parse_line(json.dumps({"messages": [{"role": "user", "content": parts, "name": "n"}]}))
    assert spec.messages == [{"role": "user", "content": "a\nb", "name": "n"}]


def test_blank_lines_crlf_and_bom_keep_line_numbers(write):
    raw = b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n   \n{"prompt": "b"}\r\n'
    a, b = read_prompts(write(raw=raw))
    assert (a.line, a.index, a.text) == (1, 0, "a")
    assert (b.line, b.index, b.id, b.text) == (4, 1, "1", "b")


def test_openai_batch_chat(write):
    line = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "anything",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
            "temperature": 0.5,
            "stop": None,
            "n": 1,
            "stream": False,
        },
    }
    (spec,) = read_prompts(write(line))
    assert spec.id == "req-1"
    assert spec.messages == [{"role": "user", "content": "hi"}]
    assert spec.sampling == {"max_tokens": 3, "temperature": 0.5, "n": 1}


def test_openai_batch_completions_text_and_ids():
    base = {"custom_id": "c", "method": "POST", "url": "/v1/completions"}
    text = parse_line(json.dumps({**base, "body": {"model": "m", "prompt": "once", "seed": 1}}))
    assert (text.id, text.text, text.sampling) == ("c", "once", {"seed": 1})
    ids = parse_line(json.dumps({**base, "body": {"prompt": [5, 6], "stop": []}}))
    assert ids.token_ids == [5, 6] and ids.text is None


def test_batch_line_without_custom_id_gets_index():
    spec = parse_line(json.dumps({"url": "/v1/completions", "body": {"prompt": "x"}}), index=4)
    assert spec.id == "4"


def test_plain_prompt_may_be_a_token_list():
    assert parse_line(json.dumps({"prompt": [3, 4]})).token_ids == [3, 4]


# --- every mistake, located ----------------------------------------------------------

P = NAME + ":3: "
BATCH = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "hi" "x"}', "not valid JSON (Expecting ',' delimiter at column 17)"),
        ('{"prompt": "hi"', "not valid JSON (Expecting ',' delimiter at column 16)"),
        ('{"prompt": "a", "prompt": "b"}', "field 'prompt': given twice"),
        ("[1, 2]", "expected a JSON object, got an array"),
        ('"text"', "expected a JSON object, got a string"),
        ("[" * 100_000, "not valid JSON (nested too deeply)"),
        (
            {"prompt": "p", "max_tokens": "ten"},
            "field 'max_tokens': expected a positive integer (at most 2147483647), got \"ten\"",
        ),
        (
            {"prompt": "p", "max_tokens": 0},
            "field 'max_tokens': expected a positive integer (at most 2147483647), got 0",
        ),
        (
            {"prompt": "p", "max_tokens": 2.0},
            "field 'max_tokens': expected a positive integer (at most 2147483647), got 2.0",
        ),
        (
            {"prompt": "p", "max_tokens": True},
            "field 'max_tokens': expected a positive integer (at most 2147483647), got true",
        ),
        (
            {"prompt": "p", "max_completion_tokens": -1},
            "field 'max_completion_tokens': expected a positive integer (at most 2147483647), got -1",
        ),
        (
            {"prompt": "p", "max_tokens": 1, "max_completion_tokens": 1},
            "field 'max_completion_tokens': conflicts with 'max_tokens' (give only one)",
        ),
        (
            {"prompt": "p", "temperature": -0.5},
            "field 'temperature': expected a finite number >= 0, got -0.5",
        ),
        (
            {"prompt": "p", "temperature": False},
            "field 'temperature': expected a finite number >= 0, got false",
        ),
        (
            {"prompt": "p", "temperature": "1"},
            "field 'temperature': expected a finite number >= 0, got \"1\"",
        ),
        (
            '{"prompt": "p", "temperature": NaN}',
            "field 'temperature': expected a finite number >= 0, got NaN",
        ),
        (
            '{"prompt": "p", "temperature": Infinity}',
            "field 'temperature': expected a finite number >= 0, got Infinity",
        ),
        ({"prompt": "p", "top_p": 0}, "field 'top_p': expected a number in (0, 1], got 0"),
        ({"prompt": "p", "top_p": 1.5}, "field 'top_p': expected a number in (0, 1], got 1.5"),
        (
            {"prompt": "p", "top_k": -2},
            "field 'top_k': expected a positive integer (at most 2147483647; 0 or -1 to disable), got -2",
        ),
        (
            {"prompt": "p", "top_k": True},
            "field 'top_k': expected a positive integer (at most 2147483647; 0 or -1 to disable), got true",
        ),
        ({"prompt": "p", "seed": "7"}, "field 'seed': expected a 64-bit integer, got \"7\""),
        ({"prompt": "p", "seed": 2**64}, f"field 'seed': expected a 64-bit integer, got {2**64}"),
        (
            {"prompt": "p", "stop_token_ids": [1, -1]},
            "field 'stop_token_ids[1]': expected a token id (integer >= 0), got -1",
        ),
        (
            {"prompt": "p", "stop_token_ids": 5},
            "field 'stop_token_ids': expected a list of token ids, got 5",
        ),
        ({"prompt": ""}, "field 'prompt': empty prompt"),
        ({"prompt": 5}, "field 'prompt': expected a string or a list of token ids, got 5"),
        (
            {"prompt": ["a", "b"]},
            "field 'prompt': a list of prompts is not supported; put one prompt per line",
        ),
        ('{"prompt": "\\ud800"}', "field 'prompt': contains an unpaired UTF-16 surrogate"),
        ({"prompt_token_ids": []}, "field 'prompt_token_ids': empty token list"),
        (
            {"prompt_token_ids": [1, -2]},
            "field 'prompt_token_ids[1]': expected a token id (integer >= 0), got -2",
        ),
        (
            {"prompt_token_ids": [True]},
            "field 'prompt_token_ids[0]': expected a token id (integer >= 0), got true",
        ),
        (
            {"prompt_token_ids": [2**31]},
            f"field 'prompt_token_ids[0]': expected a token id (integer >= 0), got {2**31}",
        ),
        ({"messages": []}, "field 'messages': empty message list"),
        ({"messages": "hi"}, "field 'messages': expected a list of messages, got \"hi\""),
        ({"messages": [{"content": "x"}]}, "field 'messages[0]': missing 'role'"),
        ({"messages": [{"role": "user"}]}, "field 'messages[0]': missing 'content'"),
        (
            {"messages": [MSGS[0], {"role": "", "content": "x"}]},
            "field 'messages[1].role': empty string",
        ),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "field 'messages[0].content': expected a string or a list of text parts, got 3",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            'field \'messages[0].content[0]\': only {"type": "text", "text": ...} parts are supported, got {"type": "image_url"}',
        ),
        ({"text": "p"}, "field 'text': unknown field"),
        (
            {"prompt": "p", "max_token": 3},
            "field 'max_token': unknown field (did you mean 'max_tokens'?)",
        ),
        ({"promt": "p"}, "field 'promt': unknown field (did you mean 'prompt'?)"),
        ({"id": "x"}, "no prompt: expected 'prompt' or 'prompt_token_ids' or 'messages'"),
        ({"prompt": None}, "no prompt: expected 'prompt' or 'prompt_token_ids' or 'messages'"),
        (
            {"prompt": "p", "messages": MSGS},
            "field 'messages': conflicts with 'prompt' (give exactly one prompt)",
        ),
        ({"prompt": "p", "id": True}, "field 'id': expected a string or integer, got true"),
        ({"prompt": "p", "id": ""}, "field 'id': empty string"),
        ({"prompt": "p", "id": [1]}, "field 'id': expected a string or integer, got [1]"),
        # OpenAI batch lines
        ({**BATCH, "body": {"messages": MSGS}, "prompt": "x"}, "field 'prompt': unknown field"),
        (
            {**BATCH, "url": "/v1/embeddings", "body": {}},
            'field \'url\': expected "/v1/chat/completions" or "/v1/completions", got "/v1/embeddings"',
        ),
        (
            {**BATCH, "url": [], "body": {}},
            'field \'url\': expected "/v1/chat/completions" or "/v1/completions", got []',
        ),
        (
            {**BATCH, "method": "GET", "body": {"messages": MSGS}},
            'field \'method\': expected "POST", got "GET"',
        ),
        ({"custom_id": "a", "url": "/v1/completions"}, "OpenAI batch line without 'body'"),
        ({"custom_id": "a", "body": {"prompt": "x"}}, "OpenAI batch line without 'url'"),
        ({**BATCH, "body": "hi"}, "field 'body': expected an object, got \"hi\""),
        (
            {**BATCH, "custom_id": False, "body": {"messages": MSGS}},
            "field 'custom_id': expected a string or integer, got false",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "stop": ["a", ""]}},
            "field 'body.stop': a stop string cannot be empty",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "stop": 3}},
            "field 'body.stop': expected a string or a list of strings, got 3",
        ),
        (
            {**BATCH, "body": {"prompt": "x"}},
            "field 'body.prompt': not used by /v1/chat/completions (use 'messages')",
        ),
        (
            {**BATCH, "url": "/v1/completions", "body": {"messages": MSGS}},
            "field 'body.messages': not used by /v1/completions (use 'prompt')",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "max_tokns": 2}},
            "field 'body.max_tokns': unknown field (did you mean 'max_tokens'?)",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "logprobs": 3}},
            "field 'body.logprobs': expected true or false, got 3",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "top_logprobs": 2}},
            "field 'body.top_logprobs': needs 'logprobs': true",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "n": 0}},
            "field 'body.n': expected a positive integer (at most 2147483647), got 0",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "n": True}},
            "field 'body.n': expected a positive integer (at most 2147483647), got true",
        ),
        (
            {
                **BATCH,
                "url": "/v1/completions",
                "body": {"prompt": "x", "chat_template_kwargs": {}},
            },
            "field 'body.chat_template_kwargs': unknown field",
        ),
        (
            {"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}},
            "field 'chat_template_kwargs': only for a chat prompt ('messages')",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "ignore_eos": "yes"}},
            "field 'body.ignore_eos': expected true or false, got \"yes\"",
        ),
        (
            {**BATCH, "body": {"messages": MSGS, "stream": True}},
            "field 'body.stream': only false is supported, got true",
        ),
        ({**BATCH, "body": {"model": "m"}}, "no prompt: expected 'body.messages'"),
        (
            {**BATCH, "body": {"messages": MSGS, "max_tokens": 0}},
            "field 'body.max_tokens': expected a positive integer (at most 2147483647), got 0",
        ),
        (
            {**BATCH, "body": {"messages": [{"role": "user", "content": None}]}},
            "field 'body.messages[0].content': expected a string or a list of text parts, got null",
        ),
    ],
)
def test_error_names_line_and_field(line, message):
    assert error_of(line) == P + message


def test_error_carries_structured_fields():
    with pytest.raises(InputError) as info:
        parse_line('{"prompt": "p", "top_p": 2}', source=NAME, line=9)
    assert (info.value.source, info.value.line, info.value.field) == (NAME, 9, "top_p")


def test_integer_too_long_to_convert_is_a_json_error():
    message = error_of('{"prompt": "p", "seed": ' + "9" * 5000 + "}")
    assert message.startswith(P + "not valid JSON (")


def test_invalid_utf8_names_the_line(write):
    path = write(raw=b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(
        InputError, match=r"^prompts\.jsonl:2: not valid UTF-8 \(invalid start byte at byte 13\)$"
    ):
        read_prompts(path)


def test_error_in_file_has_exact_line(write):
    path = write({"prompt": "a"}, "", '{"prompt": "b", "max_tokens": "ten"}')
    with pytest.raises(InputError) as info:
        read_prompts(path)
    assert (
        str(info.value)
        == "prompts.jsonl:3: field 'max_tokens': expected a positive integer (at most 2147483647), got \"ten\""
    )


# --- ids --------------------------------------------------------------------------


def test_duplicate_ids_name_both_lines(write):
    path = write({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"})
    with pytest.raises(InputError) as info:
        read_prompts(path)
    assert (
        str(info.value) == "prompts.jsonl:3: field 'id': duplicate id \"a\" (also used by line 1)"
    )


def test_int_and_str_ids_collide(write):
    with pytest.raises(InputError, match=r"^prompts\.jsonl:2: field 'id': duplicate id \"5\""):
        read_prompts(write({"id": 5, "prompt": "x"}, {"id": "5", "prompt": "y"}))


def test_duplicate_custom_id(write):
    line = {"custom_id": "q", "url": "/v1/completions", "body": {"prompt": "x"}}
    with pytest.raises(
        InputError,
        match=r"^prompts\.jsonl:2: field 'custom_id': duplicate id \"q\" \(also used by line 1\)$",
    ):
        read_prompts(write(line, line))


def test_explicit_id_clashing_with_earlier_default(write):
    with pytest.raises(InputError) as info:
        read_prompts(write({"prompt": "x"}, {"id": "0", "prompt": "y"}))
    assert str(info.value) == (
        "prompts.jsonl:2: field 'id': duplicate id \"0\" (also used by line 1's default id)"
    )


def test_default_id_clashing_with_earlier_explicit(write):
    with pytest.raises(InputError) as info:
        read_prompts(write({"id": "1", "prompt": "x"}, {"prompt": "y"}))
    assert str(info.value) == (
        'prompts.jsonl:2: default id "1" (the line\'s index) is already used by line 1; '
        "give this line an explicit 'id'"
    )


# --- sources ------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"\n  \n\r\n"])
def test_empty_input(write, raw):
    with pytest.raises(InputError, match=r"^prompts\.jsonl: contains no prompts$"):
        read_prompts(write(raw=raw))


def test_missing_file_fails_at_call_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as info:
        iter_prompts("nope.jsonl")
    assert str(info.value) == "nope.jsonl: no such file"
    assert (info.value.line, info.value.field) == (None, None)


def test_directory_is_rejected(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        read_prompts(tmp_path)


def test_stdin_bytes(monkeypatch):
    data = b'{"prompt": "a"}\n{"prompt": "b", "top_k": "x"}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    with pytest.raises(InputError) as info:
        read_prompts("-")
    assert str(info.value).startswith("<stdin>:2: field 'top_k': ")


def test_stdin_text_stream(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "é"}\n'))
    (spec,) = read_prompts("-")
    assert spec.text == "é"


def test_empty_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(InputError, match=r"^<stdin>: contains no prompts$"):
        read_prompts("-")


# --- laziness and skipping ------------------------------------------------------------


def test_iteration_is_lazy(write):
    path = write({"prompt": "a"}, "not json")
    it = iter(iter_prompts(path))
    assert next(it).text == "a"
    with pytest.raises(InputError, match=r"^prompts\.jsonl:2: not valid JSON"):
        next(it)


def test_skip_invalid_collects_errors(write):
    path = write(
        {"prompt": "a"},
        '{"prompt": "b", "temperature": -1}',
        "",
        "{oops",
        {"prompt": "c", "id": "0"},
        {"prompt_token_ids": [4]},
    )
    reader = iter_prompts(path, skip_invalid=True)
    assert isinstance(reader, PromptReader)
    specs = list(reader)
    assert [(s.id, s.index, s.line) for s in specs] == [("0", 0, 1), ("1", 1, 6)]
    assert reader.count == 2
    assert [(e.line, e.field) for e in reader.errors] == [(2, "temperature"), (4, None), (5, "id")]
    assert all(isinstance(e, InputError) for e in reader.errors)
    assert str(reader.errors[2]) == (
        "prompts.jsonl:5: field 'id': duplicate id \"0\" (also used by line 1's default id)"
    )


def test_reader_can_be_iterated_again(write):
    reader = iter_prompts(write({"prompt": "a"}, "x"), skip_invalid=True)
    assert len(list(reader)) == 1 and len(reader.errors) == 1
    assert len(list(reader)) == 1 and len(reader.errors) == 1


def test_skip_invalid_with_nothing_valid_still_fails(write):
    reader = iter_prompts(write("{", '{"prompt": ""}'), skip_invalid=True)
    with pytest.raises(InputError) as info:
        list(reader)
    assert str(info.value).startswith(
        "prompts.jsonl: contains no valid prompts (2 invalid lines skipped; first: prompts.jsonl:1: "
    )
    assert len(reader.errors) == 2


# --- fuzz: anything either parses or is an InputError -----------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keyed | near_valid())
def test_fuzz_parse_line(obj):
    _valid_or_input_error(json.dumps(obj))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines, max_size=6), st.booleans())
def test_fuzz_files(items, skip):
    raw = b"\n".join(
        x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in items
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.jsonl"
        path.write_bytes(raw)
        reader = iter_prompts(path, skip_invalid=skip)
        try:
            specs = list(reader)
        except InputError:
            return
        assert [s.index for s in specs] == list(range(len(specs)))
        assert len({s.id for s in specs}) == len(specs)
