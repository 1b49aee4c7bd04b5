"""Output text from output tokens, the same whether streamed or not.

Decoding a few tokens alone can differ from decoding them in context (a
SentencePiece word-start token loses its space at the start of a string; a
multi-byte character split over tokens decodes to U+FFFD until its last byte
arrives).  ``IncrementalText`` therefore decodes a sliding window that starts
a few tokens back (in the prompt at first) and hands out only text that is
complete, so the streamed pieces join to the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for context
REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


class IncrementalText:
    """Text of a growing token list, in complete pieces."""

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._ids = context
        self._prefix = 0  # start of the decoded window
        self._read = len(context)  # tokens whose text was handed out
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Append tokens; returns the text they complete (all of it when ``final``)."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += piece
        return piece
