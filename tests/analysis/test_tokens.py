"""Token text as inspect shows it: decoded from the token's bytes, never GPT-2's byte-map glyphs.

The reference is the text the prompt was written as: the tokens' texts, markers
left out, join back to it; and a tokenizer built here with a merged two-byte
character shows that character, not the glyphs of its vocabulary entry.
"""

from __future__ import annotations

import json

import tokenizers
from support.cli import moetrace

from moetrace.analysis.tokens import PARTIAL, token_text
from moetrace.inputs.tokenizer import byte_level_chars

PROMPT = "Café à Zürich: 東京"


def test_the_tokens_view_shows_split_characters_where_they_complete(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "u", "prompt": PROMPT}) + "\n")
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "-q", "--max-tokens", "2",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(moetrace("inspect", "t.h5", "-r", "u", "--json", cwd=tmp_path).stdout)
    tokens = [t for t in report["token_table"][0]["tokens"] if t["part"] == "prompt"]
    texts = [t["text"] for t in tokens]
    assert "".join(texts).replace(PARTIAL, "") == PROMPT  # the demo's tokens are bytes
    assert texts.count(PARTIAL) == len(PROMPT.encode()) - len(PROMPT)  # one per held-back byte
    assert not any(glyph in "".join(texts) for glyph in ("Ã", "Â", "æ"))
    shown = moetrace("inspect", "t.h5", "-r", "u", "--view", "tokens", cwd=tmp_path).stdout
    assert " é " in shown and "東" in shown and "Ã" not in shown
    # Alone, a byte that makes no character is shown as that byte.
    single = moetrace("inspect", "t.h5", "--token", "195", "--json", cwd=tmp_path).stdout
    assert json.loads(single)["vocab"]["tokens"][0]["text"] == "\\xc3"


def test_a_merged_character_reads_as_the_character(tmp_path):
    glyphs = byte_level_chars()
    vocab = {c: i for i, c in enumerate(glyphs)}
    merged = glyphs[0xC3] + glyphs[0xA9]  # "Ã©": the vocabulary entry of "é"
    vocab[merged] = 256
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=[(glyphs[0xC3], glyphs[0xA9])])
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))

    class NoTrace:  # token_text reads only these when given a tokenizer
        tokenizer_files: dict = {}
        metadata: dict = {}

    text = token_text(NoTrace(), str(tmp_path / "tokenizer.json"))
    ids = tok.encode("é!<|end|>").ids
    assert ids[0] == 256 and tok.id_to_token(256) == merged
    assert text.text(256) == "é" and text.sequence(ids) == ["é", "!", "<|end|>"]
    assert text.sequence([0xC3, 0xA9, 0x21]) == [PARTIAL, "é", "!"]
