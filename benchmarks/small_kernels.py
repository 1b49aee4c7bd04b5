"""A decode layer's small kernels before and after their fusion, replayed from CUDA graphs.

    PYTHONPATH=. python benchmarks/small_kernels.py [SECTION-PREFIX ...] [--tokens N]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/small_kernels.py --smoke

At T=256 decode tokens (context 320) for the Qwen3-30B-A3B and OLMoE-1B-7B
shapes, and DeepSeek-V2-Lite's residual parts, each part of a layer the
fusions replace runs as the old sequence and as the fused kernel, each
captured in its own CUDA graph and replayed (``do_bench`` medians):

- ``qkv``: q_norm, k_norm, rotary on q and k, the KV store (five launches)
  against ``kernels/triton_qkv.qkv_rope_store``;
- ``attn-out``: the residual add and the post-attention norm against
  ``kernels/triton_residual.add_rms_norm``;
- ``moe-out``: the top-k sum (plus the shared experts), the residual add and
  the next input norm against ``add_rms_norm`` on the un-summed rows;
- ``weights``: the top-k weights' float32 cast, which the down GEMM no
  longer needs (it reads the 16-bit weights);

Each part's outputs are checked: the fused ones bit for bit against the old,
except the top-k sum, whose float32 order is not torch's (the share of
residual elements that moved by it is printed).  Then, per model, ``layer``:
a two-layer model of the shape with dummy weights, its whole forward at the
same batch replayed with the fusions off and on (``layers/residual.FUSED_NORMS``,
read at each call), the difference per layer.

``--smoke``: tiny shapes on the CPU under Triton's interpreter, in float16
(where the interpreter rounds as the GPU does): correctness only, no times.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import graph_replay
import torch

from moetrace.forward_context import AttentionMetadata, forward_context
from moetrace.kernels.triton_attention import store_kv
from moetrace.kernels.triton_norm import rms_norm, rotary
from moetrace.kernels.triton_qkv import qkv_rope_store
from moetrace.kernels.triton_residual import add_rms_norm
from moetrace.layers import residual as residual_module
from moetrace.layers.rotary import RotaryEmbedding

SMOKE = "--smoke" in sys.argv
DEV = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float16 if SMOKE else torch.bfloat16
CONFIGS = Path(__file__).parent / "configs"
ROWS: list[tuple[str, str, float, float, str]] = []  # (model, part, old us, new us, note)


def _arg(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


TOKENS = 5 if SMOKE else _arg("--tokens", 256)
CONTEXT = 12 if SMOKE else 320


@dataclass(frozen=True)
class Shape:
    name: str
    config: str  # benchmarks/configs/<config>.json
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    norm: str | None  # q/k norm: "head", "full"; None: MLA (no fused-QKV part)
    top_k: int
    experts: int
    eps: float
    shared: bool  # shared experts added after the top-k sum
    layers: int  # decoder layers (attention parts run in each)
    moe_layers: int  # routed ones (MoE parts)


SHAPES = {
    "qwen3": Shape(
        "Qwen3-30B-A3B", "qwen3-30b-a3b", 2048, 32, 4, 128, "head", 8, 128, 1e-6, False, 48, 48
    ),
    "olmoe": Shape(
        "OLMoE-1B-7B", "olmoe-1b-7b", 2048, 16, 16, 128, "full", 8, 64, 1e-5, False, 16, 16
    ),
    "deepseek": Shape(
        "DeepSeek-V2-Lite", "deepseek-v2-lite", 2048, 16, 16, 0, None, 6, 64, 1e-6, True, 27, 26
    ),
}
if SMOKE:  # the same structure, tiny widths
    SHAPES = {
        k: replace(s, hidden=64, heads=4, kv_heads=2 if s.norm == "head" else 4, head_dim=16)
        for k, s in SHAPES.items()
    }


# ---------------------------------------------------------------- plumbing
def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` itself in smoke runs (no CUDA), else its CUDA-graph replay."""
    return fn if SMOKE else graph_replay.graphed(fn, warmups=2)


def replay_us(fn: Callable[[], object]) -> float:
    """Median microseconds of one graph replay of ``fn`` (NaN in smoke runs)."""
    replay = graphed(fn)
    if SMOKE:
        replay()
        return math.nan
    from triton.testing import do_bench

    torch.cuda.synchronize()
    return do_bench(replay, warmup=25, rep=200, return_mode="median") * 1e3


def record(model: str, part: str, old: float, new: float, note: str = "") -> None:
    ROWS.append((model, part, old, new, note))
    print(f"{model:18s} {part:10s} old {old:8.1f} us  new {new:8.1f} us  {note}", flush=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEV) * scale).to(DTYPE)


# ------------------------------------------------------------------- parts
def qkv_part(key: str) -> None:
    s = SHAPES[key]
    t, d = TOKENS, s.head_dim
    q_size, kv_size = s.heads * d, s.kv_heads * d
    qkv = randn(t, q_size + 2 * kv_size, scale=2.0)
    rope = RotaryEmbedding(d, 1_000_000.0).to(DEV)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (t,), device=DEV), DTYPE)
    width = q_size if s.norm == "full" else d
    kv_width = kv_size if s.norm == "full" else d
    qw = (torch.rand(width, device=DEV) + 0.5).to(DTYPE)
    kw = (torch.rand(kv_width, device=DEV) + 0.5).to(DTYPE)
    blocks = t // 16 + 2
    slots = torch.randperm(blocks * 16, device=DEV)[:t]

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (blocks, 16, s.kv_heads, d)
        return (torch.full(shape, float("nan"), dtype=DTYPE, device=DEV) for _ in range(2))

    old_k, old_v = caches()
    new_k, new_v = caches()

    def old() -> torch.Tensor:  # FusedQKVAttention's kernel path before the fusion
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if s.norm == "full":
            q, k = rms_norm(q, qw, s.eps), rms_norm(k, kw, s.eps)
        q, k, v = (y.reshape(t, -1, d) for y in (q, k, v))
        if s.norm == "head":
            q, k = rms_norm(q, qw, s.eps), rms_norm(k, kw, s.eps)
        if not SMOKE:  # bfloat16: the rotary kernel
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        else:
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        store_kv(k, v, old_k, old_v, slots)
        return q

    def new() -> torch.Tensor:
        return qkv_rope_store(
            qkv, s.heads, s.kv_heads, cos, sin, new_k, new_v, slots,
            norm=s.norm, q_weight=qw, k_weight=kw, q_eps=s.eps, k_eps=s.eps,
        )  # fmt: skip

    exact = all(same_bits(a, b) for a, b in ((old(), new()), (old_k, new_k), (old_v, new_v)))
    record(s.name, "qkv", replay_us(old), replay_us(new), f"bitwise: {exact}")


def attn_out_part(key: str) -> None:
    s = SHAPES[key]
    a, res = randn(TOKENS, s.hidden, scale=0.5), randn(TOKENS, s.hidden, scale=4.0)
    w = (torch.rand(s.hidden, device=DEV) + 0.5).to(DTYPE)

    def old() -> tuple[torch.Tensor, torch.Tensor]:
        r = res + a
        return rms_norm(r, w, s.eps), r

    def new() -> tuple[torch.Tensor, torch.Tensor | None]:
        return add_rms_norm(a, res, w, s.eps)

    exact = all(same_bits(x, y) for x, y in zip(old(), new(), strict=True))
    record(s.name, "attn-out", replay_us(old), replay_us(new), f"bitwise: {exact}")


def moe_out_part(key: str) -> None:
    s = SHAPES[key]
    rows = randn(TOKENS, s.top_k, s.hidden, scale=0.2)
    res = randn(TOKENS, s.hidden, scale=4.0)
    extra = randn(TOKENS, s.hidden, scale=0.3) if s.shared else None
    w = (torch.rand(s.hidden, device=DEV) + 0.5).to(DTYPE)

    def old() -> tuple[torch.Tensor, torch.Tensor]:  # fused_moe's tail, the layer's add, a norm
        out = rows.sum(dim=1)
        if extra is not None:
            out = out + extra
        r = res + out
        return rms_norm(r, w, s.eps), r

    def new() -> tuple[torch.Tensor, torch.Tensor | None]:
        return add_rms_norm(rows, res, w, s.eps, extra=extra)

    acc = rows[:, 0].float()
    for j in range(1, s.top_k):
        acc = acc + rows[:, j].float()
    summed = acc.to(DTYPE) if extra is None else acc.to(DTYPE) + extra
    _, new_residual = new()
    exact = same_bits(new_residual, res + summed)
    moved = (old()[1] != new_residual).float().mean().item()
    note = f"fixed-order sum bitwise: {exact}; residual vs torch's sum: {moved:.2e} moved"
    record(s.name, "moe-out", replay_us(old), replay_us(new), note)


def weights_part(key: str) -> None:
    s = SHAPES[key]
    weights = torch.rand(TOKENS, s.top_k, device=DEV).to(DTYPE)
    record(s.name, "weights", replay_us(lambda: weights.reshape(-1).to(torch.float32)), 0.0,
           "cast removed: the down GEMM widens the 16-bit weights as it loads them")  # fmt: skip


# ------------------------------------------------------------------- layer
def _decode_metadata(layers, tokens: int, context: int, block_size: int = 16) -> AttentionMetadata:
    """``tokens`` sequences decoding one token each at ``context``, blocks shuffled."""
    per_seq = -(-context // block_size)
    num_blocks = tokens * per_seq + 1
    for layer in layers:
        shapes = layer.kv_cache_shapes(num_blocks, block_size)
        layer.bind_kv_cache([torch.randn(sh, device=DEV).to(DTYPE) * 0.5 for sh in shapes])
    tables = torch.randperm(num_blocks - 1, device=DEV)[: tokens * per_seq].view(tokens, per_seq)
    tables = tables.to(torch.int32)
    pos = torch.full((tokens,), context - 1, device=DEV)
    rows = torch.arange(tokens, device=DEV)
    slots = tables[rows, pos // block_size].long() * block_size + pos % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(tokens + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((tokens,), context, dtype=torch.int32, device=DEV),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context,
        block_size=block_size,
        query_start_loc_host=list(range(tokens + 1)),
        seq_lens_host=[context] * tokens,
    )


def layer_part(key: str) -> None:
    from moetrace.engine.model_runner import set_kernel_paths
    from moetrace.models.loader import fill_dummy, instantiate

    s = SHAPES[key]
    config = json.loads((CONFIGS / f"{s.config}.json").read_text())
    config["num_hidden_layers"] = 2 + int(config.get("first_k_dense_replace", 0) or 0)
    if SMOKE:
        config.update(hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
                      num_attention_heads=4, num_key_value_heads=s.kv_heads, head_dim=16,
                      vocab_size=128, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                      qk_nope_head_dim=16, v_head_dim=16)  # fmt: skip
        config = {k: v for k, v in config.items() if v is not None or k == "q_lora_rank"}
    model = instantiate(config, "dummy", DTYPE, DEV)
    fill_dummy(model, 1)
    set_kernel_paths(model, True)
    meta = _decode_metadata(list(model.attention_layers()), TOKENS, CONTEXT)
    ids = torch.randint(0, config["vocab_size"], (TOKENS,), device=DEV)
    pos = torch.full((TOKENS,), CONTEXT - 1, device=DEV)
    times, outs = {}, {}
    with torch.inference_mode(), forward_context(meta):
        for fused in (False, True):
            residual_module.FUSED_NORMS = fused
            outs[fused] = model(ids, pos).clone()
            times[fused] = replay_us(lambda: model(ids, pos))
    residual_module.FUSED_NORMS = True
    layers = len(model.moe_layer_indices)
    diff = (outs[True].float() - outs[False].float()).abs().max().item()
    note = (
        f"{len(model.layers)} layers, {layers} MoE; per MoE layer "
        f"{(times[False] - times[True]) / layers:.1f} us; max |diff| {diff:.2e} (top-k sum order)"
    )
    record(s.name, "layer", times[False], times[True], note)
    if not SMOKE:
        torch.cuda.empty_cache()


# -------------------------------------------------------------------- main
def main() -> None:
    if not SMOKE and not torch.cuda.is_available():
        print("benchmarks/small_kernels.py needs CUDA (or --smoke)", file=sys.stderr)
        sys.exit(1)
    torch.manual_seed(0)
    print(f"device {'cpu (smoke)' if SMOKE else torch.cuda.get_device_name()}  T={TOKENS}")
    sections: dict[str, Callable[[], None]] = {}
    for key, shape in SHAPES.items():
        if shape.norm is not None:
            sections[f"{key}-qkv"] = lambda key=key: qkv_part(key)
        sections[f"{key}-attn-out"] = lambda key=key: attn_out_part(key)
        sections[f"{key}-moe-out"] = lambda key=key: moe_out_part(key)
        sections[f"{key}-weights"] = lambda key=key: weights_part(key)
        sections[f"{key}-layer"] = lambda key=key: layer_part(key)
    wanted = [a for a in sys.argv[1:] if not a.startswith("--") and not a.isdigit()]
    order = [k for w in wanted for k in sections if k.startswith(w)] if wanted else list(sections)
    t0 = time.time()
    for key in dict.fromkeys(order):
        sections[key]()
    print(f"\n(total {time.time() - t0:.0f} s)\n")
    print(
        f"{'model':18s} {'part':10s} {'old us':>9s} {'new us':>9s} {'saved':>8s} {'x layers':>9s}"
    )
    for model, part, old, new, _ in ROWS:
        shape = next(s for s in SHAPES.values() if s.name == model)
        layers = shape.moe_layers if part in ("moe-out", "weights") else shape.layers
        saved = old - new
        step = "" if part == "layer" else f"{saved * layers / 1e3:7.2f} ms"
        print(f"{model:18s} {part:10s} {old:9.1f} {new:9.1f} {saved:8.1f} {step:>9s}")


if __name__ == "__main__":
    main()
