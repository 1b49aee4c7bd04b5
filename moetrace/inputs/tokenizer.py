"""Turn prompts into token ids the way the model's own tokenizer would.

``Tokenizer`` reads a Hugging Face checkpoint directory with only the
``tokenizers`` package and jinja2, so recording needs no ``transformers``
install, yet produces the ids ``transformers`` would: the trace is only
comparable with other tools if the tokens are.  ``ByteTokenizer`` is the
file-less tokenizer of the built-in demo model; ``ByteTokenizer.save`` writes it
as an ordinary ``tokenizer.json`` so a saved demo checkpoint loads like any other.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from moetrace.errors import ModelError


class ChatTemplateError(ModelError):
    """The chat template refused the messages (its ``raise_exception``).

    A ``ModelError`` so that it is still one line, but the messages are what is
    wrong: callers that know the prompt's line may re-raise it as an ``InputError``.
    """

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"chat template rejected the messages: {problem}")


# --- chat templates ---------------------------------------------------------------


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; templates are written
    # against plain json.dumps (what transformers provides), and the escapes
    # would change the tokens.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# What one rendering may cost.  A real chat template renders in well under a millisecond;
# a template is foreign code, and two nested range(100000) loops ran for hours.
RENDER_SECONDS = 10.0
RENDER_CHARS = 16 << 20  # 64 bytes a token of a 256k context


class _TooCostly(Exception):
    pass


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*`` and ``**`` refused past a size (``"x" * 10**10`` is one step)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        big_int = isinstance(left, int) and left not in (-1, 0, 1)
        if operator == "**" and big_int and isinstance(right, int) and abs(right) > 64:
            raise _TooCostly(f"{left} ** {right} is too large")
        for seq, times in ((left, right), (right, left)):
            repeats = operator == "*" and isinstance(seq, (str, list, tuple))
            if repeats and isinstance(times, int) and len(seq) * times > RENDER_CHARS:
                raise _TooCostly(f"a repetition of {len(seq) * times:,} items")
        return super().call_binop(context, operator, left, right)


class _Budget:
    """Ends a rendering that runs past ``RENDER_SECONDS``, checked on the template's own lines.

    Only the template's frames are line-traced (its code is compiled from
    ``<template>``), so a loop that makes no call (``{% for b in s %}{% endfor %}``
    over a long string) is caught too, at a small cost to a normal rendering.
    """

    def __init__(self) -> None:
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.lines = 0

    def on_call(self, frame, event: str, arg):
        return self.on_line if frame.f_code.co_filename == "<template>" else None

    def on_line(self, frame, event: str, arg):
        self.lines += 1
        if not self.lines & 1023 and time.monotonic() > self.deadline:
            raise _TooCostly(f"it ran for more than {RENDER_SECONDS:g} s")
        return self.on_line


def compile_chat_template(source: str, origin: str) -> jinja2.Template:
    """Compile a checkpoint's chat template in a sandbox (templates come with downloads)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(
            f"{origin}: chat template is not valid Jinja ({e.message}, template line {e.lineno})"
        ) from None
    except RecursionError:  # 5,000 nested parentheses printed a 3,000-line traceback
        raise ModelError(f"{origin}: chat template is nested too deeply to compile") from None


def _bounded_render(template: jinja2.Template, context: dict) -> str:
    """Render within ``RENDER_SECONDS`` and ``RENDER_CHARS``, or raise ``_TooCostly``."""
    budget = _Budget()
    previous = sys.gettrace()
    sys.settrace(budget.on_call)
    try:
        parts, size = [], 0
        for part in template.generate(context):
            size += len(part)
            if size > RENDER_CHARS:
                raise _TooCostly(f"its output passed {RENDER_CHARS:,} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        sys.settrace(previous)


def render_chat_template(
    template: jinja2.Template,
    messages: list[dict],
    *,
    origin: str,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render with the variables Hugging Face templates expect."""
    context = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
        **variables,
    }
    try:
        return _bounded_render(template, context)
    except _TemplateRaised as e:
        raise ChatTemplateError(str(e)) from None
    except _TooCostly as e:
        raise ModelError(f"{origin}: chat template stopped: {e}") from None
    except RecursionError:
        raise ModelError(f"{origin}: chat template failed: it recursed too deeply") from None
    except Exception as e:  # the template is foreign code; any failure is the checkpoint's
        raise ModelError(
            f"{origin}: chat template failed: {type(e).__name__}: {e}".splitlines()[0]
        ) from None


# --- streaming decode ---------------------------------------------------------------

# Enough prompt tokens to prime a streaming decoder past any partial character.
PRIME_MIN_TOKENS = 4
PRIME_MAX_TOKENS = 24


def prime_tokens(prompt_token_ids: Sequence[int], decode: Any) -> list[int]:
    """The end of the prompt to prime a streaming decoder with.

    The first output token decodes differently without its left context (a
    leading space, a character split over tokens).  Like vLLM: the shortest
    tail of at least ``PRIME_MIN_TOKENS`` tokens that decodes to whole
    characters (no U+FFFD), searched up to ``PRIME_MAX_TOKENS - 1``; the whole
    prompt when it is that short or no such tail exists.
    """
    ids = list(prompt_token_ids)
    if len(ids) <= PRIME_MIN_TOKENS:
        return ids
    for n in range(PRIME_MIN_TOKENS, min(len(ids), PRIME_MAX_TOKENS - 1) + 1):
        if "\ufffd" not in decode(ids[-n:]):
            return ids[-n:]
    return ids


def decode_stream(
    tok: tokenizers.Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool
) -> Any:
    """A function giving the text each next output token adds (``""`` mid-character)."""
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    for token_id in prime_tokens(prompt_token_ids, tok.decode):
        stream.step(tok, token_id)
    return lambda token_id: stream.step(tok, token_id) or ""


# --- Hugging Face checkpoints -------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"{path}: cannot read ({e})".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """``bos_token`` and friends are a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _find_chat_template(directory: Path, config: dict) -> tuple[str | None, str]:
    """The template and the file it came from, in transformers' order of preference."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as e:
            raise ModelError(f"{jinja_file}: cannot read ({e})") from None
    json_file = directory / "chat_template.json"
    data = _read_json(json_file)
    if data is not None and data.get("chat_template") is not None:
        return _pick_template(data["chat_template"], json_file), str(json_file)
    config_file = directory / "tokenizer_config.json"
    return _pick_template(config.get("chat_template"), config_file), str(config_file)


def _pick_template(value: Any, origin: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str):
                    return template
        return None
    raise ModelError(f"{origin}: 'chat_template' is neither a string nor a list of templates")


class Tokenizer:
    """A checkpoint's ``tokenizer.json`` plus the settings that live beside it."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        path: str | None = None,
        chat_template: str | None = None,
        chat_template_origin: str = "chat template",
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._path = path
        self.chat_template = chat_template
        self._origin = chat_template_origin
        self._compiled: jinja2.Template | None = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        # Without a bos id there is nothing to add; transformers would fail later anyway.
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        eos = list(dict.fromkeys(eos_token_ids))
        eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        if eos_id is not None and eos_id not in eos:
            eos.append(eos_id)
        self._eos = eos

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a Hugging Face checkpoint directory."""
        directory = Path(path)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(
                f"{directory}: no tokenizer.json (moetrace needs a 'fast' tokenizer file)"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelError(f"{tok_file}: cannot load ({e})".splitlines()[0]) from None
        config = _read_json(directory / "tokenizer_config.json") or {}
        template, origin = _find_chat_template(directory, config)
        # Generation stops at any of these: generation_config first (what
        # transformers' generate uses), then config.json, then the eos token.
        eos: list[int] = []
        gen = _read_json(directory / "generation_config.json") or {}
        model_config = _read_json(directory / "config.json") or {}
        text_config = model_config.get("text_config")
        for source in (gen, model_config, text_config if isinstance(text_config, dict) else {}):
            eos.extend(_ids(source.get("eos_token_id")))
        return cls(
            tok,
            path=str(tok_file),
            chat_template=template,
            chat_template_origin=origin,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=config.get("add_bos_token") is True,
            eos_token_ids=eos,
        )

    @property
    def path(self) -> str | None:
        return self._path

    @property
    def directory(self) -> Path | None:
        """The directory its files came from (None for one built in memory)."""
        return None if self._path is None else Path(self._path).parent

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no token stands for more text."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids for text as vLLM encodes a completion prompt (transformers' ``tokenizer(text)``).

        With special tokens, tokenizer.json's post-processor adds its own (the
        BOS of many models), and a ``tokenizer_config.json`` that asks for
        ``add_bos_token`` gets its BOS when the post-processor added none.
        Without them: the text's own tokens (a rendered chat, which writes its
        special tokens itself).
        """
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> Any:
        """Decode output tokens one at a time, after the prompt (stop strings)."""
        return decode_stream(self._tok, prompt_token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat_template(self, messages: list[dict], **variables: Any) -> str:
        """The prompt text the chat template makes of ``messages``."""
        if self.chat_template is None:
            where = self._path or "tokenizer"
            raise ModelError(
                f"{where}: the model has no chat template, so prompts must be "
                "'prompt' text or 'prompt_token_ids', not 'messages'"
            )
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template, self._origin)
        return render_chat_template(
            self._compiled,
            messages,
            origin=self._origin,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **variables,
        )

    def apply_chat_template(
        self, messages: list[dict], *, add_special_tokens: bool = False, **variables: Any
    ) -> list[int]:
        """Ids of the rendered conversation, ending with the assistant's turn opener.

        The rendered text is encoded without adding special tokens by default
        (vLLM's chat default): templates write their own bos, and adding
        another would double it.
        """
        text = self.render_chat_template(messages, **variables)
        return self.encode(text, add_special_tokens=add_special_tokens)


# --- the demo model's byte tokenizer ----------------------------------------------------

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_USER_ID = 258
BYTE_ASSISTANT_ID = 259
BYTE_VOCAB_SIZE = 260
BYTE_SPECIAL_TOKENS = {
    BYTE_BOS_ID: "<|bos|>",
    BYTE_EOS_ID: "<|eos|>",
    BYTE_USER_ID: "<|user|>",
    BYTE_ASSISTANT_ID: "<|assistant|>",
}
_SPECIAL_IDS = {text: i for i, text in BYTE_SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in _SPECIAL_IDS))

# The same conversation format as ByteTokenizer.apply_chat_template, for the saved
# tokenizer_config.json.  Roles other than "assistant" read as the user's.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% else %}<|user|>{% endif %}"
    "{{ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_chars() -> list[str]:
    """The printable stand-in for each byte in byte-level BPE vocabularies (GPT-2's table).

    Printable Latin-1 bytes stand for themselves; the rest are moved, in byte
    order, to U+0100 onwards.
    """
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars = []
    moved = 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + moved))
            moved += 1
    return chars


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus four special tokens; needs no files.

    Like any ``tokenizers`` tokenizer, the special tokens' names in text are
    read as the special tokens, so ``ByteTokenizer`` and the ``tokenizer.json``
    that ``save`` writes give the same ids for every text.
    """

    path: str | None = None
    vocab_size = BYTE_VOCAB_SIZE
    bos_token = BYTE_SPECIAL_TOKENS[BYTE_BOS_ID]
    eos_token = BYTE_SPECIAL_TOKENS[BYTE_EOS_ID]
    bos_token_id = BYTE_BOS_ID
    add_bos_token = False
    chat_template = BYTE_CHAT_TEMPLATE

    @property
    def eos_token_ids(self) -> list[int]:
        return [BYTE_EOS_ID]

    @property
    def longest_token_chars(self) -> int:
        return max(len(t) for t in BYTE_SPECIAL_TOKENS.values())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Bytes and special-token names; the byte tokenizer adds no special tokens itself."""
        ids: list[int] = []
        pos = 0
        for match in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : match.start()].encode("utf-8"))
            ids.append(_SPECIAL_IDS[match.group()])
            pos = match.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Special ids read as their names; unknown ids are dropped, as ``tokenizers`` does."""
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i in BYTE_SPECIAL_TOKENS and not skip_special_tokens:
                out.extend(BYTE_SPECIAL_TOKENS[i].encode("utf-8"))
        return out.decode("utf-8", errors="replace")

    def render_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, **_: Any
    ) -> str:
        parts = []
        for message in messages:
            role = BYTE_ASSISTANT_ID if message["role"] == "assistant" else BYTE_USER_ID
            parts.append(BYTE_SPECIAL_TOKENS[role] + str(message["content"]))
        if add_generation_prompt:
            parts.append(BYTE_SPECIAL_TOKENS[BYTE_ASSISTANT_ID])
        return "".join(parts)

    def apply_chat_template(
        self, messages: list[dict], *, add_special_tokens: bool = False, **variables: Any
    ) -> list[int]:
        return self.encode(self.render_chat_template(messages, **variables))

    def decode_stream(
        self, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> Any:
        return decode_stream(
            self.to_tokenizers(), prompt_token_ids, skip_special_tokens=skip_special_tokens
        )

    def to_tokenizers(self) -> tokenizers.Tokenizer:
        """The same tokenizer as a ``tokenizers.Tokenizer``.

        A BPE with no merges over the 256 byte-level characters, numbered by
        byte value, behind a byte-level pre-tokenizer that neither splits nor
        adds a prefix space: every byte becomes exactly the token of its value.
        """
        vocab = {char: b for b, char in enumerate(byte_level_chars())}
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        )
        tok.decoder = tokenizers.decoders.ByteLevel()
        tok.add_special_tokens(
            [
                tokenizers.AddedToken(BYTE_SPECIAL_TOKENS[i], special=True, normalized=False)
                for i in sorted(BYTE_SPECIAL_TOKENS)
            ]
        )
        return tok

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tok = self.to_tokenizers()
        for i, text in BYTE_SPECIAL_TOKENS.items():
            if tok.token_to_id(text) != i:  # guards the numbering the model was built for
                raise AssertionError(f"{text} got id {tok.token_to_id(text)}, expected {i}")
        tok.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": BYTE_CHAT_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2) + "\n", encoding="utf-8"
        )
