"""Time the CUDA kernels on the shapes that matter for moetrace's target models.

    PYTHONPATH=. python3 benchmarks/kernel_times.py [SECTION-PREFIX ...]

Decode attention (batch 256, context 384) for Qwen3-30B-A3B (32 q / 4 kv heads,
head_dim 128) and OLMoE-1B-7B (16 / 16, 128), plus prefill and small-batch
long-context shapes; KV store; fused MoE at T=256 (decode) and T=8192
(prefill) for both models: Triton vs ``grouped_mm`` vs a naive per-expert
torch loop, and a T sweep, eager and CUDA-graph replayed, that sets
``moe_forward``'s switch-over; gpt-oss-20b's attention with sinks and its MoE
layer with bf16 and MXFP4 experts (``kernel_times.py gpt-oss``).

Times are ``triton.testing.do_bench`` medians.  "eager" times include the
host's launch overhead whenever that exceeds the GPU time (as it would in the
engine's eager prefill); "graph" times replay a captured CUDA graph (as the
engine's decode does) and are GPU time alone.  GB/s counts the bytes a kernel
must move at least once (for MoE: the weights of the experts that got tokens,
plus activations in and out); "err" is ‖out − ref‖/‖ref‖ against fp32 math.
The summary table is printed last.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import triton
from triton.testing import do_bench

from moetrace.forward_context import AttentionMetadata
from moetrace.kernels import triton_attention as ta
from moetrace.kernels import triton_moe as tm

# --smoke: tiny sizes on the CPU, to check this script's plumbing; run it with
# TRITON_INTERPRET=1 in the environment (Triton reads it at import).
SMOKE = "--smoke" in sys.argv
DEV = "cpu" if SMOKE else "cuda"
ROWS: list[tuple[str, str, float, str]] = []  # (what, variant, ms, note)


def bench(fn: Callable[[], object], reps_ms: int = 100) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=10, rep=reps_ms, return_mode="median")


def record(what: str, variant: str, ms: float, note: str = "") -> None:
    ROWS.append((what, variant, ms, note))
    print(f"{what:44s} {variant:36s} {ms * 1e3:9.1f} us  {note}", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def graphed(fn: Callable[[], object], *, warmups: int = 1) -> Callable[[], object]:
    """``fn``'s CUDA-graph replay (the engine replays its steps, so kernels are timed as
    replays too): ``fn`` runs ``warmups`` times on a side stream first, so that Triton
    compiles and the allocator settles outside the capture.  ``fn`` itself without CUDA."""
    if not torch.cuda.is_available():
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def try_bench(
    what: str,
    variant: str,
    fn: Callable[[], object],
    nbytes: float = 0.0,
    flops: float = 0.0,
    ref: torch.Tensor | None = None,
    graph: bool = False,
) -> float | None:
    """Time ``fn``; with ``ref``, also check its output; with ``graph``, time graph replays."""
    try:
        out = fn()
        note = []
        if ref is not None:
            note.append(f"err {rel_err(out, ref):.1e}")
        if graph:
            fn = graphed(fn)
            variant += " [graph]"
        if not SMOKE:
            torch.cuda.synchronize()
        ms = bench(fn)
    except Exception as exc:  # a config that does not fit (shared memory) is skipped
        print(f"{what:44s} {variant:36s} FAILED {type(exc).__name__}: {str(exc)[:120]}")
        return None
    if nbytes:
        note.append(f"{nbytes / ms / 1e6:5.0f} GB/s")
    if flops:
        note.append(f"{flops / ms / 1e9:4.0f} TFLOP/s")
    record(what, variant, ms, "  ".join(note))
    return ms


# ---------------------------------------------------------------------------
# Ceilings
# ---------------------------------------------------------------------------


def ceilings() -> None:
    n = 1 << (20 if SMOKE else 30)
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    try_bench(
        "ceiling: d2d copy", f"torch copy_ {n >> 20} MiB", partial(dst.copy_, src), nbytes=2 * n
    )
    m = 256 if SMOKE else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    try_bench(f"ceiling: bf16 matmul {m}^3", "torch mm", partial(torch.mm, a, b), flops=2 * m**3)


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


def paged_metadata(
    q_lens: list[int], seq_lens: list[int], block_size: int = 16
) -> tuple[AttentionMetadata, int]:
    """A step's metadata over a paged cache whose blocks are placed by a random permutation
    (a fragmented cache), and the cache's block count."""
    nblk = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(nblk)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[used : used + n]
        used += n
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    slots = []
    for b, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q, s, device=DEV)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
        min_query_len=min(q_lens),
    )
    return meta, num_blocks


def paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random queries and K/V caches of a step (``paged_metadata``)."""
    meta, num_blocks = paged_metadata(q_lens, seq_lens, block_size)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(sum(q_lens), heads, dim, dtype=torch.bfloat16, device=DEV)
    return q, k_cache, v_cache, meta


DECODE_VARIANTS = [  # (BLOCK_N, warps, stages); BLOCK_M = max(16, group)
    (32, 4, 2),
    (64, 4, 2),
    (64, 4, 3),
    (128, 4, 2),
]
PREFILL_VARIANTS = [  # (BLOCK_M, BLOCK_N, warps, stages)
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (128, 64, 8, 2),
    (128, 128, 8, 2),
    (128, 64, 4, 3),
]


def attention(name: str, heads: int, kv_heads: int, dim: int) -> None:
    group = heads // kv_heads
    scale = dim**-0.5
    batch, ctx = (4, 40) if SMOKE else (256, 384)
    q, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch, heads, kv_heads, dim)
    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2 + 2 * q.numel() * 2
    out = torch.empty_like(q)
    what = f"decode attn {name} B{batch} ctx{ctx}"
    ref = ta.paged_attention(q, kc, vc, meta, scale).clone()
    attn = partial(ta.paged_attention, q, kc, vc, meta, scale, out=out)
    try_bench(what, "paged_attention (default)", attn, nbytes=kv_bytes)
    bm = max(16, triton.next_power_of_2(group))
    for bn, w, s in DECODE_VARIANTS:
        launch = partial(ta._launch_attention, q, kc, vc, meta, scale, None, out, bm, bn, w, s)
        try_bench(what, f"cfg M{bm} N{bn} w{w} s{s}", launch, nbytes=kv_bytes)
        print(f"    max |diff| vs default: {(out.float() - ref.float()).abs().max().item():.3g}")
    # Dense reference: SDPA on contiguous K/V (no paging), GQA expanded by enable_gqa.
    qd = q.view(batch, 1, heads, dim).transpose(1, 2)
    kd = torch.randn(batch, kv_heads, ctx, dim, dtype=torch.bfloat16, device=DEV)
    vd = torch.randn_like(kd)
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, qd, kd, vd, enable_gqa=True)
    try_bench(what, "torch sdpa dense (no paging)", sdpa, nbytes=kv_bytes)

    # Long contexts; small batches go through split-K (flash-decoding).
    long_ctx = 64 if SMOKE else 2048
    for b in (batch, 32, 8):
        q2, kc2, vc2, meta2 = paged_batch([1] * b, [long_ctx] * b, heads, kv_heads, dim)
        nbytes = 2 * b * long_ctx * kv_heads * dim * 2
        auto = ta._num_splits(b, kv_heads, q2.device)
        what = f"decode attn {name} B{b} ctx{long_ctx}"
        out2 = torch.empty_like(q2)
        try_bench(
            what,
            f"paged_attention (auto: {auto} splits)",
            partial(ta.paged_attention, q2, kc2, vc2, meta2, scale, out=out2),
            nbytes=nbytes,
        )
        if b <= 32:
            ref2 = out2.clone()
            for splits in (1, 2, 4, 8):
                launch = partial(
                    ta._launch_attention,
                    q2,
                    kc2,
                    vc2,
                    meta2,
                    scale,
                    None,
                    out2,
                    bm,
                    64,
                    4,
                    3,
                    splits,
                )
                try_bench(what, f"{splits} splits", launch, nbytes=nbytes)
                diff = (out2.float() - ref2.float()).abs().max().item()
                print(f"    max |diff| vs auto: {diff:.3g}")
        del q2, kc2, vc2, meta2

    # Prefill: 16 prompts of 512 tokens (8192 tokens, the engine's prefill budget),
    # and 4 chunks of 1024 after 3072 cached tokens (prefix hits / chunked prefill).
    for nseq, plen, cached in (
        ((2, 24, 0), (2, 8, 16)) if SMOKE else ((16, 512, 0), (4, 1024, 3072))
    ):
        seq = plen + cached
        q, kc, vc, meta = paged_batch([plen] * nseq, [seq] * nseq, heads, kv_heads, dim)
        flops = 4 * nseq * heads * dim * plen * (cached + (plen + 1) / 2)
        out = torch.empty_like(q)
        what = f"prefill attn {name} {nseq}x{plen}+{cached}"
        ref = ta.paged_attention(q, kc, vc, meta, scale).clone()
        attn = partial(ta.paged_attention, q, kc, vc, meta, scale, out=out)
        try_bench(what, "paged_attention (default)", attn, flops=flops)
        for bm_p, bn, w, s in PREFILL_VARIANTS:
            bm_p = max(bm_p, triton.next_power_of_2(group))
            launch = partial(
                ta._launch_attention, q, kc, vc, meta, scale, None, out, bm_p, bn, w, s
            )
            try_bench(what, f"cfg M{bm_p} N{bn} w{w} s{s}", launch, flops=flops)
            print(
                f"    max |diff| vs default: {(out.float() - ref.float()).abs().max().item():.3g}"
            )
        if cached == 0:
            qd = q.view(nseq, plen, heads, dim).transpose(1, 2)
            kd = torch.randn(nseq, kv_heads, plen, dim, dtype=torch.bfloat16, device=DEV)
            vd = torch.randn_like(kd)
            sdpa = partial(
                torch.nn.functional.scaled_dot_product_attention,
                qd,
                kd,
                vd,
                is_causal=True,
                enable_gqa=True,
            )
            try_bench(what, "torch sdpa dense causal", sdpa, flops=flops)


def kv_store() -> None:
    for tokens in (8, 32) if SMOKE else (256, 8192):
        kv_heads, dim, block_size = 4, 128, 16
        num_blocks = 4096
        kc = torch.randn(num_blocks, block_size, kv_heads, dim, dtype=torch.bfloat16, device=DEV)
        vc = torch.randn_like(kc)
        slots = torch.randperm(num_blocks * block_size, device=DEV)[:tokens]
        qkv = torch.randn(tokens, (32 + 8) * dim, dtype=torch.bfloat16, device=DEV)
        k = qkv[:, 32 * dim : 36 * dim].view(tokens, kv_heads, dim)
        v = qkv[:, 36 * dim :].view(tokens, kv_heads, dim)
        nbytes = 2 * 2 * tokens * kv_heads * dim * 2
        what = f"store_kv T{tokens} Hkv4 D128"
        args = (k, v, kc, vc, slots)
        try_bench(what, "triton", partial(ta.store_kv, *args), nbytes=nbytes)
        try_bench(what, "triton", partial(ta.store_kv, *args), nbytes=nbytes, graph=True)
        try_bench(what, "index_copy_", partial(ta.store_kv_torch, *args), nbytes=nbytes)


# ---------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------


def routing(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, device=DEV)
    vals, ids = logits.topk(top_k, dim=-1)
    return vals.softmax(-1), ids.to(torch.int32)


def naive_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    wts: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
) -> torch.Tensor:
    """The per-expert loop a user would write (it syncs with the host per expert)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe, w13e, w2e = x[tok], w13[e], w2[e]
        if fp32:
            xe, w13e, w2e = xe.float(), w13e.float(), w2e.float()
        h = xe @ w13e.T
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (a @ w2e.T).float() * wts[tok, slot, None])
    return out if fp32 else out.to(x.dtype)


MOE_SWEEP = [
    tm.MoEConfig(16, 64, 128, 64, 4, 4),
    tm.MoEConfig(16, 32, 128, 64, 4, 4),
    tm.MoEConfig(16, 64, 64, 64, 4, 5),
    tm.MoEConfig(16, 128, 128, 64, 4, 3),
    tm.MoEConfig(64, 128, 64, 8, 4, 4),
    tm.MoEConfig(64, 64, 128, 8, 4, 4),
    tm.MoEConfig(128, 128, 64, 8, 8, 3),
    tm.MoEConfig(128, 128, 64, 8, 8, 4),
    tm.MoEConfig(128, 64, 64, 8, 4, 3),
    tm.MoEConfig(128, 128, 64, 16, 8, 3),
]


def moe(name: str, experts: int, top_k: int, hidden: int, inter: int) -> None:
    if SMOKE:
        hidden, inter = 64, 32
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=DEV) * 0.02
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device=DEV) * 0.02
    expert_bytes = 3 * hidden * inter * 2
    for tokens in (8, 33) if SMOKE else (256, 8192):
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEV)
        wts, ids = routing(tokens, experts, top_k)
        ref = naive_moe(x, w13, w2, wts, ids, fp32=True)
        active = int(torch.unique(ids).numel())
        nbytes = active * expert_bytes + 2 * tokens * hidden * 2
        flops = 2 * tokens * top_k * 3 * hidden * inter
        what = f"moe {name} T{tokens}"
        kw = {"nbytes": nbytes, "flops": flops}
        args = (x, w13, w2, wts, ids)
        default = tm.moe_config(tokens, top_k, experts)
        try_bench(
            what, f"triton default {default[:3]}", partial(tm.fused_moe, *args), ref=ref, **kw
        )
        try_bench(what, "triton default", partial(tm.fused_moe, *args), graph=True, **kw)
        for cfg in MOE_SWEEP:
            bm = cfg.block_m
            if cfg == default or (tokens <= 256) != (bm <= 64) or SMOKE:
                continue
            variant = f"triton M{bm} N{cfg.block_n} K{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
            fn = partial(tm.fused_moe_with_config, *args, cfg)
            try_bench(what, variant, fn, ref=ref, graph=tokens <= 256, **kw)
        align = partial(tm.align_routing, ids, experts, default.block_m)
        try_bench(what, "  of which align_routing", align)
        try_bench(what, "  of which align_routing", align, graph=True)
        if tm.grouped_mm_available():
            fn = partial(tm.moe_grouped_mm, *args)
            try_bench(what, "torch grouped_mm", fn, ref=ref, **kw)
            try_bench(what, "torch grouped_mm", fn, graph=True, **kw)
        try_bench(what, "moe_forward", partial(tm.moe_forward, *args), ref=ref, **kw)
        try_bench(what, "naive torch loop", partial(naive_moe, *args), ref=ref, **kw)


def moe_crossover(name: str, experts: int, top_k: int, hidden: int, inter: int) -> None:
    """Triton vs grouped_mm over T, eager and graph: where does moe_forward switch?"""
    if SMOKE:
        hidden, inter = 64, 32
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=DEV) * 0.02
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device=DEV) * 0.02
    small = [tm.MoEConfig(16, 32, 128, 64, 4, 4), tm.MoEConfig(16, 64, 64, 64, 4, 5)]
    sizes = (1, 8) if SMOKE else (1, 8, 32, 64, 128, 512, 1024, 2048, 4096, 16384)
    for tokens in sizes:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEV)
        wts, ids = routing(tokens, experts, top_k)
        active = int(torch.unique(ids).numel())
        nbytes = active * 3 * hidden * inter * 2
        what = f"moe-sweep {name} T{tokens}"
        args = (x, w13, w2, wts, ids)
        graph = tokens <= 1024
        try_bench(what, "triton", partial(tm.fused_moe, *args), nbytes=nbytes)
        if graph:
            try_bench(what, "triton", partial(tm.fused_moe, *args), nbytes=nbytes, graph=True)
        if tokens <= 64:
            for cfg in small:
                fn = partial(tm.fused_moe_with_config, *args, cfg)
                variant = f"triton M16 N{cfg.block_n} K{cfg.block_k} s{cfg.num_stages}"
                try_bench(what, variant, fn, nbytes=nbytes, graph=True)
        if tm.grouped_mm_available():
            fn = partial(tm.moe_grouped_mm, *args)
            try_bench(what, "grouped_mm", fn, nbytes=nbytes)
            if graph:
                try_bench(what, "grouped_mm", fn, nbytes=nbytes, graph=True)


def gpt_oss() -> None:
    """gpt-oss-20b's attention (64 q / 8 kv heads of 64, sinks, window 128 or none) at decode
    B=256 ctx 384, and one MoE layer (E32 k4 H2880 I2880, biases, clamped SwiGLU) with bf16
    or MXFP4 experts (MXFP4 decoded by ``tl.dot_scaled`` or by the kernel's own bits)."""
    from moetrace.layers.moe import MoEExperts

    heads, kv_heads, dim = (8, 2, 64) if SMOKE else (64, 8, 64)
    batch, ctx = (4, 40) if SMOKE else (256, 384)
    q, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch, heads, kv_heads, dim)
    sinks = torch.randn(heads, dtype=torch.bfloat16, device=DEV)
    for window in (128, None):
        read = min(ctx, window or ctx)
        nbytes = 2 * batch * read * kv_heads * dim * 2
        what = f"decode attn gpt-oss B{batch} ctx{ctx} window {window}"
        for variant, sk in (("no sinks", None), ("sinks (two passes)", sinks)):
            fn = partial(
                ta.paged_attention, q, kc, vc, meta, 0.125, sliding_window=window, sinks=sk
            )
            try_bench(what, variant, fn, nbytes=nbytes)
            try_bench(what, variant, fn, nbytes=nbytes, graph=True)
    hidden = inter = 64 if SMOKE else 2880
    for kind in ("dense", "mxfp4-checkpoint", "mxfp4-fragment"):
        fmt, _, layout = kind.partition("-")
        experts = MoEExperts(
            32, hidden, inter, "clamped_swiglu", bias=True, weight_format=fmt,
            mxfp4_layout=layout or None,
        ).to(DEV)  # fmt: skip
        with torch.no_grad():
            for name, p in experts.named_parameters():
                if name.endswith("_scale"):
                    p.fill_(120)  # e2m1 codes times 2**-7: RMS 0.023
                elif p.dtype == torch.uint8:
                    p.copy_(torch.randint(0, 256, p.shape))
                else:
                    p.normal_(0, 0.02)
        experts = experts.to(torch.bfloat16)
        extras = experts._kernel_extras()
        per_expert = sum(p[0].nbytes for p in experts.parameters())
        for tokens in (8, 33) if SMOKE else (256, 8192):
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEV)
            wts, ids = routing(tokens, 32, 4)
            wts = wts.to(torch.bfloat16)
            nbytes = int(torch.unique(ids).numel()) * per_expert
            flops = 2 * tokens * 4 * 3 * hidden * inter
            what = f"moe gpt-oss-20b {kind} T{tokens}"
            default = tm.moe_config(tokens, 4, 32)
            sweep = MOE_SWEEP
            if layout == "fragment":  # its tiles: benchmarks/tune.py moe --shapes gpt-oss-20b
                default = tm.moe_config(tokens, 4, 32, mxfp4=True, layout=layout)
                sweep = []
            for cfg in dict.fromkeys([default, *sweep]):
                if (cfg != default and SMOKE) or (tokens <= 256) != (cfg.block_m <= 64):
                    continue
                for native in (True, False) if layout == "checkpoint" and not SMOKE else (None,):
                    fn = partial(
                        tm.fused_moe_with_config, x, experts.w13, experts.w2, wts, ids, cfg,
                        "clamped_swiglu", extras=extras, mxfp4_native=native,
                    )  # fmt: skip
                    decode = {True: "dot_scaled", False: "bits", None: ""}[native]
                    variant = f"M{cfg.block_m} N{cfg.block_n} K{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {decode}"
                    if cfg == default:
                        variant += " (default)"
                    try_bench(what, variant, fn, nbytes=nbytes, flops=flops, graph=tokens <= 256)


def main() -> None:
    if not torch.cuda.is_available() and not SMOKE:
        print("benchmarks/kernel_times.py needs CUDA", file=sys.stderr)
        sys.exit(1)
    torch.manual_seed(0)
    name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"device {name}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"grouped_mm available: {tm.grouped_mm_available()}")
    t0 = time.time()
    sections = {
        "ceilings": ceilings,
        "attention-qwen3": lambda: attention("Qwen3-30B-A3B 32/4/128", 32, 4, 128),
        "attention-olmoe": lambda: attention("OLMoE 16/16/128", 16, 16, 128),
        "kv-store": kv_store,
        "moe-qwen3": lambda: moe("Qwen3-30B-A3B E128 k8 H2048 I768", 128, 8, 2048, 768),
        "moe-olmoe": lambda: moe("OLMoE E64 k8 H2048 I1024", 64, 8, 2048, 1024),
        "moe-sweep-qwen3": lambda: moe_crossover("Qwen3", 128, 8, 2048, 768),
        "moe-sweep-olmoe": lambda: moe_crossover("OLMoE", 64, 8, 2048, 1024),
        "gpt-oss": gpt_oss,
    }
    run_sections(sections, t0)


def run_sections(sections: dict[str, Callable[[], None]], t0: float) -> None:
    """Run the sections the arguments pick, then print the summary table.

    Optional arguments pick sections by prefix, in that order: `kernel_times.py moe` runs the MoE ones.
    """
    wanted = [a for a in sys.argv[1:] if not a.startswith("--")]
    order = [k for w in wanted for k in sections if k.startswith(w)] if wanted else list(sections)
    for key in dict.fromkeys(order):
        sections[key]()
        if not SMOKE:
            torch.cuda.empty_cache()
    print(f"\n(total {time.time() - t0:.0f} s)\n")
    print(f"{'what':44s} {'variant':36s} {'median':>12s}  note")
    for what, variant, ms, note in ROWS:
        print(f"{what:44s} {variant:36s} {ms * 1e3:9.1f} us  {note}")


if __name__ == "__main__":
    main()
