"""JSON bodies, errors and server-sent events, shaped as vLLM shapes them."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from moetrace.serving.protocol import FieldProblem, validation_problem

DONE = "data: [DONE]\n\n"

# Ids are a per-process random prefix and a counter: unique without os.urandom per
# request (uuid4 took 0.2 ms a call on the CI machine, a fifth of a request's HTTP work).
_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count()


def new_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


# The OpenAI client's exception names where it has one.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, as vLLM's newest server writes it."""
    phrase = HTTPStatus(status).phrase.replace(" ", "")
    kind = _ERROR_TYPES.get(status) or (phrase if phrase.endswith("Error") else phrase + "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(problem: FieldProblem) -> JSONResponse:
    return JSONResponse(
        error_body(problem.status, str(problem), problem.field), status_code=problem.status
    )


class Base64Text:
    """A base64 string to place in a JSON body as it is.

    Base64 needs no JSON escaping, yet ``json.dumps`` scans every character
    of a string for it: for the routed experts of a 384-token OLMoE request
    (a 65 KB string) that scan took longer than the ``np.save`` and base64
    that made it (docs/benchmarks.md).  ``dumps`` writes a marker in its
    place and splices the text in afterwards.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Base64Text) and other.text == self.text


# A marker no client text can contain: a private-use character and this process's nonce.
_MARK = f"\ue000{uuid.uuid4().hex}:"


def dumps(payload: Any) -> str:
    """Compact JSON as starlette writes it, ``Base64Text`` values spliced in unscanned."""
    texts: list[str] = []

    def mark(value: Any) -> str:
        if not isinstance(value, Base64Text):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        texts.append(value.text)
        return f"{_MARK}{len(texts) - 1}"

    out = json.dumps(
        payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=mark
    )
    if not texts:
        return out
    head, *pieces = out.split('"' + _MARK)
    parts = [head]
    for piece in pieces:
        index, rest = piece.split('"', 1)
        parts += ['"', texts[int(index)], '"', rest]
    return "".join(parts)


class JSONBody(JSONResponse):
    """A JSON response whose ``Base64Text`` values are spliced in (``dumps``)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {dumps(payload)}\n\n"


def now() -> int:
    return int(time.time())


# Bodies larger than this are parsed off the event loop (a 16 MB body takes ~0.1 s).
PARSE_IN_THREAD_BYTES = 1 << 20


async def read_body(
    http: HttpRequest, model: type[BaseModel], *, empty_is_object: bool = False
) -> Any:
    """The request body as ``model``; malformed JSON and bad fields become ``FieldProblem``.

    The body's size was bounded before it was read (``access.AccessGuard``).
    ``empty_is_object``: no body reads as ``{}`` (control calls trainers post bare).
    """
    raw = await http.body()
    if empty_is_object and not raw.strip():
        raw = b"{}"
    if len(raw) > PARSE_IN_THREAD_BYTES:
        data = await asyncio.to_thread(parse_json, raw)
    else:
        data = parse_json(raw)
    if not isinstance(data, dict):
        raise FieldProblem(None, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_problem(exc) from None


def parse_json(raw: bytes) -> Any:
    """JSON whose every string is text a tokenizer and the trace can take."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise FieldProblem(None, "the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise FieldProblem(
            None, f"malformed JSON body: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise FieldProblem(None, "the JSON body is nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise FieldProblem(None, f"malformed JSON body: {exc}") from None
    where = lone_surrogate(data)
    if where is not None:
        raise FieldProblem(where or None, "a string holds a lone UTF-16 surrogate (not text)")
    return data


def lone_surrogate(data: Any) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, else None.

    JSON's ``\\ud800`` escapes decode to such characters; they are not Unicode
    text, so tokenizers and HDF5 refuse them deep inside the server.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    return path
                stack.append((inner, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


def _is_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }
