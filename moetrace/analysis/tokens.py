"""Token ids as text, with the tokenizer the trace names (ids alone when there is none).

Byte-level tokenizers (GPT-2's, Qwen's, the demo's) split a character of
several UTF-8 bytes over tokens, and each such token alone decodes to
nothing readable (its vocabulary entry is GPT-2's byte-map glyphs: ``é`` as
``Ã`` and ``©``).  So a token is shown by its bytes: alone, the bytes that
make no whole character as ``\\xNN``; in a sequence (``sequence``), a
character where its last byte arrives, as a streaming decoder shows it, and
``…`` after a token that ends inside a character.
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache
from pathlib import Path

from moetrace.errors import MoetraceError
from moetrace.inputs.tokenizer import byte_level_chars
from moetrace.trace.reader import Trace

_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
PARTIAL = "…"  # after a token whose bytes end inside a character
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _escaped(text: str) -> str:
    return "".join(_ESCAPES.get(c, c) for c in text)


class TokenText:
    """Decodes token ids for display; ``source`` says which tokenizer (or none).

    ``to_bytes`` gives a token's bytes (None: not known); without it a token is
    its ``decoder`` text, and a sequence is its tokens one by one.
    """

    def __init__(self, decoder=None, source: str = "none", encoder=None, to_bytes=None) -> None:
        self._decode = decoder
        self._encode = encoder
        self._bytes = to_bytes
        self.source = source
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str | None:
        """The token's text with control characters escaped, or None without a tokenizer."""
        if self._decode is None or token_id < 0:
            return None
        raw = self._bytes(token_id) if self._bytes is not None else None
        if raw is not None:
            return _escaped(raw.decode("utf-8", errors="backslashreplace"))
        text = self._decode(token_id)
        return None if text is None else _escaped(text)

    def sequence(self, token_ids: list[int]) -> list[str | None]:
        """Each token's text in the sequence: the characters its bytes complete, and
        ``PARTIAL`` where its bytes end inside a character."""
        if self._decode is None or self._bytes is None:
            return [self.text(t) for t in token_ids]
        stream = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
        out: list[str | None] = []
        for token_id in token_ids:
            raw = self._bytes(token_id) if token_id >= 0 else None
            if raw is None:  # unknown to the tokenizer: what is pending is shown as bytes
                pending = stream.decode(b"", final=True)
                stream.reset()
                out.append(_escaped(pending) or None)
                continue
            text = _escaped(stream.decode(raw))
            out.append(text + PARTIAL if stream.getstate()[0] else text)
        return out

    def encode(self, text: str) -> list[int]:
        if self._encode is None:
            raise MoetraceError("the trace names no tokenizer; give token ids instead of text")
        return self._encode(text)


def token_text(trace: Trace, tokenizer: str | None = None) -> TokenText:
    """The trace's tokenizer (``tokenizer`` overrides it: a tokenizer.json or its directory).

    The tokenizer.json the trace carries comes first; a trace written before
    traces carried it names a path, which may not exist on this machine.
    """
    stored = trace.tokenizer_files.get("tokenizer.json") if not tokenizer else None
    if stored is not None:
        return _tokenizers_text(_load(lambda t: t.from_str(stored.decode("utf-8")), "the trace"),
                                "the trace's tokenizer.json")  # fmt: skip
    path = tokenizer or trace.metadata.get("tokenizer") or ""
    if not path and trace.metadata.get("model") == "demo":
        from moetrace.inputs.tokenizer import ByteTokenizer

        byte = ByteTokenizer()
        decode, to_bytes = _byte_decoder(byte)
        return TokenText(decode, "demo byte tokenizer", byte.encode, to_bytes)
    if not path:
        return TokenText()
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        if tokenizer:
            raise MoetraceError(f"no tokenizer file at {file}")
        return TokenText(source=f"none ({file} not found)")
    return _tokenizers_text(_load(lambda t: t.from_file(str(file)), str(file)), str(file))


def _load(make, origin: str):
    import tokenizers

    try:
        return make(tokenizers.Tokenizer)
    except Exception as exc:  # the Rust side raises plain Exception
        raise MoetraceError(f"{origin}: cannot load tokenizer ({exc})".splitlines()[0]) from None


def _tokenizers_text(tok, source: str) -> TokenText:
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    glyphs = {c: b for b, c in enumerate(byte_level_chars())}

    def decode(i: int) -> str | None:
        text = tok.decode([i], skip_special_tokens=False)
        return text or tok.id_to_token(i) or None

    def to_bytes(i: int) -> bytes | None:
        """The token's bytes: its vocabulary entry read through the byte map (byte-level
        BPE) or a ``<0xNN>`` byte piece; else its decoded text."""
        if i in added:
            return added[i].encode("utf-8")
        piece = tok.id_to_token(i)
        if piece is None:
            return None
        if byte_level and all(c in glyphs for c in piece):
            return bytes(glyphs[c] for c in piece)
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes.fromhex(match.group(1))
        text = decode(i)
        return None if text is None else text.encode("utf-8")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return TokenText(decode, source, encode, to_bytes)


def _byte_decoder(byte):
    def decode(i: int) -> str | None:
        return byte.decode([i]) or None

    def to_bytes(i: int) -> bytes | None:
        return bytes([i]) if 0 <= i < 256 else (byte.decode([i]) or "").encode() or None

    return decode, to_bytes
