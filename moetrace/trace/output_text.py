"""A stored request's output text: its output tokens decoded with the trace's tokenizer.

A trace keeps token ids, not text; the text is what the engine handed out
(vLLM's ``CompletionOutput.text``), rebuilt from the ids and the stored stop
reason and sampling settings:

- decoded after the end of the prompt, so the first output token decodes
  with its left context (a leading space, a character split over tokens);
- special tokens left out unless the request kept them (``skip_special_tokens``);
- a stop token (EOS, ``stop_token_ids``) adds no text, a matched stop string
  cuts the text before it, unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# The prompt tail decoded before the output: enough tokens to end on a whole character.
CONTEXT_MIN_TOKENS = 4
CONTEXT_MAX_TOKENS = 23


def load_tokenizer(files: dict[str, bytes], path: str | None) -> Tokenizer | None:
    """The trace's tokenizer.json (carried in the file, else at the path it names), or None."""
    import tokenizers  # only when text is asked for: reading ids needs none

    try:
        if "tokenizer.json" in files:
            return tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        if path:
            return tokenizers.Tokenizer.from_file(path)
    except Exception:  # the Rust side raises plain Exception: no text rather than no request
        return None
    return None


def _context(tok: Tokenizer, prompt: Sequence[int]) -> list[int]:
    """The shortest prompt tail of at least CONTEXT_MIN_TOKENS that decodes to whole
    characters (vLLM's and the engine's rule), else the whole prompt."""
    ids = list(prompt)
    for n in range(CONTEXT_MIN_TOKENS, min(len(ids), CONTEXT_MAX_TOKENS) + 1):
        if "\ufffd" not in tok.decode(ids[-n:]):
            return ids[-n:]
    return ids


def decode_output(
    tok: Tokenizer,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    *,
    finish_reason: str,
    stop_reason: int | str | None,
    sampling_params: dict,
) -> str:
    """The output text the engine gave the request (rules in the module docstring).

    Without ``sampling_params`` (a trace written before they were stored) what
    ended the request is unknown: the whole output is decoded, nothing cut.
    """
    skip = bool(sampling_params.get("skip_special_tokens", True))
    include = bool(sampling_params.get("include_stop_str_in_output", False))
    ids = [int(i) for i in output_token_ids]
    known = bool(sampling_params)  # a trace written before it was stored: decoded whole
    ended_by_token = finish_reason == "stop" and not isinstance(stop_reason, str)
    if known and ended_by_token and ids and not include:
        ids = ids[:-1]  # the stop token that ended it
    context = _context(tok, [int(i) for i in prompt_token_ids])

    def after_context(tokens: list[int]) -> str:
        head = tok.decode(context, skip_special_tokens=skip)
        text = tok.decode(context + tokens, skip_special_tokens=skip)
        return text[len(head) :] if text.startswith(head) else tok.decode(tokens, skip)

    text = after_context(ids)
    if isinstance(stop_reason, str) and ids:
        # The match ends in the last token's characters (it would have stopped earlier).
        before_last = len(after_context(ids[:-1]))
        at = text.find(stop_reason, max(0, before_last - len(stop_reason) + 1))
        if at >= 0:
            text = text[: at + len(stop_reason) if include else at]
    return text
