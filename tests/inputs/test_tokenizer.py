"""Tokenizers: a real trained one read from disk, chat templates, and the demo byte tokenizer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from moetrace.errors import ModelError
from moetrace.inputs.tokenizer import (
    BYTE_ASSISTANT_ID,
    BYTE_BOS_ID,
    BYTE_CHAT_TEMPLATE,
    BYTE_EOS_ID,
    BYTE_SPECIAL_TOKENS,
    BYTE_USER_ID,
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    ChatTemplateError,
    Tokenizer,
    byte_level_chars,
)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizer",
    "a mixture of experts routes every token to a few experts",
    "ünïcödé and emoji 😀 survive byte-level BPE",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..3
CHATML = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  hello world  "},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "and the fox?"},
]
RENDERED = (
    "<s><|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nhello world<|im_end|>\n"
    "<|im_start|>assistant\nhello<|im_end|>\n"
    "<|im_start|>user\nand the fox?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def trained() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 5, trainer)
    return tok


@pytest.fixture
def make_checkpoint(trained, tmp_path):
    """Write a checkpoint directory; ``files`` maps extra file names to JSON or text."""

    def _make(config: dict | None = None, **files: object) -> Path:
        directory = tmp_path / "ckpt"
        directory.mkdir(exist_ok=True)
        trained.save(str(directory / "tokenizer.json"))
        base = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": {"content": "<s>", "special": True, "__type": "AddedToken"},
            "eos_token": "<|im_end|>",
            "clean_up_tokenization_spaces": False,
            "chat_template": CHATML,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
        for name, content in files.items():
            name = name.replace("__", ".")
            text = content if isinstance(content, str) else json.dumps(content)
            (directory / name).write_text(text)
        return directory

    return _make


def hf_ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


# --- a trained tokenizer read from disk ------------------------------------------------


def test_round_trip(make_checkpoint):
    tok = Tokenizer.from_dir(make_checkpoint())
    for text in [*SENTENCES, "never seen: zebra ∑ 🚀\n\ttabs", ""]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("hello world") != list(b"hello world")  # merges were learned
    assert tok.path == str(make_checkpoint() / "tokenizer.json")
    assert tok.vocab_size == 320


def test_special_tokens_in_text_and_decode(make_checkpoint):
    tok = Tokenizer.from_dir(make_checkpoint())
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == 3
    assert tok.decode(ids) == "hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_no_bos_unless_config_asks(make_checkpoint):
    assert Tokenizer.from_dir(make_checkpoint()).encode("hello")[0] != 0
    with_bos = Tokenizer.from_dir(make_checkpoint({"add_bos_token": True}))
    plain = Tokenizer.from_dir(make_checkpoint({"add_bos_token": False}))
    assert with_bos.encode("hello") == [0, *plain.encode("hello")]
    # The template writes its own bos; it must not be doubled.
    assert with_bos.apply_chat_template(MESSAGES)[:2] != [0, 0]


def test_bos_requested_but_unknown_is_ignored(make_checkpoint):
    tok = Tokenizer.from_dir(make_checkpoint({"add_bos_token": True, "bos_token": "<nope>"}))
    assert tok.encode("a") == Tokenizer.from_dir(make_checkpoint()).encode("a")


def test_chat_template_rendering(make_checkpoint):
    tok = Tokenizer.from_dir(make_checkpoint())
    assert tok.render_chat_template(MESSAGES) == RENDERED
    ids = tok.apply_chat_template(MESSAGES)
    assert ids[0] == 0 and ids.count(2) == 5  # one bos, five <|im_start|>
    assert tok.decode(ids) == RENDERED
    no_prompt = tok.render_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt == RENDERED.removesuffix("<|im_start|>assistant\n")


def test_matches_transformers(make_checkpoint):
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint()
    ours = Tokenizer.from_dir(directory)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    for text in SENTENCES:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == RENDERED
    expected = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == hf_ids(expected)


def test_template_raise_exception(make_checkpoint):
    tok = Tokenizer.from_dir(make_checkpoint())
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    assert str(info.value) == "chat template rejected the messages: unknown role: robot"
    assert info.value.problem == "unknown role: robot"
    assert isinstance(info.value, ModelError)


def test_missing_template(make_checkpoint):
    tok = Tokenizer.from_dir(make_checkpoint({"chat_template": None}))
    assert tok.encode("hello")  # plain text still works
    with pytest.raises(ModelError, match="has no chat template.*not 'messages'$"):
        tok.apply_chat_template(MESSAGES)


def test_named_templates_take_default(make_checkpoint):
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
    ]
    tok = Tokenizer.from_dir(make_checkpoint({"chat_template": named}))
    assert tok.render_chat_template(MESSAGES) == "Be brief."
    no_default = Tokenizer.from_dir(make_checkpoint({"chat_template": named[:1]}))
    with pytest.raises(ModelError, match="no chat template"):
        no_default.apply_chat_template(MESSAGES)


def test_template_file_precedence(make_checkpoint):
    only_json = make_checkpoint(chat_template__json={"chat_template": "json"})
    assert Tokenizer.from_dir(only_json).render_chat_template(MESSAGES) == "json"
    both = make_checkpoint(chat_template__jinja="jinja {{ messages | length }}")
    assert Tokenizer.from_dir(both).render_chat_template(MESSAGES) == "jinja 4"


def test_template_errors_are_one_line_model_errors(make_checkpoint):
    bad_syntax = Tokenizer.from_dir(make_checkpoint({"chat_template": "{% for %}"}))
    with pytest.raises(
        ModelError, match=r"tokenizer_config\.json: chat template is not valid Jinja"
    ):
        bad_syntax.apply_chat_template(MESSAGES)
    # The sandbox is immutable: templates cannot change the messages.
    mutating = Tokenizer.from_dir(make_checkpoint({"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(ModelError, match="chat template failed: SecurityError") as info:
        mutating.apply_chat_template(MESSAGES)
    assert "\n" not in str(info.value)
    escaping = Tokenizer.from_dir(make_checkpoint({"chat_template": "{{ ''.__class__.__mro__ }}"}))
    with pytest.raises(ModelError, match="chat template failed"):
        escaping.apply_chat_template(MESSAGES)


def test_tojson_is_plain_json(make_checkpoint):
    template = "{{ messages[0] | tojson }}|{{ tools | tojson(indent=1) }}"
    tok = Tokenizer.from_dir(make_checkpoint({"chat_template": template}))
    out = tok.render_chat_template([{"role": "user", "content": "<a & 'ü'>"}], tools=[1])
    assert out == '{"role": "user", "content": "<a & \'ü\'>"}|[\n 1\n]'


def test_eos_ids(make_checkpoint):
    # tokenizer_config's eos_token alone
    assert Tokenizer.from_dir(make_checkpoint()).eos_token_ids == [3]
    # generation_config first, eos token appended when missing
    gen = make_checkpoint(generation_config__json={"eos_token_id": [1, 3]})
    assert Tokenizer.from_dir(gen).eos_token_ids == [1, 3]
    (gen / "generation_config.json").unlink()
    cfg = make_checkpoint(config__json={"eos_token_id": 1})
    assert Tokenizer.from_dir(cfg).eos_token_ids == [1, 3]


def test_missing_or_broken_files(tmp_path, make_checkpoint):
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    directory = make_checkpoint()
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"tokenizer_config\.json: cannot read"):
        Tokenizer.from_dir(directory)
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ModelError, match=r"tokenizer\.json: cannot load") as info:
        Tokenizer.from_dir(directory)
    assert "\n" not in str(info.value)


# --- the demo byte tokenizer -----------------------------------------------------------


def test_byte_constants():
    assert (BYTE_BOS_ID, BYTE_EOS_ID, BYTE_USER_ID, BYTE_ASSISTANT_ID) == (256, 257, 258, 259)
    assert BYTE_VOCAB_SIZE == 260
    tok = ByteTokenizer()
    assert tok.vocab_size == 260 and tok.eos_token_ids == [257] and tok.path is None


def test_byte_encode_decode():
    tok = ByteTokenizer()
    assert tok.encode("Aé") == [65, 0xC3, 0xA9]
    assert tok.encode("") == []
    assert tok.encode("a<|eos|>b") == [97, 257, 98]
    assert tok.decode([72, 105, 257]) == "Hi<|eos|>"
    assert tok.decode([72, 105, 257], skip_special_tokens=True) == "Hi"
    assert tok.decode([0xC3, 0xA9, 999]) == "é"  # unknown ids are dropped
    assert tok.decode([0xC3]) == "\ufffd"


def test_byte_chat_template():
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids = tok.apply_chat_template(messages)
    assert ids == [BYTE_USER_ID, 104, 105, BYTE_ASSISTANT_ID, 121, 111, BYTE_ASSISTANT_ID]
    assert tok.apply_chat_template([{"role": "system", "content": ""}])[0] == BYTE_USER_ID


def test_byte_level_table_is_the_standard_one():
    chars = byte_level_chars()
    assert len(set(chars)) == 256
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    # The byte-level pre-tokenizer maps ASCII bytes to these very characters.
    text = "".join(chr(b) for b in range(128))
    (piece,) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(
        text
    )
    assert piece[0] == "".join(chars[:128])


@pytest.fixture(scope="module")
def saved_byte(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("demo")
    ByteTokenizer().save(directory)
    return directory


def test_byte_save_writes_a_normal_checkpoint(saved_byte):
    loaded = Tokenizer.from_dir(saved_byte)
    ours = ByteTokenizer()
    assert loaded.vocab_size == BYTE_VOCAB_SIZE
    assert loaded.eos_token_ids == [BYTE_EOS_ID]
    assert loaded.chat_template == BYTE_CHAT_TEMPLATE
    for i, name in BYTE_SPECIAL_TOKENS.items():
        assert loaded.encode(name) == [i]
    raw = json.loads((saved_byte / "tokenizer.json").read_text())
    assert raw["model"]["vocab"] == {c: b for b, c in enumerate(byte_level_chars())}
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "héllo <|eos|>"},
        {"role": "assistant", "content": "😀"},
    ]
    assert loaded.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert loaded.render_chat_template(messages) == ours.render_chat_template(messages)


def test_byte_save_loads_in_transformers(saved_byte):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(saved_byte))
    ours = ByteTokenizer()
    text = "naïve <|user|> 🚀"
    assert hf(text)["input_ids"] == ours.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert hf_ids(out) == ours.apply_chat_template(messages)


special_bits = st.sampled_from(["<|", "|>", "<|user|>", "<|eos|>", "<|bos|", "assistant", "<"])
texts = st.lists(st.text(max_size=6) | special_bits, max_size=8).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=texts, ids=st.lists(st.integers(0, BYTE_VOCAB_SIZE + 3), max_size=12))
def test_byte_tokenizer_equals_saved_file(saved_byte, text, ids):
    loaded = Tokenizer.from_dir(saved_byte)
    ours = ByteTokenizer()
    assert loaded.encode(text) == ours.encode(text)
    if "<|" not in text:
        assert ours.encode(text) == list(text.encode("utf-8"))
    assert ours.decode(ours.encode(text)) == text
    for skip in (False, True):
        assert loaded.decode(ids, skip_special_tokens=skip) == ours.decode(
            ids, skip_special_tokens=skip
        )
