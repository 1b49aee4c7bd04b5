"""Tile tuner: time candidate tiles of moetrace's Triton kernels at a shape, print the winners.

    python benchmarks/tune.py moe [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--tokens 64 128 256]
    python benchmarks/tune.py attention [--shapes gpt-oss-20b] [--batch 256] [--context 320 1024]
    python benchmarks/tune.py mla [--shapes deepseek-v2-lite] [--prefill 16x512 4x1024+3072]
    python benchmarks/tune.py moe --shapes gpt-oss-20b --tile loaded_block_m=none   # default + this
    TRITON_INTERPRET=1 python benchmarks/tune.py moe --smoke   # the CPU, tiny shapes: plumbing only

A case is one kernel at one shape and size: a MoE layer's experts at T tokens
(random top-k, grouped by the fused routing kernel as the engine groups them,
the routing launch inside the timed call); decode attention at a batch and
context; MLA's absorbed decode, its absorbed prefill, and its expanded prefill
(the gather and ``kv_b_proj`` GEMM inside the timed call, as the layer pays
them).  Each candidate tile of the case's grid first runs once and its output is
checked against the default tile's (one that computes something else is
dropped, never timed); then it is timed in steady state, as a decode step runs
its kernels: a CUDA graph of calls back to back, their inputs rotated through
more bytes than the L2 keeps (a lone replay also pays its launch and an L2
flush, several µs).  Candidates compile first in ``--workers`` processes.

One JSON line per case goes to standard output (progress to standard error),
keyed as vLLM's fused-MoE tuner keys its config files (experts, width, device,
dtype, tokens): the winning tile and its µs, the default tile and its µs, and
the µs the bytes a call must read take at ``--hbm-tbs``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from kernel_times import DEV, SMOKE, graphed, paged_batch, paged_metadata

from moetrace.kernels import triton_attention as ta
from moetrace.kernels import triton_mla as tk
from moetrace.kernels import triton_moe as tm
from moetrace.kernels.triton_routing import route_and_align
from moetrace.layers.moe import MoEExperts

L2_PASS_BYTES = 150e6  # a chain's inputs: more bytes than the H200's L2 keeps
CHAIN = 8  # calls a timed graph holds at least
TOLERANCE = 1e-2  # a candidate's relative error to the default tile's output
ON_DEVICE = DEV == "cuda" and torch.cuda.is_available()  # else one call's wall time (smoke runs)

Launch = Callable[[], torch.Tensor]


@dataclass
class Case:
    """One kernel at one shape and size: its identity, its tiles, and how to run them."""

    key: dict[str, Any]  # the JSON row's identity: kernel, shape, widths, size, dtype
    default: tuple  # the tile the kernel picks today (a NamedTuple)
    grid: list[tuple]  # the candidates
    inputs: Callable[[int], Any]  # seed -> a fresh set of random inputs with ``nbytes``
    launch: Callable[[Any, tuple], Launch]  # (inputs, tile) -> one call, returning its output


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def chained_us(calls: list[Launch], replays: int = 5, rounds: int = 3) -> float:
    """µs a call with ``calls`` captured back to back in one CUDA graph: the median of
    ``rounds`` timings of ``replays`` replays."""
    replay = graphed(lambda: [call() for call in calls])
    for _ in range(3):
        replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(times)


def candidates(case: Case) -> list[tuple]:
    return list(dict.fromkeys([case.default, *case.grid]))


def tune(case: Case, hbm_bytes_s: float) -> dict[str, Any]:
    """Every candidate checked against the default tile's output, then timed; the row."""
    first = case.inputs(0)
    copies = min(64, math.ceil(L2_PASS_BYTES / first.nbytes)) if ON_DEVICE else 1
    inputs = [first] + [case.inputs(seed) for seed in range(1, copies)]
    reference = case.launch(first, case.default)().clone()
    timed: dict[tuple, float] = {}
    dropped = 0
    for tile in candidates(case):
        try:
            calls = [case.launch(inputs[i % copies], tile) for i in range(max(CHAIN, copies))]
            start = time.perf_counter()
            out = calls[0]()
            wall_us = (time.perf_counter() - start) * 1e6
            err = rel_err(out, reference)
            if not err <= TOLERANCE:
                raise ValueError(f"relative error {err:.1e} to the default tile's output")
            timed[tile] = chained_us(calls) if ON_DEVICE else wall_us
        except Exception as exc:  # a tile that does not fit (shared memory) or computes wrong
            dropped += 1
            print(
                f"  {tuple(tile)}: dropped, {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr
            )
            continue
        print(f"  {tuple(tile)}: {timed[tile]:.1f} us", file=sys.stderr, flush=True)
    winner = min(timed, key=timed.__getitem__) if timed else None
    return {
        **case.key,
        "device": device_name(),
        "tile": winner._asdict() if winner else None,
        "us": round(timed[winner], 1) if winner else None,
        "default": case.default._asdict(),
        "default_us": round(timed[case.default], 1) if case.default in timed else None,
        "bound_us": round(first.nbytes / hbm_bytes_s * 1e6, 2),
        "timed": len(timed),
        "dropped": dropped,
    }


def device_name() -> str:
    """The device as vLLM names it in its config files (``NVIDIA_H200``)."""
    name = torch.cuda.get_device_name() if ON_DEVICE else "cpu"
    return name.replace(" ", "_")


def grid(default: tuple, **choices: Iterable) -> list[tuple]:
    """``default`` with every combination of ``choices`` (field -> values) put in."""
    names = list(choices)
    return [
        default._replace(**dict(zip(names, values, strict=True)))
        for values in itertools.product(*choices.values())
    ]


# ---------------------------------------------------------------------------
# MoE: a layer's experts (both GEMMs), routed and grouped by the fused routing kernel
# ---------------------------------------------------------------------------


class MoEShape(NamedTuple):
    experts: int
    top_k: int
    hidden: int
    width: int  # an expert's intermediate size (vLLM's N)
    dtype: str = "bfloat16"  # or "mxfp4": the fragment layout of kernels/mxfp4_layout.py
    gpt_oss: bool = False  # biases and the clamped SwiGLU

    @property
    def activation(self) -> str:
        return "clamped_swiglu" if self.gpt_oss else "silu"


MOE_SHAPES = {
    "olmoe-1b-7b": MoEShape(64, 8, 2048, 1024),
    "qwen3-30b-a3b": MoEShape(128, 8, 2048, 768),
    "deepseek-v2-lite": MoEShape(64, 6, 2048, 1408),
    "gpt-oss-20b": MoEShape(32, 4, 2880, 2880, "mxfp4", gpt_oss=True),
    "gpt-oss-20b-bf16": MoEShape(32, 4, 2880, 2880, gpt_oss=True),
    "tiny": MoEShape(8, 2, 64, 32),
    "tiny-mxfp4": MoEShape(8, 2, 96, 96, "mxfp4", gpt_oss=True),  # a K tail of 32 values
}


@dataclass
class ExpertInputs:
    experts: MoEExperts
    x: torch.Tensor  # [T, hidden]
    logits: torch.Tensor  # [T, experts] float32, whose top-k are the drawn ids
    nbytes: int  # the weights of the experts that got tokens


def expert_inputs(shape: MoEShape, tokens: int, seed: int) -> ExpertInputs:
    """Random experts (MXFP4: random codes, scales near 2**-7) and a random top-k."""
    torch.manual_seed(seed)
    experts = MoEExperts(
        shape.experts, shape.hidden, shape.width, shape.activation, bias=shape.gpt_oss,
        weight_format="mxfp4" if shape.dtype == "mxfp4" else "dense",
        mxfp4_layout="fragment" if shape.dtype == "mxfp4" else None,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("_scale"):
                p.copy_(torch.randint(116, 124, p.shape))
            elif p.dtype == torch.uint8:
                p.copy_(torch.randint(0, 256, p.shape))
            else:
                p.normal_(0, 0.02)
    experts = experts.to(torch.bfloat16).to(DEV)
    x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device=DEV)
    ids = torch.randn(tokens, shape.experts, device=DEV).topk(shape.top_k, dim=-1).indices
    logits = torch.full((tokens, shape.experts), -1e4, device=DEV)
    logits.scatter_(1, ids, torch.randn(tokens, shape.top_k, device=DEV))
    per_expert = sum(p[0].nbytes for p in experts.parameters())
    return ExpertInputs(experts, x, logits, int(torch.unique(ids).numel()) * per_expert)


def expert_launch(shape: MoEShape, inputs: ExpertInputs, tile: tm.MoEConfig) -> Launch:
    experts = inputs.experts
    extras = experts._kernel_extras()

    def call() -> torch.Tensor:
        routed = route_and_align(
            inputs.logits, shape.top_k, "topk_softmax", tile.block_m,
            weights_dtype=inputs.x.dtype, loaded_block_m=tile.loaded_block_m,
        )  # fmt: skip
        return tm.fused_moe_with_config(
            inputs.x, experts.w13, experts.w2, routed.weights, routed.ids, tile, shape.activation,
            extras=extras, aligned=routed.aligned, weights_f32=routed.weights_f32,
        )  # fmt: skip

    return call


def moe_grid(shape: MoEShape, default: tm.MoEConfig, decode: bool) -> list[tm.MoEConfig]:
    """Decode (up to 160 rows an expert): row blocks of 16-64 streaming the weights;
    prefill: 64-128.  MXFP4: ``block_n`` counts weight rows, ``block_k`` 128 or 256 (whole
    scale chunks), register caps, and the loaded experts' 64-row blocks beside 32-row ones."""
    if SMOKE:
        return [default._replace(block_m=16, loaded_block_m=None)]
    if shape.dtype != "mxfp4":
        if not decode:
            return grid(default, block_m=(64, 128), block_n=(64, 128), block_k=(64, 128),
                        group_m=(8, 16), num_warps=(4, 8), num_stages=(3,))  # fmt: skip
        return grid(default, block_m=(16, 32, 64), block_n=(64, 128), block_k=(64, 128, 256),
                    num_warps=(4, 8), num_stages=(3, 4))  # fmt: skip
    if not decode:
        return grid(default, block_m=(64, 128), block_n=(128, 256), num_warps=(4, 8),
                    num_stages=(3,), loaded_block_m=(None,))  # fmt: skip
    tiles = grid(default, block_m=(16, 32, 64), block_n=(64, 128), block_k=(128, 256),
                 num_warps=(4,), num_stages=(2, 3, 4), maxnreg=(None,), loaded_block_m=(None,))  # fmt: skip
    tiles += grid(default, block_m=(32, 64), block_n=(128, 256), block_k=(128,), num_warps=(8,),
                  num_stages=(3, 4), maxnreg=(None,), loaded_block_m=(None,))  # fmt: skip
    tiles += grid(default, block_m=(32,), block_n=(128,), block_k=(128,), num_warps=(4,),
                  num_stages=(3, 4), maxnreg=(None, 96, 128), loaded_block_m=(None, 64))  # fmt: skip
    return tiles


def moe_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for name, tokens in itertools.product(args.shapes, args.tokens):
        shape = MOE_SHAPES[name]
        mxfp4 = shape.dtype == "mxfp4"
        default = tm.moe_config(
            tokens, shape.top_k, shape.experts, mxfp4=mxfp4, layout="fragment" if mxfp4 else "checkpoint"
        )  # fmt: skip
        decode = tokens * shape.top_k / shape.experts <= 160
        cases.append(Case(
            key={"kernel": "moe", "shape": name, "experts": shape.experts, "top_k": shape.top_k,
                 "hidden": shape.hidden, "width": shape.width, "dtype": shape.dtype, "tokens": tokens},
            default=default,
            grid=moe_grid(shape, default, decode),
            inputs=lambda seed, shape=shape, tokens=tokens: expert_inputs(shape, tokens, seed),
            launch=lambda inputs, tile, shape=shape: expert_launch(shape, inputs, tile),
        ))  # fmt: skip
    return cases


# ---------------------------------------------------------------------------
# Decode attention: one query a sequence over the paged KV cache
# ---------------------------------------------------------------------------


class AttentionShape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    sinks: bool = False
    window: int | None = None


ATTENTION_SHAPES = {
    "qwen3-30b-a3b": AttentionShape(32, 4, 128),
    "olmoe-1b-7b": AttentionShape(16, 16, 128),
    "gpt-oss-20b": AttentionShape(64, 8, 64, sinks=True),  # the full layers
    "gpt-oss-20b-window": AttentionShape(64, 8, 64, sinks=True, window=128),
    "tiny": AttentionShape(4, 2, 16),
    "tiny-sinks": AttentionShape(4, 2, 16, sinks=True),
}


class DecodeTile(NamedTuple):
    """The decode class's tile (``triton_attention.TileConfig``) and its key splits."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    splits: int


@dataclass
class DecodeInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: Any
    sinks: torch.Tensor | None
    out: torch.Tensor
    nbytes: int  # the K and V a step reads


def decode_inputs(shape: AttentionShape, batch: int, context: int, seed: int) -> DecodeInputs:
    torch.manual_seed(seed)
    q, kc, vc, meta = paged_batch([1] * batch, [context] * batch, *shape[:3])
    sinks = torch.randn(shape.heads, dtype=q.dtype, device=DEV) if shape.sinks else None
    keys = min(context, shape.window or context)
    nbytes = 2 * batch * keys * shape.kv_heads * shape.head_dim * q.element_size()
    return DecodeInputs(q, kc, vc, meta, sinks, torch.empty_like(q), nbytes)


def decode_launch(shape: AttentionShape, inputs: DecodeInputs, tile: DecodeTile) -> Launch:
    cfg = ta.TileConfig(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages, tile.maxnreg)
    group = shape.heads // shape.kv_heads
    longest = ta.decode_max_q(tile.block_m, group, tile.splits)

    def call() -> torch.Tensor:
        ta._launch_class(
            inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, shape.head_dim**-0.5,
            shape.window, inputs.out, cfg, decode=True, decode_max_q=longest,
            num_splits=tile.splits, sinks=inputs.sinks,
        )  # fmt: skip
        return inputs.out

    return call


def attention_default(shape: AttentionShape, batch: int) -> DecodeTile:
    """The decode tile and splits ``paged_attention`` takes for this batch."""
    splits = ta._num_splits(batch, shape.kv_heads, torch.device(DEV))
    one_tile = ta._one_tile_keys(shape.sinks, True, splits, shape.window)
    cfg, _ = ta._tile_configs(
        shape.heads // shape.kv_heads, shape.head_dim, shape.sinks,
        batch * shape.kv_heads * splits, ta._num_sms(torch.device(DEV)), one_tile=bool(one_tile),
    )  # fmt: skip
    return DecodeTile(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.maxnreg, splits)


def attention_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for name, batch, context in itertools.product(args.shapes, args.batch, args.context):
        shape = ATTENTION_SHAPES[name]
        default = attention_default(shape, batch)
        tiles = grid(default, block_n=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(2, 3),
                     maxnreg=(None, 64, 80), splits=(1, 2))  # fmt: skip
        cases.append(Case(
            key={"kernel": "attention", "shape": name, "heads": shape.heads,
                 "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "sinks": shape.sinks,
                 "window": shape.window, "dtype": "bfloat16", "batch": batch, "context": context},
            default=default,
            grid=[default._replace(block_n=16, splits=2)] if SMOKE else tiles,
            inputs=lambda seed, s=shape, b=batch, c=context: decode_inputs(s, b, c, seed),
            launch=lambda inputs, tile, s=shape: decode_launch(s, inputs, tile),
        ))  # fmt: skip
    return cases


# ---------------------------------------------------------------------------
# MLA (DeepSeek): the absorbed form's decode and prefill classes, the expanded form's prefill
# ---------------------------------------------------------------------------


class MLAShape(NamedTuple):
    heads: int
    rank: int = 512
    rope: int = 64
    nope: int = 128
    v_dim: int = 128
    block: int = 16


MLA_SHAPES = {
    "deepseek-v2-lite": MLAShape(16),
    "deepseek-v3": MLAShape(128),
    "tiny": MLAShape(4, 32, 16, 16, 16, 4),
}


@dataclass
class LatentInputs:
    cache: torch.Tensor  # [blocks, block, rank + rope]
    meta: Any
    q_latent: torch.Tensor  # [T, H, rank]
    q_nope: torch.Tensor  # [T, H, nope]
    q_rot: torch.Tensor  # [T, H, rope]
    w_kv: torch.Tensor  # kv_b_proj [H * (nope + v_dim), rank]
    out: torch.Tensor  # [T, H, rank] (absorbed) or [T, H, v_dim] (expanded)
    nbytes: int  # the latent rows read once


def latent_inputs(
    shape: MLAShape, q_lens: list[int], seq_lens: list[int], form: str, seed: int
) -> LatentInputs:
    torch.manual_seed(seed)
    dtype = torch.float16 if SMOKE else torch.bfloat16
    meta, num_blocks = paged_metadata(q_lens, seq_lens, shape.block)
    width = shape.rank + shape.rope
    cache = torch.randn(num_blocks, shape.block, width, dtype=dtype, device=DEV)
    tokens, heads = sum(q_lens), shape.heads

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, dtype=dtype, device=DEV) * scale

    w_kv = rand(heads * (shape.nope + shape.v_dim), shape.rank, scale=0.05)
    out = rand(tokens, heads, shape.rank if form == "absorbed" else shape.v_dim)
    nbytes = sum(seq_lens) * width * cache.element_size()
    return LatentInputs(
        cache, meta, rand(tokens, heads, shape.rank), rand(tokens, heads, shape.nope),
        rand(tokens, heads, shape.rope), w_kv, out, nbytes,
    )  # fmt: skip


def absorbed_launch(inputs: LatentInputs, configs: tuple[tk.MLAConfig, tk.MLAConfig]) -> Launch:
    return lambda: tk.absorbed_attention(
        inputs.q_latent, inputs.q_rot, inputs.cache, inputs.meta, 0.1, out=inputs.out,
        configs=configs,
    )  # fmt: skip


def expanded_launch(shape: MLAShape, inputs: LatentInputs, tile: tk.MLAConfig) -> Launch:
    tokens = inputs.q_nope.shape[0]

    def call() -> torch.Tensor:
        expansion = tk.expand_context(inputs.cache, inputs.meta, inputs.w_kv, shape.heads, tokens)
        return tk.expanded_attention(
            inputs.q_nope, inputs.q_rot, expansion, inputs.meta, 0.1, inputs.out, config=tile
        )

    return call


def parse_prefill(text: str) -> tuple[int, int, int]:
    """``NxL[+C]``: N sequences of L new tokens behind C cached ones."""
    seqs, _, rest = text.partition("x")
    new, _, cached = rest.partition("+")
    try:
        return int(seqs), int(new), int(cached or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want NxL or NxL+C (e.g. 4x1024+3072)"
        ) from None


def mla_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    device = torch.device(DEV)
    for name in args.shapes:
        shape = MLA_SHAPES[name]
        key = {"kernel": "mla", "shape": name, "heads": shape.heads, "rank": shape.rank,
               "rope": shape.rope, "dtype": "float16" if SMOKE else "bfloat16"}  # fmt: skip
        for batch, context in itertools.product(args.batch, args.context):
            decode, prefill = tk.absorbed_configs(batch, shape.heads, device)
            tiles = grid(decode, block_n=(16, 32, 64), splits=(1, 2, 4, 8), num_warps=(4, 8),
                         num_stages=(2, 3))  # fmt: skip
            cases.append(Case(
                key={**key, "form": "absorbed", "class": "decode", "batch": batch, "context": context},
                default=decode,
                grid=[decode._replace(block_n=16)] if SMOKE else tiles,
                inputs=lambda seed, s=shape, b=batch, c=context: latent_inputs(
                    s, [1] * b, [c] * b, "absorbed", seed),
                launch=lambda inputs, tile, prefill=prefill: absorbed_launch(inputs, (tile, prefill)),
            ))  # fmt: skip
        for seqs, new, cached in args.prefill:
            q_lens, seq_lens = [new] * seqs, [new + cached] * seqs
            size = {"sequences": seqs, "new": new, "cached": cached}
            decode, prefill = tk.absorbed_configs(seqs, shape.heads, device)
            tiles = grid(prefill, block_q=(1, 2, 4), block_n=(16, 32, 64), num_warps=(4, 8),
                         num_stages=(2, 3))  # fmt: skip
            cases.append(Case(
                key={**key, "form": "absorbed", "class": "prefill", **size},
                default=prefill,
                grid=[prefill._replace(block_n=16)] if SMOKE else tiles,
                inputs=lambda seed, s=shape, q=q_lens, k=seq_lens: latent_inputs(
                    s, q, k, "absorbed", seed),
                launch=lambda inputs, tile, decode=decode: absorbed_launch(inputs, (decode, tile)),
            ))  # fmt: skip
            if cached:  # the layer sizes the expansion by the step's tokens: these do not fit
                continue
            tiles = grid(tk.EXPANDED_CONFIG, block_q=(32, 64, 128), block_n=(32, 64),
                         num_warps=(4, 8), num_stages=(2, 3))  # fmt: skip
            cases.append(Case(
                key={**key, "form": "expanded", "class": "prefill", **size},
                default=tk.EXPANDED_CONFIG,
                grid=[tk.EXPANDED_CONFIG._replace(block_n=16)] if SMOKE else tiles,
                inputs=lambda seed, s=shape, q=q_lens, k=seq_lens: latent_inputs(
                    s, q, k, "expanded", seed),
                launch=lambda inputs, tile, s=shape: expanded_launch(s, inputs, tile),
            ))  # fmt: skip
    return cases


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

KERNELS = {"moe": moe_cases, "attention": attention_cases, "mla": mla_cases}
SHAPES = {"moe": MOE_SHAPES, "attention": ATTENTION_SHAPES, "mla": MLA_SHAPES}


def parse_tile(text: str) -> dict[str, int | None]:
    """``FIELD=VALUE[,FIELD=VALUE...]`` (``none`` for no value) over each case's default."""
    fields = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not FIELD=VALUE")
        try:
            fields[name] = None if value.lower() == "none" else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {value!r} is not an integer or none"
            ) from None
    return fields


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="kernel", required=True)
    workers = max(0, min(14, (os.cpu_count() or 2) - 2)) if ON_DEVICE else 0
    smoke = {"moe": "tiny", "attention": "tiny,tiny-sinks", "mla": "tiny"}
    real = {
        "moe": "olmoe-1b-7b,qwen3-30b-a3b,deepseek-v2-lite,gpt-oss-20b",
        "attention": "qwen3-30b-a3b,olmoe-1b-7b,gpt-oss-20b,gpt-oss-20b-window",
        "mla": "deepseek-v2-lite,deepseek-v3",
    }
    for kind, shapes in SHAPES.items():
        sub = kinds.add_parser(kind)
        sub.add_argument("--shapes", default=(smoke if SMOKE else real)[kind],
                         help=f"comma-separated, of: {', '.join(shapes)}")  # fmt: skip
        sub.add_argument("--tile", type=parse_tile, action="append", default=None,
                         help="time only the default and this tile (FIELD=VALUE,...; repeatable)")  # fmt: skip
        sub.add_argument("--workers", type=int, default=workers, help="processes compiling first")
        sub.add_argument("--hbm-tbs", type=float, default=4.29, help="HBM copy rate for the bound")
        sub.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
        if kind == "moe":
            sub.add_argument("--tokens", type=int, nargs="+", default=[8] if SMOKE else [256])
        else:
            batch, context = ((3, 40) if kind == "attention" else (2, 24)) if SMOKE else (256, 320)
            sub.add_argument("--batch", type=int, nargs="+", default=[batch])
            default_context = 384 if kind == "mla" and not SMOKE else context
            sub.add_argument("--context", type=int, nargs="+", default=[default_context])
        if kind == "mla":
            prefill = ["2x12"] if SMOKE else ["16x512", "4x1024+3072"]
            sub.add_argument("--prefill", type=parse_prefill, nargs="*",
                             default=[parse_prefill(p) for p in prefill], help="NxL[+C] ...")  # fmt: skip
    args = parser.parse_args(argv)
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES[args.kernel]]
    if unknown:
        parser.error(
            f"unknown {args.kernel} shapes {unknown}; have {', '.join(SHAPES[args.kernel])}"
        )
    return args


def build_cases(args: argparse.Namespace) -> list[Case]:
    """The chosen kernel's cases; with ``--tile``, each case's grid is those tiles."""
    cases = KERNELS[args.kernel](args)
    for case in cases if args.tile else []:
        try:
            case.grid = [case.default._replace(**fields) for fields in args.tile]
        except ValueError as exc:  # a field the kernel's tile does not have
            sys.exit(f"--tile: {exc}; {args.kernel} tiles have {', '.join(case.default._fields)}")
    return cases


def compile_share(job: tuple[argparse.Namespace, int, int]) -> None:
    """A worker: launch every ``index % workers == share`` candidate once, so that Triton's
    disk cache holds it when the timing process launches it."""
    args, share, workers = job
    index = 0
    for case in build_cases(args):
        mine = [t for i, t in enumerate(candidates(case), index) if i % workers == share]
        index += len(candidates(case))
        if not mine:
            continue
        inputs = case.inputs(0)
        for tile in mine:
            with contextlib.suppress(Exception):  # reported when the timing process runs it
                case.launch(inputs, tile)()
    torch.cuda.synchronize()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not ON_DEVICE and not SMOKE:
        sys.exit("benchmarks/tune.py needs CUDA (or --smoke under TRITON_INTERPRET=1)")
    if args.workers > 1:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            pool.map(compile_share, [(args, i, args.workers) for i in range(args.workers)])
    for case in build_cases(args):
        print(json.dumps(case.key), file=sys.stderr, flush=True)
        print(json.dumps(tune(case, args.hbm_tbs * 1e12)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
