"""Model ids from the local Hugging Face cache, and prompts encoded as vLLM encodes them.

The cache is laid out as huggingface_hub lays it out (blobs, snapshots of
symlinks, refs); the encodings are checked against transformers' tokenizer
on the same files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
import transformers
from support.hub_cache import add_snapshot
from support.reliability import VOCAB, run_cli, tiny_checkpoint, write_jsonl

from moetrace import open_trace
from moetrace.models.demo import DEMO_DIR

REPO = "acme/Demo-MoE"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A cache with the demo at main and a second revision 'v2' of different length limit."""
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, REPO, DEMO_DIR, "a" * 40, "main")
    other = tmp_path / "demo-v2"
    shutil.copytree(DEMO_DIR, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 333}))
    add_snapshot(cache, REPO, other, "b" * 40, "v2")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return cache


def record(tmp: Path, model: str, *args: str, lines=None) -> tuple[int, str]:
    prompts = write_jsonl(tmp / "p.jsonl", lines or [{"id": "a", "prompt": "Hello"}])
    code, _, err = run_cli("record", model, str(prompts), "-o", str(tmp / "t.h5"), "-q",
                           "--overwrite", "--max-tokens", "3", *args)  # fmt: skip
    return code, err


def test_a_model_id_records_from_the_cache_at_main_or_a_revision(hub, tmp_path):
    code, err = record(tmp_path, REPO)
    assert code == 0, err
    with open_trace(tmp_path / "t.h5") as trace:
        md = trace.metadata
        main_tokens = trace.request("a").output_token_ids.tolist()
    assert md["model"] == REPO
    assert md["engine_settings"]["model_commit"] == "a" * 40
    code, err = record(tmp_path, REPO, "--revision", "v2")
    assert code == 0, err
    with open_trace(tmp_path / "t.h5") as trace:
        md = trace.metadata
        assert trace.request("a").output_token_ids.tolist() == main_tokens  # same weights
    assert md["model"] == f"{REPO}@v2" and md["engine_settings"]["max_model_len"] == 333
    assert md["engine_settings"]["model_commit"] == "b" * 40
    code, err = record(tmp_path, REPO, "--revision", "b" * 40)  # a commit works as well
    assert code == 0, err


def test_what_the_cache_lacks_is_one_line_and_nothing_is_fetched(hub, tmp_path):
    code, err = record(tmp_path, "acme/Other")
    assert code == 1 and err.count("\n") == 1
    assert "'acme/Other': no such directory, and not in the Hugging Face cache" in err
    assert str(hub) in err and "moetrace never downloads" in err
    code, err = record(tmp_path, REPO, "--revision", "v9")
    assert code == 1 and "revision 'v9' is not in the Hugging Face cache (cached: main, v2" in err
    code, err = record(tmp_path, "demo", "--revision", "v2")
    assert code == 1 and "'demo' is the built-in model, not a model id" in err
    code, err = record(tmp_path, str(tmp_path), "--revision", "v2")
    assert code == 1 and "is a directory, not a model id from the Hugging Face cache" in err
    code, err = record(tmp_path, "demo", "--tokenizer", "nope")
    assert code == 1 and "--tokenizer nope: no such directory, and not a model id" in err
    code, err = record(tmp_path, REPO, "--trust-remote-code")
    assert code == 1 and "never runs code shipped with a checkpoint" in err
    assert not (tmp_path / "t.h5").exists()


def test_tokenizer_option_takes_a_directory_or_a_cached_id(hub, tmp_path):
    model = tiny_checkpoint(tmp_path / "tiny", vocab_size=max(VOCAB, 260))
    text = [{"id": "a", "prompt": "Hi"}]
    code, err = record(tmp_path, str(model), "--load-format", "dummy", lines=text)
    assert code == 1 and "no tokenizer.json" in err
    for tok in (str(DEMO_DIR), REPO):
        code, err = record(tmp_path, str(model), "--load-format", "dummy", "--tokenizer", tok,
                           lines=text)  # fmt: skip
        assert code == 0, err
        with open_trace(tmp_path / "t.h5") as trace:
            assert trace.request("a").prompt_token_ids.tolist() == [72, 105]


# -- prompts encoded as vLLM encodes them -----------------------------------------------------


def bos_checkpoint(directory: Path) -> Path:
    """A tiny checkpoint whose tokenizer's post-processor adds BOS (as Llama's and DeepSeek's do)."""
    model = tiny_checkpoint(directory, vocab_size=64)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("abcdefgh ?<>|")}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tok.save(str(model / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "chat_template": template}  # fmt: skip
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_text_and_chat_prompts_get_the_ids_transformers_gives(tmp_path):
    model = bos_checkpoint(tmp_path / "bos")
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    chat = [{"role": "user", "content": "ab ba?"}]
    lines = [
        {"id": "text", "prompt": "abc dea"},
        {"id": "bare", "prompt": "abc dea", "add_special_tokens": False},
        {"id": "chat", "messages": chat},
        {"id": "open", "messages": chat, "add_generation_prompt": False},
    ]
    code, err = record(tmp_path, str(model), "--load-format", "dummy", lines=lines)
    assert code == 0, err
    want = {
        "text": reference("abc dea")["input_ids"],
        "bare": reference("abc dea", add_special_tokens=False)["input_ids"],
        "chat": reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
        "open": reference.apply_chat_template(chat, add_generation_prompt=False, tokenize=False),
    }
    for key in ("chat", "open"):  # rendered, then encoded without special tokens (vLLM's chat)
        want[key] = reference(want[key], add_special_tokens=False)["input_ids"]
    assert want["text"][0] == 0 and want["bare"][0] != 0 and want["chat"].count(0) == 1
    with open_trace(tmp_path / "t.h5") as trace:
        got = {r.id: r.prompt_token_ids.tolist() for r in trace}
    assert got == want
