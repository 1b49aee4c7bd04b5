"""One ``serve`` run: load the model and engine, serve HTTP until a signal, close the trace.

Kept apart from the CLI (as ``recording.Recording`` is) so tests and Python
callers run exactly what ``moetrace serve`` runs.

Shutdown (SIGINT or SIGTERM, or the engine or trace writer failing): the
listening socket closes, new requests on open connections get 503, requests
in flight get up to ``shutdown_timeout_s`` to finish, whatever still runs is
aborted (its blocks freed, written to the trace as ``abort``), and the trace
is closed intact.  A second Ctrl-C skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path

import uvicorn

from moetrace import __version__, envs
from moetrace.distributed.state import get_parallel_state
from moetrace.engine.heap import freeze_start_up_heap
from moetrace.engine.llm_engine import LLMEngine
from moetrace.errors import MoetraceError
from moetrace.runs.setup import (
    RunOptions,
    load_engine,
    load_tokenizer,
    model_metadata,
    resolve_device,
)
from moetrace.serving.access import AccessOptions, is_loopback
from moetrace.serving.app import create_app
from moetrace.serving.context import ModelFacts, ServingContext, generation_defaults
from moetrace.serving.engine_control import DEFAULT_VERSION, EngineControl
from moetrace.serving.engine_loop import EngineLoop
from moetrace.serving.engine_process import EngineSpec
from moetrace.serving.http_limits import (
    GuardedHttpTools,
    default_connection_limit,
    listening_socket,
    raise_open_files_limit,
    rate_limit_logs,
)
from moetrace.serving.metrics import ServerMetrics
from moetrace.serving.remote_engine import RemoteEngine
from moetrace.serving.timeline import Timeline, timeline_path
from moetrace.signals import signal_name
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.writer import TraceWriter

KEEP_ALIVE_S = 65  # seconds an idle keep-alive connection stays open
# After --shutdown-timeout the engine aborts what runs; its handlers get this long more to
# send those answers (finish_reason "abort") before uvicorn cancels them.
ANSWER_GRACE_S = 5.0

# Python's thread switch interval while serving (envs.py). Every torch op the engine thread
# runs drops the GIL and takes it back; when the event loop holds it meanwhile, the engine
# waits up to this long for it (Python's default is 5 ms).
SWITCH_INTERVAL_ENV = "MOETRACE_SERVE_SWITCH_INTERVAL_MS"
SWITCH_INTERVAL_MS = envs.ENVIRONMENT[SWITCH_INTERVAL_ENV].default


def switch_interval_s() -> float:
    return envs.get(SWITCH_INTERVAL_ENV) / 1e3


@dataclass
class ServeResult:
    requests: int = 0
    aborted: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    stopped_by: str = ""
    trace: Path | None = None
    fatal: str | None = None
    listened: bool = False  # the socket was listening: requests could have come
    extra: dict = field(default_factory=dict)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, with a hook when it stops and no signal re-raised after it."""

    def __init__(self, config: uvicorn.Config, on_ready, on_stopping) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.on_stopping = on_stopping
        self.signals: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        if len(self.signals) == 1:
            print(
                f"{signal_name(sig)}: stopping; requests in flight get "
                f"{self.config.timeout_graceful_shutdown - ANSWER_GRACE_S:g} s "
                f"({signal_name(sig)} again to stop now)",
                file=sys.stderr,
                flush=True,
            )
        super().handle_exit(sig, frame)
        if len(self.signals) > 1:
            self.force_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            self.on_ready(port)

    async def shutdown(self, sockets=None) -> None:
        self.on_stopping()
        await super().shutdown(sockets)


class Server:
    """Everything one ``serve`` run needs, checked in the order that fails fastest."""

    def __init__(
        self,
        run: RunOptions,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_names: list[str] | None = None,
        return_routed_experts: bool = False,
        return_routed_weights: bool = False,
        trace_out: str | Path | None = None,
        overwrite: bool = False,
        flush_interval_s: float = 5.0,
        flush_every_requests: int = 64,
        shutdown_timeout_s: float = 30.0,
        generation_config: str = "auto",
        log_level: str = "warning",
        engine_in_process: bool = True,
        access: AccessOptions | None = None,
        max_sequences_per_request: int = 4096,
        limit_concurrency: int | None = None,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 60.0,
        enable_weight_updates: bool = False,
        weight_update_timeout_s: float = 600.0,
    ) -> None:
        engine = dataclasses.replace(run.engine)  # capture is set below, for this server
        engine.validate()
        if shutdown_timeout_s < 0:
            raise MoetraceError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout_s:g}")
        if generation_config not in ("auto", "vllm"):
            raise MoetraceError(
                f"--generation-config must be auto or vllm, got {generation_config!r}"
            )
        if flush_interval_s <= 0 or flush_every_requests < 1:
            raise MoetraceError("--flush-interval must be > 0 and --flush-every at least 1")
        if max_sequences_per_request < 1:
            raise MoetraceError("--max-sequences-per-request must be at least 1")
        if not (header_timeout_s > 0 and body_timeout_s > 0):
            raise MoetraceError("--header-timeout and --body-timeout must be > 0")
        self.access = replace(access or AccessOptions(), loopback_only=is_loopback(host))
        if self.access.max_request_bytes < 1:
            raise MoetraceError("--max-request-bytes must be at least 1")
        self.max_sequences_per_request = max_sequences_per_request
        self.limit_concurrency = limit_concurrency
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        if not weight_update_timeout_s > 0:
            raise MoetraceError(
                f"--weight-update-timeout must be > 0 seconds, got {weight_update_timeout_s:g}"
            )
        self.enable_weight_updates = enable_weight_updates
        self.weight_update_timeout_s = weight_update_timeout_s
        self.switch_interval_s = switch_interval_s()
        self.model = run.model
        self.device = resolve_device(run.device)
        self.dtype = run.dtype
        self.load_format = run.load_format
        self.host, self.port = host, port
        self.served_model_names = served_model_names or [run.model.name]
        self.return_routed_experts = return_routed_experts
        self.return_routed_weights = return_routed_weights
        self.trace_out = Path(trace_out) if trace_out else None
        self.overwrite = overwrite
        self.flush_interval_s = flush_interval_s
        self.flush_every_requests = flush_every_requests
        self.shutdown_timeout_s = shutdown_timeout_s
        self.log_level = log_level
        self.extra_settings = {**run.extra_settings, **run.model.provenance()}
        self.engine_in_process = engine_in_process
        if self.trace_out is not None:
            self._check_trace_out(self.trace_out)
        # Capture costs nothing to skip when nobody reads the rows.
        engine.capture_routing = (
            return_routed_experts or return_routed_weights or self.trace_out is not None
        )
        if return_routed_weights and engine.capture_weights is None:
            engine.capture_weights = "float16"
        if not return_routed_weights:
            engine.capture_weights = None  # nobody would read them
        self.engine_config = engine
        # The address is taken before anything loads: a busy port or a bad host is one line
        # at once, not after minutes of loading (and never leaves a trace file behind).
        if not self.access.loopback_only and not self.access.api_keys:
            print(
                f"warning: serving on {host} without --api-key: anyone who reaches the port "
                "can use the server",
                file=sys.stderr,
                flush=True,
            )
        self.socket = listening_socket(host, port)
        self.tokenizer = load_tokenizer(run.model)
        self.max_model_len = run.model.context_length(engine.max_model_len)
        self.sampling_defaults = generation_defaults(run.model, generation_config)

    def _max_prompt_chars(self, max_model_len: int) -> int | None:
        """The longest text that might still fit the context (twice the bound, for normalizers)."""
        if self.tokenizer is None:
            return None
        return 2 * max_model_len * (self.tokenizer.longest_token_chars + 1)

    def _check_trace_out(self, out: Path) -> None:
        if out.is_dir():
            raise MoetraceError(f"cannot write {out}: it is a directory")
        if out.exists() and not self.overwrite:
            raise MoetraceError(f"{out} already exists (pass --overwrite to replace it)")
        parent = out.parent if str(out.parent) else Path(".")
        if not parent.is_dir():
            raise MoetraceError(f"cannot write {out}: no such directory {parent}")

    def run(self, on_ready: Callable[[str], None] | None = None) -> ServeResult:
        """Load, serve until stopped, close; ``on_ready`` gets the URL once it listens."""
        timeline_out = timeline_path()
        timeline = Timeline() if timeline_out is not None else None
        try:
            return self._load_and_run(timeline, timeline_out, on_ready)
        finally:
            self.socket.close()

    def _load_and_run(self, timeline, timeline_out, on_ready) -> ServeResult:
        if self.engine_in_process:
            engine, facts, eos, metadata = self._engine_here()
        else:
            engine, facts, eos, metadata = self._engine_process(timeline)
        try:
            return self._run(engine, facts, eos, metadata, timeline, timeline_out, on_ready)
        finally:
            if isinstance(engine, RemoteEngine):
                engine.close()

    def _engine_here(self) -> tuple[LLMEngine, ModelFacts, tuple[int, ...], TraceMetadata | None]:
        """The engine in this process (``--engine-in-process``, tensor parallelism)."""
        ready = load_engine(self)
        loaded, engine = ready.loaded, ready.engine
        engine.weight_version = DEFAULT_VERSION  # each token is stamped with its weights' label
        metadata = None
        if self.trace_out is not None:
            metadata = model_metadata(self.model, engine, self.tokenizer, {})
        facts = ModelFacts(
            num_hidden_layers=len(getattr(loaded.model, "layers", [])),
            moe_layer_indices=list(loaded.model.moe_layer_indices),
            num_experts=loaded.model.num_experts,
            top_k=loaded.model.top_k,
            vocab_size=loaded.model.vocab_size,
        )
        return engine, facts, tuple(ready.eos_token_ids), metadata

    def _engine_process(
        self, timeline: Timeline | None
    ) -> tuple[RemoteEngine, ModelFacts, tuple[int, ...], TraceMetadata | None]:
        """The engine in a process of its own (engine_process.py says why)."""
        spec = EngineSpec(
            model=self.model,
            device=self.device.type,
            dtype=self.dtype,
            load_format=self.load_format,
            engine_config=self.engine_config,
            metadata=self.trace_out is not None,
            timeline=timeline is not None,
            switch_interval_s=self.switch_interval_s,
            weight_updates=self.enable_weight_updates,
            weight_update_timeout_s=self.weight_update_timeout_s,
        )
        engine = RemoteEngine(spec, timeline)
        ready = engine.ready
        facts = ModelFacts(
            num_hidden_layers=ready.num_hidden_layers,
            moe_layer_indices=list(ready.moe_layer_indices),
            num_experts=ready.num_experts,
            top_k=ready.top_k,
            vocab_size=ready.vocab_size,
        )
        return engine, facts, ready.eos_token_ids, ready.metadata

    def _run(self, engine, facts, eos, metadata, timeline, timeline_out, on_ready) -> ServeResult:
        writer = None
        if metadata is not None and self.trace_out is not None:
            settings = {
                **self.engine_config.to_dict(),
                "device": self.device.type,
                "load_format": "dummy" if self.load_format == "dummy" else "safetensors",
                "max_model_len": engine.max_model_len,
                "num_kv_blocks": engine.block_manager.num_blocks,
                "served_by": "moetrace serve",
                "sampling_defaults": self.sampling_defaults,
                **self.extra_settings,
            }
            writer = TraceWriter(
                self.trace_out,
                replace(metadata, engine_settings=settings),
                overwrite=self.overwrite,
                flush_interval_s=self.flush_interval_s,
                flush_every_requests=self.flush_every_requests,
                disk_full_hint="free space and serve again with another --trace-out",
            ).start()
        result = ServeResult(trace=self.trace_out)
        sys.setswitchinterval(self.switch_interval_s)
        start = time.monotonic()
        try:
            asyncio.run(
                self._serve(engine, writer, facts, eos, result, on_ready, timeline, timeline_out)
            )
        finally:
            result.elapsed_s = time.monotonic() - start
            if writer is not None:
                writer.close(
                    complete=result.fatal is None,
                    end_reason=f"error: {result.fatal}" if result.fatal else result.stopped_by,
                )
                if not result.listened and self.trace_out is not None:
                    self.trace_out.unlink(missing_ok=True)  # a server that never served
        if result.fatal is not None:
            raise MoetraceError(f"the server stopped: {result.fatal}")
        return result

    def _uvicorn_config(self) -> uvicorn.Config:
        """uvicorn's settings: the guarded protocol, the connection limit, the timeouts."""
        open_files = raise_open_files_limit()
        limit = self.limit_concurrency or default_connection_limit(open_files)
        protocol = type(
            "Protocol",
            (GuardedHttpTools,),
            {"header_timeout_s": self.header_timeout_s, "body_timeout_s": self.body_timeout_s},
        )
        return uvicorn.Config(
            None,  # the app is set once the context exists
            host=self.host,
            port=self.port,
            http=protocol,
            limit_concurrency=limit,
            log_level=self.log_level,
            access_log=self.log_level in ("debug", "trace"),
            timeout_graceful_shutdown=self.shutdown_timeout_s + ANSWER_GRACE_S,  # type: ignore[arg-type]
            # Longer than clients keep idle connections (httpx 5 s, aiohttp 15 s): with uvicorn's
            # default of 5 s, a pooled connection reused as the server drops it fails the request
            # (seen here: 1 POST in 512 got a ReadError).
            timeout_keep_alive=KEEP_ALIVE_S,
            lifespan="off",
        )

    def _context(self, engine_loop, engine, facts, eos, metrics) -> ServingContext:
        """What every handler reads: the loop, the model's facts, the limits, the defaults."""
        return ServingContext(
            loop=engine_loop,
            tokenizer=self.tokenizer,
            model=facts,
            served_model_names=self.served_model_names,
            model_path=self.model.name,
            max_model_len=engine.max_model_len,
            num_kv_blocks=engine.block_manager.num_blocks,
            block_size=engine.config.block_size,
            return_routed_experts=self.return_routed_experts,
            return_routed_weights=self.return_routed_weights,
            eos_token_ids=tuple(eos),
            sampling_defaults=self.sampling_defaults,
            created=int(time.time()),
            max_sequences_per_request=self.max_sequences_per_request,
            max_prompt_chars=self._max_prompt_chars(engine.max_model_len),
            metrics=metrics,
            enable_weight_updates=self.enable_weight_updates,
            weight_update_timeout_s=self.weight_update_timeout_s,
            dtype=self.dtype,
            tensor_parallel_size=getattr(get_parallel_state(), "size", 1),
        )

    async def _serve(
        self, engine, writer, facts, eos, result: ServeResult, on_ready, timeline, timeline_out
    ) -> None:
        loop = asyncio.get_running_loop()
        config = self._uvicorn_config()
        ctx: ServingContext

        def stopping() -> None:
            ctx.draining = True
            engine_loop.drain(self.shutdown_timeout_s)  # then aborts: answered, not cut
            if engine_loop.controlling:  # the aborts wait for it: cut, they would be 500s
                config.timeout_graceful_shutdown = (
                    self.shutdown_timeout_s + self.weight_update_timeout_s + ANSWER_GRACE_S
                )
                print(
                    "a control call is in progress (a weight update waits up to "
                    f"--weight-update-timeout {self.weight_update_timeout_s:g} s); the requests "
                    "in flight are answered once it returns",
                    file=sys.stderr,
                    flush=True,
                )

        def ready(port: int) -> None:
            result.listened = True
            url = f"http://{self.host}:{port}"
            print(
                f"moetrace {__version__} serving {self.served_model_names[0]} at {url} "
                f"(routed experts {'on' if self.return_routed_experts else 'off'}"
                f"{', routed weights on request' if self.return_routed_weights else ''}"
                f"{', weight updates on' if self.enable_weight_updates else ''}"
                f"{f', trace {self.trace_out}' if self.trace_out else ''})",
                file=sys.stderr,
                flush=True,
            )
            if on_ready is not None:
                on_ready(url)

        server = _Uvicorn(config, ready, stopping)
        rate_limit_logs()
        metrics = ServerMetrics(self.served_model_names[0])

        def fatal(message: str) -> None:
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)

        remote = isinstance(engine, RemoteEngine)  # it keeps the timeline of its steps itself
        control = None
        if self.enable_weight_updates and not remote:
            control = EngineControl(engine, timeout_s=self.weight_update_timeout_s)
        engine_loop = EngineLoop(
            engine,
            loop,
            writer=writer,
            on_fatal=fatal,
            timeline=None if remote else timeline,
            metrics=metrics,
            control=control,
        )
        if remote:
            engine.has_news = engine_loop.has_news
        ctx = self._context(engine_loop, engine, facts, eos, metrics)
        config.app = create_app(ctx, self.access)
        freeze_start_up_heap()
        engine_loop.start()
        sampler = asyncio.ensure_future(timeline.sample_cpu()) if timeline is not None else None
        try:
            await server.serve(sockets=[self.socket])
        finally:
            ctx.draining = True
            await asyncio.to_thread(engine_loop.shutdown, 0.0)
            if sampler is not None and timeline is not None and timeline_out is not None:
                sampler.cancel()
                timeline.write(timeline_out)
            stats = engine_loop.stats
            result.requests = stats.requests_finished
            result.aborted = stats.requests_aborted
            result.output_tokens = stats.output_tokens
            result.fatal = engine_loop.fatal
            result.stopped_by = (
                f"stopped by {signal_name(server.signals[0])}" if server.signals else "stopped"
            )
