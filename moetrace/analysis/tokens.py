"""Token ids as text, with the tokenizer the trace names (ids alone when there is none)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace

_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


class TokenText:
    """Decodes single token ids for display; ``source`` says which tokenizer (or none)."""

    def __init__(self, decoder=None, source: str = "none", encoder=None) -> None:
        self._decode = decoder
        self._encode = encoder
        self.source = source
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str | None:
        """The token's text with control characters escaped, or None without a tokenizer."""
        if self._decode is None or token_id < 0:
            return None
        text = self._decode(token_id)
        if text is None:
            return None
        return "".join(_ESCAPES.get(c, c) for c in text)

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
        return TokenText(_byte_decoder(byte), "demo byte tokenizer", byte.encode)
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
    def decode(i: int) -> str | None:
        text = tok.decode([i], skip_special_tokens=False)
        if text and "\ufffd" not in text:
            return text
        return tok.id_to_token(i) or text or None  # a piece of a multi-byte character

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return TokenText(decode, source, encode)


def _byte_decoder(byte):
    def decode(i: int) -> str | None:
        if 0x80 <= i < 256:
            return f"<0x{i:02X}>"  # one byte of a multi-byte character
        return byte.decode([i]) or None

    return decode
