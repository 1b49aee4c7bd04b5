"""Time the MLA kernels (``moetrace/kernels/triton_mla.py``) on DeepSeek's shapes.

    PYTHONPATH=. python3 benchmarks/mla_kernels.py [SECTION-PREFIX ...]

Heads of DeepSeek-V2-Lite (16) and V3 (128); latent 512 + rope 64, no-rope
128, values 128, blocks of 16 tokens placed at random.

- decode: the absorbed kernel at batch 256 x context 384 (the throughput
  benchmark's decode) and at context 2048 for batches 256, 32 and 8, default
  tiles against a sweep of tiles and key splits, graph-replayed; beside it
  the plain-torch latent-space decode the kernel replaced, and the two
  ``bmm``s around the kernel (``q_nope W_UK``, ``W_UV``), which the layer
  pays too.  GB/s counts the latent rows read once.
- prefill: 16 prompts of 512 tokens, and 4 chunks of 1024 behind 3072 cached
  tokens, through the absorbed form and through the expanded one (gather +
  ``kv_b_proj`` GEMM + kernel, and the kernel alone): which one the layer
  should take for fresh prompts and for long cached contexts.
- store: ``store_latent`` against ``index_copy_`` of the concatenated row.

Uses ``benchmarks/kernels.py``'s timing (``do_bench`` medians; ``--smoke`` runs
tiny sizes on the CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
import sys
import time
from functools import partial

import torch
import triton
from kernels import DEV, SMOKE, run_sections, try_bench

from moetrace.forward_context import AttentionMetadata
from moetrace.kernels import triton_mla as tk

RANK, ROPE, NOPE, V_DIM, BLOCK = (32, 16, 16, 16, 4) if SMOKE else (512, 64, 128, 128, 16)
DT = torch.float16 if SMOKE else torch.bfloat16


class Batch:
    """A paged latent cache holding every sequence's context, and a step's queries."""

    def __init__(self, heads: int, q_lens: list[int], seq_lens: list[int]) -> None:
        nblk = [math.ceil(s / BLOCK) for s in seq_lens]
        num_blocks = sum(nblk)
        perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
        tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=DEV)
        used = 0
        for b, n in enumerate(nblk):
            tables[b, :n] = perm[used : used + n]
            used += n
        self.cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, dtype=DT, device=DEV)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.meta = AttentionMetadata(
            slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=DEV),  # unused
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            block_tables=tables,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_size=BLOCK,
            query_start_loc_host=starts,
            seq_lens_host=list(seq_lens),
            min_query_len=min(q_lens),
        )
        tokens = starts[-1]
        self.q_nope = torch.randn(tokens, heads, NOPE, dtype=DT, device=DEV)
        self.q_rot = torch.randn(tokens, heads, ROPE, dtype=DT, device=DEV)
        self.q_latent = torch.randn(tokens, heads, RANK, dtype=DT, device=DEV)
        self.w_kv = torch.randn(heads * (NOPE + V_DIM), RANK, dtype=DT, device=DEV) * 0.05
        self.heads = heads
        self.context = sum(s for q, s in zip(q_lens, seq_lens, strict=True) if q > 1)

    def absorbed(self, out: torch.Tensor, configs=None) -> torch.Tensor:
        return tk.absorbed_attention(
            self.q_latent, self.q_rot, self.cache, self.meta, 0.1, out=out, configs=configs
        )

    def expansion(self) -> tk.Expansion:
        tokens = self.q_nope.shape[0]
        return tk.expand_context(self.cache, self.meta, self.w_kv, self.heads, num_rows=tokens)

    def expanded(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's expanded form: gather the context, expand it, attend."""
        return tk.expanded_attention(self.q_nope, self.q_rot, self.expansion(), self.meta, 0.1, out)


def decode(name: str, heads: int) -> None:
    batch, ctx = (4, 40) if SMOKE else (256, 384)
    cases = [(batch, ctx)] + [(b, 64 if SMOKE else 2048) for b in (batch, 32, 8)]
    for b, c in cases:
        x = Batch(heads, [1] * b, [c] * b)
        out = torch.empty_like(x.q_latent)
        nbytes = b * c * (RANK + ROPE) * 2 + 2 * x.q_latent.numel() * 2
        what = f"mla decode {name} B{b} ctx{c}"
        default, prefill_cfg = tk.absorbed_configs(b, heads, x.cache.device)
        ref = x.absorbed(out).clone()
        label = f"absorbed default N{default.block_n} w{default.num_warps} S{default.splits}"
        try_bench(what, label, partial(x.absorbed, out), nbytes=nbytes, graph=True)
        block_h = min(16, triton.next_power_of_2(heads))
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for splits in sorted({1, 2, 4, default.splits}):
                    cfg = tk.MLAConfig(1, block_h, block_n, splits, warps, 2)
                    if cfg == default or (c == ctx and splits > 2):
                        continue
                    fn = partial(x.absorbed, out, (cfg, prefill_cfg))
                    variant = f"absorbed N{block_n} w{warps} S{splits}"
                    try_bench(what, variant, fn, nbytes=nbytes, ref=ref, graph=True)
        if c == ctx:
            w_uk = torch.randn(heads, NOPE, RANK, dtype=DT, device=DEV)
            qn = x.q_nope.transpose(0, 1)
            try_bench(what, "  + bmm q_nope W_UK", partial(torch.bmm, qn, w_uk), graph=True)
            lat = torch.empty(heads, b, RANK, dtype=DT, device=DEV)
            w_uv = torch.randn(heads, RANK, V_DIM, dtype=DT, device=DEV)
            try_bench(what, "  + bmm W_UV", partial(torch.bmm, lat, w_uv), graph=True)
            try_bench(what, "plain-torch latent decode", partial(plain_decode, x), nbytes=nbytes)


def plain_decode(x: Batch) -> torch.Tensor:
    """What the layer did on CUDA before the kernel: gather every sequence, attend in torch."""
    bs = x.cache.shape[1]
    max_len = x.meta.max_seq_len
    blocks = x.meta.block_tables[:, : -(-max_len // bs)].long()
    rows = x.cache[blocks].reshape(blocks.shape[0], -1, RANK + ROPE)
    latent, k_rot = rows.split([RANK, ROPE], dim=-1)
    scores = torch.matmul(x.q_latent, latent.transpose(1, 2))
    scores = (scores + torch.matmul(x.q_rot, k_rot.transpose(1, 2))) * 0.1
    past = torch.arange(latent.shape[1], device=DEV)[None, :] >= x.meta.seq_lens[:, None]
    scores = scores.masked_fill(past[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(DT)
    return torch.matmul(probs, latent)


def prefill(name: str, heads: int) -> None:
    cases = ((2, 24, 0), (2, 8, 16)) if SMOKE else ((16, 512, 0), (4, 1024, 3072))
    for nseq, plen, cached in cases:
        x = Batch(heads, [plen] * nseq, [plen + cached] * nseq)
        keys = cached + (plen + 1) / 2  # mean keys per query
        tokens = nseq * plen
        what = f"mla prefill {name} {nseq}x{plen}+{cached}"
        flops_abs = 2 * tokens * heads * keys * (RANK + ROPE + RANK)
        flops_exp = 2 * tokens * heads * keys * (NOPE + ROPE + V_DIM)
        expand = 2 * x.context * RANK * heads * (NOPE + V_DIM)
        out_lat = torch.empty_like(x.q_latent)
        decode_cfg, default = tk.absorbed_configs(nseq, heads, x.cache.device)
        try_bench(what, f"absorbed default {tuple(default)}", partial(x.absorbed, out_lat),
                  flops=flops_abs)  # fmt: skip
        block_h = min(16, triton.next_power_of_2(heads))
        for bq, bn, warps in ((1, 32, 4), (2, 16, 8), (4, 32, 8)):
            cfg = tk.MLAConfig(bq, block_h, bn, 1, warps, 2)
            fn = partial(x.absorbed, out_lat, (decode_cfg, cfg))
            try_bench(what, f"absorbed Q{bq} N{bn} w{warps}", fn, flops=flops_abs)
        out = torch.empty(tokens, heads, V_DIM, dtype=DT, device=DEV)
        fits = "all fit" if x.context <= tokens else "none fit: absorbed serves them"
        try_bench(what, f"expanded: gather + GEMM + kernel ({fits})", partial(x.expanded, out),
                  flops=flops_exp + expand)  # fmt: skip
        if x.context > tokens:  # what it would cost with buffers large enough
            expansion = tk.expand_context(x.cache, x.meta, x.w_kv, heads, num_rows=x.context)
        else:
            expansion = x.expansion()
        args = (x.q_nope, x.q_rot, expansion, x.meta, 0.1, out)
        for bq, bn, warps in ((64, 32, 8), (64, 64, 8), (128, 32, 8), (64, 32, 4)):
            cfg = tk.MLAConfig(bq, 1, bn, 1, warps, 2)
            fn = partial(tk.expanded_attention, *args, config=cfg)
            label = "default" if cfg == tk.EXPANDED_CONFIG else ""
            try_bench(what, f"  kernel alone Q{bq} N{bn} w{warps} {label}", fn, flops=flops_exp)


def store() -> None:
    num_blocks = 64 if SMOKE else 4096
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, dtype=DT, device=DEV)
    for tokens in (8, 32) if SMOKE else (256, 8192):
        kv_a = torch.randn(tokens, RANK + ROPE, dtype=DT, device=DEV)
        latent, k_rot = kv_a[:, :RANK], kv_a[:, RANK:].contiguous()
        slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:tokens]
        nbytes = 2 * tokens * (RANK + ROPE) * 2
        what = f"store_latent T{tokens}"
        fn = partial(tk.store_latent, latent, k_rot, cache, slots)
        try_bench(what, "triton", fn, nbytes=nbytes, graph=True)
        plain = partial(store_plain, latent, k_rot, cache, slots)
        try_bench(what, "cat + index_copy_", plain, nbytes=nbytes, graph=True)


def store_plain(latent, k_rot, cache, slots) -> None:
    """The plain path's store: the packed row through ``index_copy_``."""
    packed = torch.cat([latent, k_rot], dim=-1)
    cache.view(-1, RANK + ROPE).index_copy_(0, slots, packed)


def main() -> None:
    if not torch.cuda.is_available() and not SMOKE:
        print("benchmarks/mla_kernels.py needs CUDA", file=sys.stderr)
        sys.exit(1)
    torch.manual_seed(0)
    device = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"device {device}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    sections = {
        "decode-v2": lambda: decode("V2-Lite H16", 16),
        "decode-v3": lambda: decode("V3 H128", 4 if SMOKE else 128),
        "prefill-v2": lambda: prefill("V2-Lite H16", 16),
        "prefill-v3": lambda: prefill("V3 H128", 4 if SMOKE else 128),
        "store": store,
    }
    run_sections(sections, t0)


if __name__ == "__main__":
    main()
