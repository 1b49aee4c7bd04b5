"""Routed experts returned by vLLM or SGLang, turned into moetrace requests.

Accepted, one JSON value per line (JSON Lines) or one JSON document per file:

- vLLM OpenAI-compatible responses (``/v1/completions``, ``/v1/chat/completions``)
  served with ``--enable-return-routed-experts``: per choice, ``routed_experts``
  is base64 of ``.npy`` bytes, shape ``(prompt_len + output_len - 1, layers, top_k)``;
  token ids come from ``prompt_token_ids`` (choice or response) and the choice's
  ``token_ids`` (ask with ``return_token_ids``).  The older split form
  (``prompt_routed_experts`` on the response plus ``routed_experts`` per choice,
  as nested lists) is joined.
- SGLang native ``/generate`` responses (a dict, or a list of them for a batch)
  with ``meta_info.routed_experts``: base64 of raw little-endian int32, reshaped
  to ``(-1, layers, top_k)``; output ids from ``output_ids``, prompt ids from
  ``input_ids``/``prompt_token_ids`` where present.
- OpenAI batch output lines (``custom_id`` + ``response.body``) wrapping either,
  and ``moetrace export`` lines.

Both engines size the layer axis by the model's ``num_hidden_layers`` and leave
dense layers' rows at zero; the model's config (``--model``) says which layers
route, and only those are kept.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pybase64

from moetrace.errors import MoetraceError
from moetrace.trace.metadata import TraceMetadata, expert_id_dtype
from moetrace.trace.records import FinishedRequest
from moetrace.trace.tokenizer_files import collect

ENGINES = ("auto", "vllm", "sglang", "moetrace")
# The layer axis of the routing an engine returns: every hidden layer with dense ones
# zero (vLLM and SGLang), or the MoE layers only (moetrace's own export).
LAYOUTS = ("auto", "vllm", "moe")
_LAYOUT_WORDS = {"vllm": "every hidden layer", "moe": "MoE layers only"}
NPY_MAGIC = b"\x93NUMPY"
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOPK_KEYS = (
    "num_experts_per_tok",
    "experts_per_token",
    "moe_topk",
    "num_experts_per_token",
    "moe_k",
)


# -- the model's routing shape ---------------------------------------------------------


@dataclass
class ModelShape:
    """What a trace's metadata needs to know about the model that routed."""

    name: str
    architecture: str
    config_digest: str
    num_hidden_layers: int
    moe_layer_indices: list[int]
    num_experts: int
    top_k: int
    vocab_size: int = 0
    tokenizer: str | None = None

    def metadata(self, dtype: str, engine_settings: dict) -> TraceMetadata:
        from moetrace import __version__

        return TraceMetadata(
            model=self.name,
            architecture=self.architecture,
            config_digest=self.config_digest,
            num_hidden_layers=self.num_hidden_layers,
            moe_layer_indices=self.moe_layer_indices,
            num_experts=self.num_experts,
            top_k=self.top_k,
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            dtype=dtype,
            engine_settings=engine_settings,
            moetrace_version=__version__,
            tokenizer_files={} if self.tokenizer is None else collect(Path(self.tokenizer).parent),
        )


def config_digest(config: dict) -> str:
    """sha256 of canonical JSON: the digest ``moetrace record`` writes for the same config."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _first(config: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and value > 0:
            return value
    return None


def moe_layers_from_config(config: dict, num_layers: int) -> list[int]:
    """Routing layers by the conventions of Qwen-MoE and DeepSeek configs (else all)."""
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return [
        i
        for i in range(num_layers)
        if i not in mlp_only and (i + 1) % step == 0 and i >= first_dense and i % freq == 0
    ]


def parse_layers(text: str) -> list[int]:
    """``1,2,5-7`` -> [1, 2, 5, 6, 7]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise MoetraceError(f"bad layer list {text!r}: expected e.g. 1,2,5-7") from None
    return sorted(set(out))


def model_shape(
    model: str | None = None,
    *,
    num_layers: int | None = None,
    moe_layers: str | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    name: str | None = None,
) -> ModelShape:
    """From a checkpoint's config.json (``model``: its directory, the file, or ``demo``), with
    explicit values winning; without a model, layers, experts and top-k must all be given."""
    config: dict = {}
    tokenizer = None
    source = "manual"
    if model == "demo":
        from moetrace.models import demo

        config, source = dict(demo.DEMO_CONFIG), "demo"
        tok = Path(getattr(demo, "DEMO_DIR", "")) / "tokenizer.json"
        tokenizer = str(tok) if tok.is_file() else None
    elif model:
        path = Path(model)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise MoetraceError(
                f"no config.json at {model} (give a checkpoint directory or 'demo')"
            )
        try:
            config = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MoetraceError(f"{file}: cannot read the model config ({exc})") from None
        if isinstance(config.get("text_config"), dict):  # multimodal wrappers
            config = {**config, **config["text_config"]}
        source = str(path)
        tok = file.parent / "tokenizer.json"
        tokenizer = str(tok) if tok.is_file() else None
    layers = num_layers or config.get("num_hidden_layers")
    experts = num_experts or _first(config, _EXPERT_KEYS)
    k = top_k or _first(config, _TOPK_KEYS)
    missing = [
        flag
        for flag, value in (("--num-layers", layers), ("--num-experts", experts), ("--top-k", k))
        if not value
    ]
    if missing:
        raise MoetraceError(
            f"the model's routing shape is unknown: give --model (a checkpoint directory with "
            f"config.json) or {', '.join(missing)}"
        )
    if moe_layers:
        indices = parse_layers(moe_layers)
    elif config:
        indices = moe_layers_from_config(config, int(layers))
    else:
        indices = list(range(int(layers)))
    if not indices or indices[-1] >= int(layers) or indices[0] < 0:
        raise MoetraceError(f"MoE layers {indices} do not fit a model of {layers} layers")
    return ModelShape(
        name=name or source,
        architecture=(config.get("architectures") or ["unknown"])[0],
        config_digest=config_digest(config) if config else "",
        num_hidden_layers=int(layers),
        moe_layer_indices=indices,
        num_experts=int(experts),
        top_k=int(k),
        vocab_size=int(config.get("vocab_size") or 0),
        tokenizer=tokenizer,
    )


# -- reading JSON values -------------------------------------------------------------


def read_values(paths: Iterable[str]) -> Iterator[tuple[str, object]]:
    """``(where, value)`` for every JSON value: a line of JSON Lines, or a whole JSON file."""
    for path in paths:
        name = "<stdin>" if path == "-" else path
        try:
            stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise MoetraceError(f"cannot read {path}: {exc.strerror or exc}") from None
        with stream:
            yield from _values(stream, name)


def _values(stream, name: str) -> Iterator[tuple[str, object]]:
    first = True
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if first:  # a pretty-printed JSON document, not JSON Lines
                text = line + stream.read()
                try:
                    yield name, json.loads(text)
                except json.JSONDecodeError as exc2:
                    raise MoetraceError(
                        f"{name}: not JSON or JSON Lines ({exc2.msg} at line {exc2.lineno})"
                    ) from None
                return
            raise MoetraceError(f"{name}:{number}: not valid JSON ({exc.msg})") from None
        first = False
        yield f"{name}:{number}", value


# -- one response -> sequences ------------------------------------------------------------


@dataclass
class EngineSequence:
    """One generated sequence as an engine returned it, before shaping to the trace."""

    id: str | None
    prompt: list[int] | None
    output: list[int] | None
    routed: np.ndarray
    finish_reason: str
    engine: str
    where: str
    prompt_len: int | None = None  # from usage counts, when ids are missing
    output_len: int | None = None
    sample_index: int = 0  # the choice's index when the request sampled n > 1
    extra: dict = field(default_factory=dict)


def _b64(value: str, where: str) -> bytes:
    try:
        return pybase64.b64decode(value, validate=True)
    except ValueError:
        raise MoetraceError(f"{where}: routed_experts is not valid base64") from None


def decode_routed(value, where: str) -> np.ndarray:
    """An array from base64 ``.npy`` (vLLM), base64 raw int32 (SGLang; flat) or nested lists."""
    if value is None:
        raise MoetraceError(
            f"{where}: no routed_experts (was the server started with "
            "--enable-return-routed-experts, and the request made with return_routed_experts?)"
        )
    if isinstance(value, str):
        raw = _b64(value, where)
        if raw.startswith(NPY_MAGIC):
            try:
                array = np.load(io.BytesIO(raw), allow_pickle=False)
            except ValueError as exc:
                raise MoetraceError(f"{where}: routed_experts .npy unreadable ({exc})") from None
            return _expert_ids(array, where)
        if len(raw) % 4:
            raise MoetraceError(f"{where}: routed_experts is neither .npy nor int32 bytes")
        return np.frombuffer(raw, dtype="<i4")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        raise MoetraceError(f"{where}: routed_experts is not a list of expert ids") from None
    return _expert_ids(array, where)


def _expert_ids(array: np.ndarray, where: str) -> np.ndarray:
    """Integers only: a float array (6.7) would be truncated into ids (6) without a word."""
    if array.size and (array.dtype.kind not in "iu" or array.dtype == np.bool_):
        raise MoetraceError(
            f"{where}: routed_experts holds {array.dtype} values, not integer expert ids"
        )
    return array.astype(np.int64, copy=False) if array.size else array.reshape(array.shape)


def _finish(value) -> str:
    if isinstance(value, dict):  # SGLang: {"type": "length", "length": 16}
        value = value.get("type")
    value = str(value or "stop").lower()
    if value == "length":
        return "length"
    if value in ("abort", "cancelled", "canceled", "error"):
        return "abort"
    return "stop"


def _ids(value, where: str, name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) for x in value):
        raise MoetraceError(f"{where}: {name} is not a list of token ids")
    return value


def sequences(value, where: str, engine: str = "auto") -> list[EngineSequence]:
    """The sequences in one JSON value (a response, a batch line, or a list of them)."""
    if isinstance(value, list):
        out = []
        for i, item in enumerate(value):
            out.extend(sequences(item, f"{where}[{i}]", engine))
        return out
    if not isinstance(value, dict):
        raise MoetraceError(f"{where}: expected a JSON object, got {type(value).__name__}")
    if "custom_id" in value and "response" in value:  # OpenAI batch output line
        if value.get("error"):
            raise MoetraceError(f"{where}: request {value['custom_id']!r} failed: {value['error']}")
        body = (value.get("response") or {}).get("body")
        seqs = sequences(body, where, engine)
        for s in seqs:
            s.id = str(value["custom_id"])
        return seqs
    kind = engine if engine != "auto" else _detect(value, where)
    return {"vllm": _vllm, "sglang": _sglang, "moetrace": _moetrace}[kind](value, where)


def _detect(value: dict, where: str) -> str:
    if "choices" in value:
        return "vllm"
    if isinstance(value.get("meta_info"), dict):
        return "sglang"
    if "routed_experts" in value and "shape" in value:
        return "moetrace"
    raise MoetraceError(
        f"{where}: not a vLLM response ('choices'), an SGLang response ('meta_info') "
        "or a moetrace export line"
    )


def _vllm(value: dict, where: str) -> list[EngineSequence]:
    choices = value.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MoetraceError(f"{where}: vLLM response without choices")
    prompt_part = value.get("prompt_routed_experts")
    usage = value.get("usage") or {}
    out = []
    for i, choice in enumerate(choices):
        at = f"{where} choice {choice.get('index', i)}"
        routed = decode_routed(choice.get("routed_experts"), at)
        if prompt_part is not None:  # split form: prompt rows on the response, output per choice
            routed = np.concatenate([decode_routed(prompt_part, where), routed], axis=0)
        prompt = _ids(
            choice.get("prompt_token_ids", value.get("prompt_token_ids")), at, "prompt_token_ids"
        )
        rid = value.get("id")
        out.append(
            EngineSequence(
                id=None if rid is None else str(rid),
                prompt=prompt,
                output=_ids(choice.get("token_ids"), at, "token_ids"),
                routed=routed,
                finish_reason=_finish(choice.get("finish_reason")),
                engine="vllm",
                where=at,
                prompt_len=usage.get("prompt_tokens"),
                output_len=usage.get("completion_tokens") if len(choices) == 1 else None,
                sample_index=i,
            )
        )
    return out


def _sglang(value: dict, where: str) -> list[EngineSequence]:
    meta = value["meta_info"]
    prompt = value.get("input_ids", value.get("prompt_token_ids", meta.get("input_ids")))
    rid = meta.get("id", value.get("id"))
    return [
        EngineSequence(
            id=None if rid is None else str(rid),
            prompt=_ids(prompt, where, "input_ids"),
            output=_ids(value.get("output_ids", meta.get("output_ids")), where, "output_ids"),
            routed=decode_routed(meta.get("routed_experts"), where),
            finish_reason=_finish(meta.get("finish_reason")),
            engine="sglang",
            where=where,
            prompt_len=meta.get("prompt_tokens"),
            output_len=meta.get("completion_tokens"),
        )
    ]


def _moetrace(value: dict, where: str) -> list[EngineSequence]:
    routed = decode_routed(value.get("routed_experts"), where)
    if list(routed.shape) != list(value.get("shape", routed.shape)):
        raise MoetraceError(f"{where}: routed_experts shape {list(routed.shape)} != 'shape'")
    return [
        EngineSequence(
            id=None if value.get("id") is None else str(value["id"]),
            prompt=_ids(value.get("prompt_token_ids"), where, "prompt_token_ids"),
            output=_ids(value.get("output_token_ids"), where, "output_token_ids"),
            routed=routed,
            finish_reason=_finish(value.get("finish_reason")),
            engine="moetrace",
            where=where,
        )
    ]


# -- sequence -> trace request ---------------------------------------------------------------


class Importer:
    """Shapes sequences to the trace: layer axis, row count, expert ids, token ids."""

    def __init__(
        self, shape: ModelShape, *, allow_missing_tokens: bool = False, layout: str = "auto"
    ) -> None:
        if layout not in LAYOUTS:
            raise MoetraceError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.shape = shape
        self.allow_missing_tokens = allow_missing_tokens
        self.layout = layout
        self.dtype = expert_id_dtype(shape.num_experts)
        self.count = 0
        self.trimmed = 0  # requests whose one extra trailing row was dropped
        self.engines: set[str] = set()
        self._ids: set[tuple[str, int]] = set()

    def request(self, seq: EngineSequence) -> FinishedRequest:
        prompt, output, unknown = self._tokens(seq)
        rows = self._rows(seq, len(prompt) + len(output))
        n_tok = len(prompt) + len(output)
        extra: dict = {"engine": seq.engine}
        if len(rows) == n_tok and seq.finish_reason != "abort":
            rows = rows[:-1]  # a row for the last sampled token, which never went through the model
            self.trimmed += 1
            extra["trimmed_rows"] = 1
        elif len(rows) != n_tok - 1 and seq.finish_reason != "abort":
            raise MoetraceError(
                f"{seq.where}: routed_experts has {len(rows)} rows for {len(prompt)} prompt + "
                f"{len(output)} output tokens (expected {n_tok - 1}); were prompt rows skipped "
                "with routed_experts_prompt_start / routed_experts_start_len?"
            )
        if unknown:
            extra["token_ids_unknown"] = True
        rid = seq.id if seq.id is not None else str(self.count)
        key = (rid, seq.sample_index)
        if key in self._ids:
            sample = f" sample {seq.sample_index}" if seq.sample_index else ""
            raise MoetraceError(f"{seq.where}: request id {rid!r}{sample} appears twice")
        self._ids.add(key)
        self.engines.add(seq.engine)
        req = FinishedRequest(
            request_id=rid,
            index=self.count,
            prompt_token_ids=np.asarray(prompt, dtype=np.int32),
            output_token_ids=np.asarray(output, dtype=np.int32),
            routed_experts=rows,
            finish_reason=seq.finish_reason,
            sample_index=seq.sample_index,
            extra=extra,
        )
        self.count += 1
        return req

    def _tokens(self, seq: EngineSequence) -> tuple[list[int], list[int], bool]:
        prompt, output = seq.prompt, seq.output
        if prompt is not None and output is not None:
            return prompt, output, False
        p = len(prompt) if prompt is not None else seq.prompt_len
        o = len(output) if output is not None else seq.output_len
        if not self.allow_missing_tokens or p is None or o is None:
            missing = "prompt" if prompt is None else "output"
            raise MoetraceError(
                f"{seq.where}: the response has no {missing} token ids (vLLM: request with "
                "return_token_ids; SGLang: keep input_ids beside the response), or import with "
                "--allow-missing-tokens to store them as -1"
            )
        return (
            prompt if prompt is not None else [-1] * int(p),
            output if output is not None else [-1] * int(o),
            True,
        )

    def _rows(self, seq: EngineSequence, n_tokens: int) -> np.ndarray:
        s = self.shape
        moe, full, k = len(s.moe_layer_indices), s.num_hidden_layers, s.top_k
        arr = seq.routed
        if arr.ndim == 1:  # SGLang's flat int32: the layer axis is not in the data
            arr = self._reshape_flat(arr, seq.where, n_tokens)
        allowed = {"vllm": (full,), "moe": (moe,)}.get(self.layout, (moe, full))
        if arr.ndim != 3 or arr.shape[2] != k or arr.shape[1] not in allowed:
            layers = " or ".join(str(n) for n in dict.fromkeys(allowed))
            raise MoetraceError(
                f"{seq.where}: routed_experts has shape {list(arr.shape)}; expected "
                f"(rows, {layers} layers, top_k {k}) for this model"
            )
        if arr.shape[1] == full and full != moe:
            arr = arr[:, s.moe_layer_indices]  # engines leave dense layers' rows at zero
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= s.num_experts):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise MoetraceError(
                f"{seq.where}: expert id {bad} outside [0, {s.num_experts}) "
                "(wrong --model, --num-experts or --moe-layers?)"
            )
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def _reshape_flat(self, flat: np.ndarray, where: str, n_tokens: int) -> np.ndarray:
        """Rows of every hidden layer (the engines' layout) or of the MoE layers only.

        Which one is given or must follow from the data alone: when both readings
        give a row count the tokens allow (``prompt + output - 1``, or one more),
        the input is refused rather than guessed (a DeepSeek-V2-Lite shape, 27
        layers of which 26 route, fits both at prompt 10 + output 17).
        """
        s = self.shape
        k = s.top_k
        readings = {"vllm": s.num_hidden_layers, "moe": len(s.moe_layer_indices)}
        if self.layout != "auto":
            readings = {self.layout: readings[self.layout]}
        rows = {name: flat.size / (layers * k) for name, layers in readings.items()}
        fits = [n for n, r in rows.items() if r.is_integer() and int(r) in (n_tokens - 1, n_tokens)]
        if len(set(readings.values())) == 1 or len(fits) == 1:
            name = fits[0] if fits else next(iter(readings))
            if flat.size % (readings[name] * k) == 0:
                return flat.reshape(-1, readings[name], k)
        described = " or ".join(
            (f"{int(r)} rows" if r.is_integer() else "no whole number of rows")
            + f" of {readings[n]} layers ({_LAYOUT_WORDS[n]})"
            for n, r in rows.items()
        )
        if len(fits) > 1:
            raise MoetraceError(
                f"{where}: {flat.size} expert ids read as {described}, and both fit "
                f"{n_tokens} tokens; pass --layout vllm or --layout moe to say which"
            )
        raise MoetraceError(
            f"{where}: {flat.size} expert ids make {described} x top_k {k}; "
            f"{n_tokens} tokens need {n_tokens - 1} rows"
        )
