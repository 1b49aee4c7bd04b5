"""Every Triton kernel variant a run needs, compiled before its first step, in parallel.

Triton compiles a kernel variant on its first launch, one at a time, about
half a second each.  A recording's padded step sizes need a few dozen
variants (OLMoE-1B-7B: 37, 17.5 s on the H200 machine's first run; a second
run loads them from Triton's on-disk cache in well under a second).

So the engine first dry-runs every step size on a copy of the model cut to
two routed layers (the same widths, uninitialised weights): Triton's
``jit_cache_hook`` records each variant a launch asks for and skips both its
compilation and the launch.  Worker processes, forked before the weights load,
compile the recorded variants into the on-disk cache side by side; the
engine's own warm-up and graph capture then only load them.  Variants the dry
run missed still compile on first use, as before (``late_compiles`` counts
them).  The list of variants is kept beside Triton's cache, keyed by the
model's shape, the engine settings, the kernels' sources and moetrace's
environment settings (``variants_key``), so a later run skips the dry run.

Compilation needs no GPU (Triton targets the device named), so the workers
never touch CUDA, and forking them after the parent initialised CUDA is safe.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_POOL: ProcessPoolExecutor | None = None


def start_compile_workers(max_workers: int | None = None) -> None:
    """Fork the compile workers now (early: before other threads and before the weights load)."""
    global _POOL
    if _POOL is not None or not sys.platform.startswith("linux"):
        return
    workers = max_workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    _POOL = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    # With fork, the first submission starts every worker at once.
    _POOL.submit(int).result()


def stop_compile_workers() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None


@dataclass
class PrecompileReport:
    variants: int
    seconds: float
    failed: int
    dry_run: bool  # False: the variant list came from an earlier run


def skeleton_config(config: dict, keep: int = 2) -> dict:
    """``config`` cut to its first few layers: every per-layer list cut alike, at least
    two routed layers kept where the model has them (dense leading layers count extra)."""
    layers = int(config.get("num_hidden_layers", 1))
    keep = min(layers, keep + int(config.get("first_k_dense_replace", 0) or 0))
    small = copy.deepcopy(config)
    small["num_hidden_layers"] = keep
    for name, value in config.items():
        if isinstance(value, list) and len(value) == layers and name != "architectures":
            small[name] = value[:keep]
    if isinstance(config.get("mlp_only_layers"), list):
        small["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < keep]
    return small


@contextmanager
def count_compiles(names: list[str]) -> Iterator[None]:
    """Append the name of every kernel variant compiled in this process meanwhile; loads
    from Triton's on-disk cache do not count."""
    try:
        import triton
    except ImportError:  # the CPU machines run without Triton
        yield
        return

    def record(*, src, cache_hit: bool, **_kwargs) -> None:
        if not cache_hit:
            names.append(getattr(src, "name", "?"))

    previous = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = record
    try:
        yield
    finally:
        triton.knobs.compilation.listener = previous


def collect_variants(forwards) -> dict[tuple[str, str, str], str]:
    """Run ``forwards`` (callables) with Triton launches replaced by a record of what
    they would compile: {(module, kernel, key): specialization data}."""
    import triton

    variants: dict[tuple[str, str, str], str] = {}

    def record(*, key, fn, compile, **_kwargs) -> bool:
        variants[(fn.module, fn.name, str(key))] = compile["specialization_data"]
        return True  # neither compile nor launch

    triton.knobs.runtime.jit_cache_hook = record
    try:
        for forward in forwards:
            forward()
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    return variants


def _compile_variant(module: str, name: str, data: str, target: tuple) -> None:
    """In a worker: compile one recorded variant into Triton's on-disk cache.

    Rebuilds the compiler's input exactly as Triton's own ``preload`` reads
    specialization data, so the cache key equals the one the engine's launch
    computes; targets the named GPU without asking a driver.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    spec = json.loads(data)
    constexprs = {
        tuple(k): tl.dtype(v)
        if tl.dtype.is_dtype(v)
        else tl.constexpr(v["constexpr"])
        if isinstance(v, dict) and "constexpr" in v
        else v
        for k, v in zip(spec["constant_keys"], spec["constant_vals"], strict=True)
    }
    attrs = dict(zip(map(tuple, spec["attrs_keys"]), spec["attrs_vals"], strict=True))
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    source = ASTSource(fn, signature, constexprs, attrs)
    triton.compile(source, target=GPUTarget(*target), options=options)


def compile_in_workers(variants: dict[tuple[str, str, str], str], device: torch.device) -> int:
    """Compile the variants in the workers; returns how many failed (they compile later)."""
    if _POOL is None or not variants:
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    target = ("cuda", major * 10 + minor, 32)
    futures = [
        _POOL.submit(_compile_variant, module, name, data, target)
        for (module, name, _key), data in variants.items()
    ]
    return sum(1 for f in futures if f.exception() is not None)


def precompile(model, config, device: torch.device, max_model_len: int) -> PrecompileReport | None:
    """Compile, in the workers, every variant the padded steps of ``model`` launch.
    None when no workers run or the model takes no graphs."""
    hf_config = getattr(model, "hf_config", None)
    if _POOL is None or hf_config is None or device.type != "cuda":
        return None
    start = time.perf_counter()
    dtype = next(model.parameters()).dtype
    listing = _variants_file(hf_config, dtype, config, device, max_model_len)
    variants = _read_variants(listing)
    dry_run = variants is None
    if variants is None:
        variants = _dry_run(model, hf_config, config, device, max_model_len)
        if variants is None:
            return None
        torch.cuda.empty_cache()
    failed = compile_in_workers(variants, device)
    if dry_run and not failed:
        _write_variants(listing, variants)
    return PrecompileReport(len(variants), time.perf_counter() - start, failed, dry_run)


def _variants_file(hf_config: dict, dtype, config, device, max_model_len: int) -> str:
    """Where the variant list of this model shape and these settings is kept."""
    import triton

    capability = torch.cuda.get_device_capability(device)
    key = variants_key(hf_config, dtype, config, max_model_len, capability)
    return os.path.join(triton.knobs.cache.dir, "moetrace-variants", f"{key}.json")


def variants_key(hf_config: dict, dtype, config, max_model_len: int, capability) -> str:
    """What a variant list is filed under: a digest of everything that decides which
    variants a run's steps launch, so a list recorded under other settings is never read."""
    import triton

    from moetrace import __version__

    settings = {
        "model": hf_config,
        "dtype": str(dtype),
        "engine": config.to_dict(),
        "max_model_len": max_model_len,
        "capability": capability,
        "triton": triton.__version__,
        "moetrace": __version__,
        "kernels": _kernel_sources_digest(),
        "environment": _moetrace_environment(),
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    return digest[:32]


def _moetrace_environment() -> dict[str, object]:
    """moetrace's own environment settings, as parsed: some are kernel switches (the
    attention sinks' variants, the MXFP4 layout) that change the variants launched."""
    from moetrace import envs

    return {name: envs.get(name) for name in envs.ENVIRONMENT}


def _kernel_sources_digest(folder: str | None = None) -> str:
    """A digest of the Triton kernels' sources (``moetrace/kernels`` unless ``folder``): a
    kernel that gains or loses a compile-time argument launches other variants, so a list
    recorded before the change is stale."""
    if folder is None:
        import moetrace.kernels

        folder = os.path.dirname(moetrace.kernels.__file__)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def _read_variants(path: str) -> dict | None:
    try:
        with open(path) as f:
            return {tuple(k): data for k, data in json.load(f)}
    except (OSError, ValueError, TypeError):
        return None  # absent or unreadable: dry-run again


def _write_variants(path: str, variants: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([[list(k), data] for k, data in variants.items()], f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the next run its dry run


def _dry_run(model, hf_config: dict, config, device: torch.device, max_model_len: int):
    """The variants every padded step size launches, on a few-layer copy of the model."""
    from moetrace.engine.model_runner import ModelRunner
    from moetrace.models.loader import instantiate

    dtype = next(model.parameters()).dtype
    skeleton = instantiate(skeleton_config(hf_config), "skeleton", dtype, device)
    graphs = ModelRunner(skeleton, config, 1, device, max_model_len=max_model_len).graphs
    if graphs is None:
        return None

    def step(size: int):
        return lambda: graphs._forward(size, graphs._stage(None, size))

    def without_capture():  # the memory profile's forward runs before capture is bound
        skeleton.set_capturer(None)
        step(graphs.sizes[-1])()

    with torch.inference_mode():
        variants = collect_variants([step(size) for size in graphs.sizes] + [without_capture])
    torch.cuda.synchronize(device)
    return variants
