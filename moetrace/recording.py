"""One recording: prompts in, a trace file out.

Kept apart from the CLI so that Python callers (and tests) run exactly what
``moetrace record`` runs.  Prompt files are checked in full (JSON, fields,
tokenization, lengths) before the model's weights load, so a typo on line
80,000 costs a second, not hours.  Standard input is a stream: a bad line
there stops intake, the requests in flight finish into the file, and the
error is raised after the file is closed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetrace import __version__
from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import InputError, ModelError, MoetraceError
from moetrace.models.loader import load_model, read_config
from moetrace.models.registry import resolve_architecture
from moetrace.prompts import STDIN, PromptSpec, iter_prompts
from moetrace.tokenizer import ByteTokenizer, Tokenizer
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.writer import TraceWriter


@dataclass
class SamplingDefaults:
    """The command line's sampling options; a prompt line's own fields override them."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def for_prompt(self, spec: PromptSpec) -> SamplingParams:
        values = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }
        values.update(spec.sampling)
        return SamplingParams(**values)


@dataclass
class RecordResult:
    path: Path
    requests: int = 0
    rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    skipped: list[InputError] = field(default_factory=list)


ProgressCallback = Callable[[RecordResult, int | None], None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MoetraceError("--device cuda asked for, but torch sees no CUDA device")
    if name not in ("cuda", "cpu"):
        raise MoetraceError(f"unknown device {name!r}; choose auto, cuda or cpu")
    return torch.device(name)


def load_tokenizer(model: str) -> Tokenizer | ByteTokenizer | None:
    if model == "demo":
        return ByteTokenizer()
    path = Path(model).expanduser()
    if not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_dir(path)


def model_context_length(model: str, config: dict, max_model_len: int | None) -> int:
    if model == "demo":
        from moetrace.models.demo import DEMO_CONFIG

        config = DEMO_CONFIG
    limit = int(config.get("max_position_embeddings", 32768))
    return min(limit, max_model_len) if max_model_len else limit


def prompt_token_ids(spec: PromptSpec, tokenizer, source: str) -> list[int]:
    if spec.token_ids is not None:
        return list(spec.token_ids)
    if tokenizer is None:
        field_name = "prompt" if spec.text is not None else "messages"
        raise InputError(
            source, spec.line, field_name, "the model has no tokenizer.json; give prompt_token_ids"
        )
    if spec.messages is not None:
        try:
            return tokenizer.apply_chat_template(spec.messages)
        except ModelError as exc:
            raise InputError(source, spec.line, "messages", str(exc)) from None
    return tokenizer.encode(spec.text or "")


class Recording:
    """Everything one ``record`` run needs, opened in the order that fails fastest."""

    def __init__(
        self,
        model: str,
        prompts: str,
        output: str | Path,
        *,
        engine: EngineConfig,
        sampling: SamplingDefaults,
        device: str = "auto",
        dtype: str = "auto",
        load_format: str = "auto",
        overwrite: bool = False,
        skip_invalid: bool = False,
    ) -> None:
        engine.validate()
        self.model_name = model
        self.engine_config = engine
        self.sampling = sampling
        self.output = Path(output)
        self.device = resolve_device(device)
        self.dtype = dtype
        self.load_format = load_format
        self.overwrite = overwrite
        self.skip_invalid = skip_invalid
        self._check_output()
        self.reader = iter_prompts(prompts, skip_invalid=skip_invalid)
        self.source = self.reader.source
        self.streaming = prompts == STDIN
        self.config = {} if model == "demo" else read_config(Path(model).expanduser())
        if model != "demo":
            resolve_architecture(self.config, model)
        self.tokenizer = load_tokenizer(model)
        self.max_model_len = model_context_length(model, self.config, engine.max_model_len)
        self.total: int | None = None
        if not self.streaming:
            self.total = self._prevalidate()

    def _check_output(self) -> None:
        out = self.output
        if out.exists() and not self.overwrite:
            raise MoetraceError(f"{out} already exists (pass --overwrite to replace it)")
        parent = out.parent if str(out.parent) else Path(".")
        if not parent.is_dir():
            raise MoetraceError(f"cannot write {out}: no such directory {parent}")

    def _check_spec(self, spec: PromptSpec) -> tuple[list[int], SamplingParams]:
        ids = prompt_token_ids(spec, self.tokenizer, self.source)
        try:
            params = self.sampling.for_prompt(spec)
        except ValueError as exc:
            raise InputError(self.source, spec.line, None, str(exc)) from None
        vocab = self._vocab_size()
        n = len(ids)
        if n == 0:
            raise InputError(self.source, spec.line, "prompt", "empty after tokenization")
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InputError(
                self.source,
                spec.line,
                "prompt_token_ids",
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
            )
        if n >= self.max_model_len:
            raise InputError(
                self.source,
                spec.line,
                "prompt",
                f"prompt has {n} tokens; the model's context is {self.max_model_len}",
            )
        if n + params.max_tokens > self.max_model_len:
            raise InputError(
                self.source,
                spec.line,
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len}",
            )
        return ids, params

    def _vocab_size(self) -> int:
        if self.model_name == "demo":
            from moetrace.models.demo import DEMO_CONFIG

            return DEMO_CONFIG["vocab_size"]
        return int(self.config["vocab_size"])

    def _prevalidate(self) -> int:
        count = 0
        for spec in self.reader:
            try:
                self._check_spec(spec)
            except InputError as err:
                if not self.skip_invalid:
                    raise
                self.reader.errors.append(err)
                continue
            count += 1
        return count

    def _specs(
        self, errors: list[InputError]
    ) -> Iterator[tuple[PromptSpec, list[int], SamplingParams]]:
        """Valid prompts with their token ids; with skip_invalid, bad ones go to ``errors``."""
        for spec in self.reader:
            try:
                ids, params = self._check_spec(spec)
            except InputError as err:
                if not self.skip_invalid:
                    raise
                errors.append(err)
                continue
            yield spec, ids, params
        errors.extend(e for e in self.reader.errors if e not in errors)

    def metadata(self, engine: LLMEngine, architecture: str, digest: str) -> TraceMetadata:
        model = engine.model
        return TraceMetadata(
            model=self.model_name,
            architecture=architecture,
            config_digest=digest,
            num_hidden_layers=len(getattr(model, "layers", [])),
            moe_layer_indices=list(model.moe_layer_indices),
            num_experts=model.num_experts,
            top_k=model.top_k,
            vocab_size=model.vocab_size,
            tokenizer=None if self.tokenizer is None else self.tokenizer.path,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            engine_settings={
                **self.engine_config.to_dict(),
                "device": self.device.type,
                "load_format": self.load_format,
                "sampling_defaults": self.sampling.__dict__,
                "max_model_len": engine.max_model_len,
                "num_kv_blocks": engine.block_manager.num_blocks,
            },
            moetrace_version=__version__,
        )

    def run(self, progress: ProgressCallback | None = None) -> RecordResult:
        loaded = load_model(
            self.model_name,
            device=self.device,
            dtype=self.dtype,
            load_format=self.load_format,
            seed=self.engine_config.seed,
        )
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else ()
        if not eos and loaded.config.get("eos_token_id") is not None:
            value = loaded.config["eos_token_id"]
            eos = tuple(value) if isinstance(value, list) else (int(value),)
        engine = LLMEngine(loaded.model, self.engine_config, self.device, eos_token_ids=eos)
        architecture = loaded.model.architecture
        writer = TraceWriter(
            self.output,
            self.metadata(engine, architecture, loaded.config_digest),
            overwrite=self.overwrite,
        )
        result = RecordResult(self.output)
        window = max(2 * self.engine_config.max_num_seqs, 64)
        errors: list[InputError] = []
        specs = self._specs(errors)
        pending_error: BaseException | None = None
        exhausted = False
        start = time.perf_counter()
        writer.start()
        complete = False
        try:
            while True:
                while not exhausted and engine.num_unfinished < window:
                    try:
                        spec, ids, params = next(specs)
                    except StopIteration:
                        exhausted = True
                        break
                    except InputError as err:  # streaming input: stop intake, keep what runs
                        pending_error, exhausted = err, True
                        break
                    try:
                        engine.add_request(spec.id, ids, params, index=spec.index)
                    except RequestRejected as err:
                        raise InputError(self.source, spec.line, err.field, err.problem) from None
                if not engine.has_unfinished():
                    break
                for finished in engine.step():
                    writer.submit(finished)
                    _count(result, finished)
                if progress is not None:
                    result.elapsed_s = time.perf_counter() - start
                    progress(result, self.total)
            complete = pending_error is None
        finally:
            result.elapsed_s = time.perf_counter() - start
            result.skipped = errors
            writer.close(complete=complete)
        if pending_error is not None:
            raise pending_error
        return result


def _count(result: RecordResult, finished) -> None:
    result.requests += 1
    result.rows += finished.num_rows
    result.prompt_tokens += finished.prompt_len
    result.output_tokens += finished.output_len
    result.finish_reasons[finished.finish_reason] = (
        result.finish_reasons.get(finished.finish_reason, 0) + 1
    )
