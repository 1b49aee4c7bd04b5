"""Stop strings: detokenize a request's output as it grows and end it where vLLM would.

A stop string can span several tokens and a token can hold several
characters, so the output is decoded incrementally (one call per token,
primed with the end of the prompt so that the first output token decodes with
its context) and each step searches only the characters that could complete
a match.  The rules are vLLM's, so a trace records the tokens vLLM would
have generated:

- the characters of the first ``min_tokens`` output tokens are never searched;
- a request already ended by a stop token (EOS, ``stop_token_ids``) is not
  searched, and that token is decoded only with ``include_stop_str_in_output``;
- the first stop string in the list that matches wins; the text is cut before
  it (or after it with ``include_stop_str_in_output``); the token ids are kept
  whole, up to the token that completed the match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class StreamingDecoder(Protocol):
    """A tokenizer that decodes output tokens one at a time after a prompt."""

    def decode_stream(
        self, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> Callable[[int], str]: ...


def find_stop(
    text: str, new_chars: int, stop: Sequence[str], include: bool
) -> tuple[str, int] | None:
    """(stop string, length to keep) for the first stop string ending in the last ``new_chars``.

    A match must end within the new characters; it may start before them.
    """
    if new_chars <= 0:
        return None
    for candidate in stop:
        start = max(0, len(text) - new_chars - len(candidate) + 1)
        at = text.find(candidate, start)
        if at >= 0:
            return candidate, at + len(candidate) if include else at
    return None


class StopStringMatcher:
    """One request's output text, growing token by token, checked against its stop strings."""

    def __init__(
        self,
        decode_next: Callable[[int], str],
        stop: Sequence[str],
        *,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decode_next = decode_next
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.text = ""
        self.num_tokens = 0

    def update(self, token_id: int, *, ends_request: bool) -> str | None:
        """Take the next output token; return the stop string it completes, if any.

        ``ends_request``: the token already ends the request (a stop token);
        it is decoded only with ``include_stop_str_in_output`` and nothing is
        searched.
        """
        self.num_tokens += 1
        searched_from = len(self.text)
        if not ends_request or self.include:
            self.text += self._decode_next(token_id)
        if self.num_tokens <= self.min_tokens:
            return None
        if ends_request or not self.stop:
            return None
        found = find_stop(self.text, len(self.text) - searched_from, self.stop, self.include)
        if found is None:
            return None
        matched, keep = found
        self.text = self.text[:keep]
        return matched
