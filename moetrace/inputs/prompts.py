"""Read the prompts to record from JSON Lines.

Each non-blank line is one request, either in moetrace's own small format or as
an OpenAI batch line.  Parsing is strict on purpose: a misspelled key or a
value of the wrong type would otherwise silently change what gets recorded, and
a trace is only worth something if it records exactly what was asked for.
Every problem becomes an ``InputError`` that names the file, line and field.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrace.engine.sampling import sampling_problem
from moetrace.errors import InputError

STDIN = "-"
STDIN_NAME = "<stdin>"

# Token ids end up in int32 arrays; anything larger can only be a mistake.
MAX_TOKEN_ID = 2**31 - 1
# Prompt lines longer than ``line_limit(context)`` are refused while they are read.
BYTES_PER_CONTEXT_TOKEN = 64
MIN_MAX_LINE_BYTES = 1 << 20
DEFAULT_MAX_LINE_BYTES = 256 << 20  # without a model to size it (the parser on its own)

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
# vLLM's SamplingParams fields a line may set (OpenAI's, and vLLM's extra ones).
SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "stop",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "logprobs",
)
_FLAGS = ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos")
_ALIASES = {"max_completion_tokens": "max_tokens"}
# How a prompt becomes token ids (vLLM's names): special tokens, the chat template's inputs.
ENCODING_KEYS = ("add_special_tokens", "chat_template_kwargs", "add_generation_prompt")
_CHAT_ONLY = ("chat_template_kwargs", "add_generation_prompt")
_REQUEST_KEYS = (*PROMPT_KEYS, *SAMPLING_KEYS, *_ALIASES, *ENCODING_KEYS)
_PLAIN_KEYS = ("id", *_REQUEST_KEYS)

BATCH_KEYS = ("custom_id", "method", "url", "body")
CHAT_URL = "/v1/chat/completions"
BATCH_URLS = {CHAT_URL: "messages", "/v1/completions": "prompt"}
# Body keys that do not change what is computed; accepted and dropped.
_BODY_IGNORED = ("model", "user", "metadata", "store")
# Body keys accepted only with the value that matches what moetrace does anyway.
_BODY_FIXED = {"stream": False}
# The chat API's logprobs: a flag, and how many most likely tokens (OpenAI's names).
_CHAT_LOGPROBS = ("logprobs", "top_logprobs")


@dataclass
class PromptSpec:
    """One request as read from the input, before tokenization.

    Exactly one of ``text``, ``token_ids`` and ``messages`` is set.
    ``sampling`` holds only the overrides given on the line, under the keys in
    ``SAMPLING_KEYS`` (``max_completion_tokens`` arrives as ``max_tokens``;
    ``top_k`` 0 means off, -1 is normalized to 0; ``stop`` is a list).
    """

    id: str
    line: int  # 1-based line in the source
    index: int  # 0-based position among accepted requests
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    # add_special_tokens (None: vLLM's default, True for text, False for a chat),
    # chat_template_kwargs, add_generation_prompt: as given on the line.
    encoding: dict[str, Any] = field(default_factory=dict)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys; that hides typos and merges.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _show(value: Any) -> str:
    """Render a bad value the way the user wrote it, cut to a readable length."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _Line:
    """Where we are, so every error can say it."""

    source: str
    line: int
    prefix: str = ""  # "body." inside an OpenAI batch line
    # Unknown fields met on this line when they are ignored (--ignore-unknown-fields); None:
    # an unknown field is an error.
    ignored: list[str] | None = None

    def error(self, field: str | None, problem: str) -> InputError:
        return InputError(
            self.source, self.line, None if field is None else self.prefix + field, problem
        )

    def nested(self, prefix: str) -> _Line:
        return _Line(self.source, self.line, self.prefix + prefix, self.ignored)


def _check_keys(where: _Line, obj: dict, allowed: tuple[str, ...]) -> None:
    for key in obj:
        if key not in allowed:
            if where.ignored is not None:
                where.ignored.append(where.prefix + key)
                continue
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise where.error(key, f"unknown field{hint}")


def _text(where: _Line, name: str, value: Any, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise where.error(name, f"expected a string, got {_show(value)}")
    if not allow_empty and not value:
        raise where.error(name, "empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # JSON allows "\ud800"; no tokenizer can encode it.
        raise where.error(name, "contains an unpaired UTF-16 surrogate") from None
    return value


def _request_id(where: _Line, name: str, value: Any) -> str:
    if _is_int(value):
        return str(value)
    if not isinstance(value, str):
        raise where.error(name, f"expected a string or integer, got {_show(value)}")
    return _text(where, name, value, allow_empty=False)


def _token_ids(where: _Line, name: str, value: Any, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, list):
        raise where.error(name, f"expected a list of token ids, got {_show(value)}")
    if not value and not allow_empty:
        raise where.error(name, "empty token list")
    for i, tok in enumerate(value):
        if not _is_int(tok) or not 0 <= tok <= MAX_TOKEN_ID:
            raise where.error(
                f"{name}[{i}]", f"expected a token id (integer >= 0), got {_show(tok)}"
            )
    return list(value)


def _content(where: _Line, name: str, value: Any) -> str:
    if isinstance(value, str):
        return _text(where, name, value)
    if not isinstance(value, list):
        raise where.error(name, f"expected a string or a list of text parts, got {_show(value)}")
    texts = []
    for i, part in enumerate(value):
        part_name = f"{name}[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text" or "text" not in part:
            raise where.error(
                part_name,
                f'only {{"type": "text", "text": ...}} parts are supported, got {_show(part)}',
            )
        texts.append(_text(where, f"{part_name}.text", part["text"]))
    # Chat templates expect a string; joining text parts with newlines is what
    # OpenAI-compatible servers do for text-only content.
    return "\n".join(texts)


def _messages(where: _Line, value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise where.error("messages", f"expected a list of messages, got {_show(value)}")
    if not value:
        raise where.error("messages", "empty message list")
    out = []
    for i, msg in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise where.error(
                name, f"expected an object with 'role' and 'content', got {_show(msg)}"
            )
        for key in ("role", "content"):
            if key not in msg:
                raise where.error(name, f"missing '{key}'")
        role = _text(where, f"{name}.role", msg["role"], allow_empty=False)
        content = _content(where, f"{name}.content", msg["content"])
        # Other keys (name, tool_calls, ...) are the chat template's business.
        out.append({**msg, "role": role, "content": content})
    return out


def _sampling(where: _Line, key: str, name: str, value: Any) -> Any:
    """Validate one override; ``name`` is the canonical key, ``key`` as written."""
    if name == "stop_token_ids":
        return _token_ids(where, key, value, allow_empty=True)
    if name == "stop":  # vLLM takes one string or a list of them
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise where.error(key, f"expected a string or a list of strings, got {_show(value)}")
        if any(not x for x in stops):
            raise where.error(key, "a stop string cannot be empty")
        return [_text(where, key, x) for x in stops]
    if name in _FLAGS:
        return _flag(where, key, value)
    problem = sampling_problem(name, value)  # the same rules as the command line's
    if problem is not None:
        raise where.error(key, f"{problem}, got {_show(value)}")
    if name in ("temperature", "top_p", "min_p") or name.endswith("_penalty"):
        return float(value)
    if name == "top_k":
        return max(value, 0)
    return value


def _flag(where: _Line, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise where.error(key, f"expected true or false, got {_show(value)}")
    return value


@dataclass
class _Request:
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    encoding: dict[str, Any] = field(default_factory=dict)


def _request(
    where: _Line, obj: dict, prompt_keys: tuple[str, ...], sampling_keys: tuple[str, ...]
) -> _Request:
    """Read the prompt, sampling and encoding keys shared by both line formats."""
    given = [k for k in prompt_keys if obj.get(k) is not None]
    if not given:
        names = " or ".join(f"'{where.prefix}{k}'" for k in prompt_keys)
        raise where.error(None, f"no prompt: expected {names}")
    if len(given) > 1:
        raise where.error(
            given[1], f"conflicts with '{where.prefix}{given[0]}' (give exactly one prompt)"
        )
    req = _Request()
    key = given[0]
    value = obj[key]
    if key == "messages":
        req.messages = _messages(where, value)
    elif key == "prompt_token_ids" or (key == "prompt" and isinstance(value, list)):
        if key == "prompt" and value and all(isinstance(v, (str, list)) for v in value):
            raise where.error(key, "a list of prompts is not supported; put one prompt per line")
        req.token_ids = _token_ids(where, key, value, allow_empty=False)
    else:
        if not isinstance(value, str):
            raise where.error(key, f"expected a string or a list of token ids, got {_show(value)}")
        req.text = _text(where, key, value)
        if not req.text:
            raise where.error(key, "empty prompt")

    for raw_key in (*sampling_keys, *_ALIASES):
        if obj.get(raw_key) is None:  # null means "use the default"
            continue
        canonical = _ALIASES.get(raw_key, raw_key)
        if canonical in req.sampling:
            raise where.error(
                raw_key, f"conflicts with '{where.prefix}{canonical}' (give only one)"
            )
        req.sampling[canonical] = _sampling(where, raw_key, canonical, obj[raw_key])
    req.encoding = _encoding(where, obj, chat=req.messages is not None)
    return req


def _encoding(where: _Line, obj: dict, *, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ENCODING_KEYS:
        value = obj.get(key)
        if value is None:
            continue
        if key in _CHAT_ONLY and not chat:
            raise where.error(key, "only for a chat prompt ('messages')")
        if key == "chat_template_kwargs":
            if not isinstance(value, dict):
                raise where.error(key, f"expected an object, got {_show(value)}")
            out[key] = value
        else:
            out[key] = _flag(where, key, value)
    return out


def _chat_logprobs(where: _Line, body: dict) -> int | None:
    """The chat API's ``logprobs`` (a flag) and ``top_logprobs`` as vLLM's one number."""
    wanted = body.get("logprobs")
    top = body.get("top_logprobs")
    if wanted is not None:
        _flag(where, "logprobs", wanted)
    if top is not None:
        problem = sampling_problem("logprobs", top)
        if problem is not None:
            raise where.error("top_logprobs", f"{problem}, got {_show(top)}")
        if not wanted:
            raise where.error("top_logprobs", "needs 'logprobs': true")
    return (top or 0) if wanted else None


def _parse_plain(where: _Line, obj: dict) -> tuple[_Request, str | None]:
    _check_keys(where, obj, _PLAIN_KEYS)
    req = _request(where, obj, PROMPT_KEYS, SAMPLING_KEYS)
    rid = None if obj.get("id") is None else _request_id(where, "id", obj["id"])
    return req, rid


def _parse_batch(where: _Line, obj: dict) -> tuple[_Request, str | None]:
    _check_keys(where, obj, BATCH_KEYS)
    for key in ("url", "body"):
        if key not in obj:
            raise where.error(None, f"OpenAI batch line without '{key}'")
    method = obj.get("method")
    if method is not None and method != "POST":
        raise where.error("method", f'expected "POST", got {_show(method)}')
    url = obj["url"]
    if not isinstance(url, str) or url not in BATCH_URLS:
        urls = " or ".join(f'"{u}"' for u in BATCH_URLS)
        raise where.error("url", f"expected {urls}, got {_show(url)}")
    body = obj["body"]
    if not isinstance(body, dict):
        raise where.error("body", f"expected an object, got {_show(body)}")

    inner = where.nested("body.")
    prompt_key = BATCH_URLS[url]
    other = "prompt" if prompt_key == "messages" else "messages"
    if other in body:
        raise inner.error(other, f"not used by {url} (use '{prompt_key}')")
    chat = prompt_key == "messages"
    encoding = ENCODING_KEYS if chat else ("add_special_tokens",)
    extra = _CHAT_LOGPROBS if chat else ()
    allowed = (prompt_key, *SAMPLING_KEYS, *_ALIASES, *encoding, *extra, *_BODY_IGNORED)
    _check_keys(inner, {k: v for k, v in body.items() if k not in _BODY_FIXED}, allowed)
    for key, expected in _BODY_FIXED.items():
        value = body.get(key)
        if value is not None and (type(value) is not type(expected) or value != expected):
            raise inner.error(key, f"only {_show(expected)} is supported, got {_show(value)}")

    sampling_keys = tuple(k for k in SAMPLING_KEYS if not (chat and k == "logprobs"))
    req = _request(inner, body, (prompt_key,), sampling_keys)
    if chat:
        logprobs = _chat_logprobs(inner, body)
        if logprobs is not None:
            req.sampling["logprobs"] = logprobs
    custom_id = obj.get("custom_id")
    rid = None if custom_id is None else _request_id(where, "custom_id", custom_id)
    return req, rid


def _parse(
    source: str, line: int, text: str, ignored: list[str] | None = None
) -> tuple[_Request, str | None, str]:
    """Parse one line; returns the request, its explicit id if any, and the id's key.

    ``ignored``: a list that takes the line's unknown fields instead of refusing them.
    """
    where = _Line(source, line, ignored=ignored)
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise where.error(None, f"not valid JSON ({e.msg} at column {e.colno})") from None
    except _DuplicateKey as e:
        raise where.error(str(e.args[0]), "given twice") from None
    except RecursionError:
        raise where.error(None, "not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise where.error(None, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise where.error(None, f"expected a JSON object, got {_json_type(obj)}")
    if any(k in obj for k in BATCH_KEYS):
        req, rid = _parse_batch(where, obj)
        return req, rid, "custom_id"
    req, rid = _parse_plain(where, obj)
    return req, rid, "id"


def parse_line(text: str, *, source: str = "<input>", line: int = 1, index: int = 0) -> PromptSpec:
    """Parse a single line on its own (no duplicate-id check); raises ``InputError``."""
    req, rid, _ = _parse(source, line, text)
    return PromptSpec(
        id=str(index) if rid is None else rid,
        line=line,
        index=index,
        text=req.text,
        token_ids=req.token_ids,
        messages=req.messages,
        sampling=req.sampling,
        encoding=req.encoding,
    )


class PromptReader:
    """Lazy, re-iterable reader of a prompt source.

    With ``skip_invalid`` a bad line is recorded in ``errors`` and skipped, so
    a long recording is not lost to one typo; the caller reports ``errors``
    once iteration ends.  Without it the first bad line raises.  Either way a
    source with no usable prompt raises at the end of iteration.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        skip_invalid: bool = False,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        ignore_unknown_fields: bool = False,
    ) -> None:
        self.skip_invalid = skip_invalid
        self.ignore_unknown_fields = ignore_unknown_fields
        # Unknown fields ignored so far (--ignore-unknown-fields): field -> lines.
        self.ignored_fields: dict[str, list[int]] = {}
        self.max_line_bytes = max_line_bytes  # longer lines are refused unread (line_limit)
        self.errors: list[InputError] = []
        self.count = 0  # accepted prompts in the last (or current) iteration
        self._path: Path | None = None
        if str(source) == STDIN:
            self.source = STDIN_NAME
            if sys.stdin is None:  # started with standard input closed (`<&-`)
                raise InputError(self.source, None, None, "standard input is closed")
            return
        self.source = str(source)
        path = Path(source)
        # Checked now, not on first next(), so a CLI fails before loading a model.
        if not path.exists():
            raise InputError(self.source, None, None, "no such file")
        if path.is_dir():
            raise InputError(self.source, None, None, "is a directory, not a JSONL file")
        self._path = path

    def _lines(self) -> Iterator[bytes | str | _LongLine]:
        if self._path is None:
            yield from self._bounded(_stdin_binary())
            return
        try:
            stream = self._path.open("rb")
        except OSError as e:
            raise InputError(self.source, None, None, (e.strerror or str(e)).lower()) from None
        with stream:
            yield from self._bounded(stream)

    def _bounded(self, stream) -> Iterator[bytes | str | _LongLine]:
        """Lines of at most ``max_line_bytes``; the rest of a longer one is skipped unkept."""
        limit = self.max_line_bytes
        try:
            while line := stream.readline(limit + 1):
                if len(line) <= limit or line[-1:] in ("\n", b"\n"):
                    yield line
                    continue
                while (rest := stream.readline(1 << 16)) and rest[-1:] not in ("\n", b"\n"):
                    pass
                yield _LongLine(limit)
        except OSError as e:  # standard input that is a directory, a read error
            where = "standard input" if self._path is None else "the file"
            raise InputError(
                self.source, None, None, f"cannot read {where}: {(e.strerror or str(e)).lower()}"
            ) from None

    def __iter__(self) -> Iterator[PromptSpec]:
        self.errors = []
        self.ignored_fields = {}
        self.count = 0
        seen: dict[str, tuple[int, bool]] = {}  # id -> (line, was it a default id)
        nonblank = 0
        for lineno, raw in enumerate(self._lines(), 1):
            try:
                if isinstance(raw, _LongLine):
                    raise InputError(self.source, lineno, None, raw.problem())
                text = _decode(self.source, lineno, raw)
            except InputError as err:
                nonblank += 1
                self._fail(err)
                continue
            if not text.strip():
                continue
            nonblank += 1
            try:
                spec = self._accept(text, lineno, seen)
            except InputError as err:
                self._fail(err)
                continue
            self.count += 1
            yield spec
        if self.count == 0:
            if nonblank == 0:
                raise InputError(self.source, None, None, "contains no prompts")
            n = len(self.errors)
            raise InputError(
                self.source,
                None,
                None,
                f"contains no valid prompts ({n} invalid line{'s' if n != 1 else ''} skipped; "
                f"first: {self.errors[0]})",
            )

    def _accept(self, text: str, lineno: int, seen: dict[str, tuple[int, bool]]) -> PromptSpec:
        ignored: list[str] | None = [] if self.ignore_unknown_fields else None
        req, rid, id_key = _parse(self.source, lineno, text, ignored)
        for name in ignored or ():
            self.ignored_fields.setdefault(name, []).append(lineno)
        index = self.count
        spec_id = str(index) if rid is None else rid
        if spec_id in seen:
            other, other_default = seen[spec_id]
            there = f"line {other}" + ("'s default id" if other_default else "")
            if rid is None:
                raise InputError(
                    self.source,
                    lineno,
                    None,
                    f"default id {_show(spec_id)} (the line's index) is already used by {there}; "
                    f"give this line an explicit '{id_key}'",
                )
            raise InputError(
                self.source, lineno, id_key, f"duplicate id {_show(spec_id)} (also used by {there})"
            )
        seen[spec_id] = (lineno, rid is None)
        return PromptSpec(
            id=spec_id,
            line=lineno,
            index=index,
            text=req.text,
            token_ids=req.token_ids,
            messages=req.messages,
            sampling=req.sampling,
            encoding=req.encoding,
        )

    def _fail(self, err: InputError) -> None:
        if not self.skip_invalid:
            raise err
        self.errors.append(err)


@dataclass(frozen=True)
class _LongLine:
    """Stands for a line longer than the reader's limit, which was skipped without keeping it."""

    limit: int

    def problem(self) -> str:
        return (
            f"line is longer than {self.limit:,} bytes, more than any prompt that fits the "
            f"model's context can take ({BYTES_PER_CONTEXT_TOKEN} bytes a token of context, "
            f"at least {MIN_MAX_LINE_BYTES >> 20} MiB); refused without reading it whole"
        )


def line_limit(context_tokens: int) -> int:
    """The longest prompt line worth reading for a model with this context.

    A token of text takes a few bytes (JSON-escaped CJK about 9, a token id in a
    list at most 12); 64 bytes a token leaves room for whitespace runs and message
    overhead.  Reading and tokenizing an over-long line cost 2 min and 9.6 GB for
    50 MB before it was refused for the context; now it is refused as it is read.
    """
    return max(MIN_MAX_LINE_BYTES, BYTES_PER_CONTEXT_TOKEN * context_tokens)


def _stdin_binary():
    """Standard input as bytes, through a reader of our own where there is a file descriptor.

    The intake thread may be blocked in a read when the process ends; on
    ``sys.stdin`` itself that read holds the lock the interpreter takes to close
    it at exit, which aborts the interpreter ("could not acquire lock").
    """
    try:
        return os.fdopen(sys.stdin.fileno(), "rb", closefd=False)
    except (AttributeError, OSError, ValueError):  # replaced by a stream without a descriptor
        return getattr(sys.stdin, "buffer", sys.stdin)


def _decode(source: str, lineno: int, raw: bytes | str) -> str:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                source, lineno, None, f"not valid UTF-8 ({e.reason} at byte {e.start + 1})"
            ) from None
    # A byte-order mark is legal at the start of a UTF-8 file and means nothing.
    return raw.removeprefix("\ufeff") if lineno == 1 else raw


def iter_prompts(
    source: str | os.PathLike[str],
    *,
    skip_invalid: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ignore_unknown_fields: bool = False,
) -> PromptReader:
    """Prompts from a JSONL path or ``-`` (stdin), read lazily.

    The returned reader is iterated for ``PromptSpec``s; with ``skip_invalid``
    its ``errors`` list holds the lines that were skipped, with
    ``ignore_unknown_fields`` its ``ignored_fields`` the fields it passed over.
    """
    return PromptReader(
        source,
        skip_invalid=skip_invalid,
        max_line_bytes=max_line_bytes,
        ignore_unknown_fields=ignore_unknown_fields,
    )


def read_prompts(source: str | os.PathLike[str]) -> list[PromptSpec]:
    """All prompts, validated up front; the first bad line raises ``InputError``."""
    return list(PromptReader(source))
