"""The MLA Triton kernels against float64 references and against the plain-torch MLA path.

Needs CUDA, or ``TRITON_INTERPRET=1`` on the CPU (then in float32 and float16:
the interpreter's bfloat16 dots are wrong); skips without either, and
without triton.  Tolerances are ``‖out − ref‖ / ‖ref‖``: 1e-4 for float32
inputs, 3e-3 for float16, 1e-2 for bfloat16.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.triton import DEVICE, HAS_CUDA, INTERPRET, KERNEL_TEST_MARKS

pytest.importorskip("triton")

from moetrace.forward_context import AttentionMetadata, forward_context  # noqa: E402
from moetrace.kernels import triton_mla  # noqa: E402
from moetrace.layers.mla import MLADims, MultiHeadLatentAttention  # noqa: E402

pytestmark = KERNEL_TEST_MARKS
HALF = torch.float16 if INTERPRET else torch.bfloat16
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in the output (unwritten or NaN)"
    return ((out - ref).norm() / ref.norm()).item()


def step_metadata(q_lens, seq_lens, tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    """A step's metadata (host tensors): each sequence's new tokens are its last q_len."""
    slots = []
    for b, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q, s)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    starts = [0, *np.cumsum(q_lens).tolist()]
    return AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables[: len(seq_lens)].to(torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_host=starts,
        seq_lens_host=list(seq_lens),
        min_query_len=min(q_lens),
    )


def as_padded_step(meta: AttentionMetadata, empty_slots: int = 2) -> AttentionMetadata:
    """The same step laid out as the engine's padded steps are: empty sequence slots after
    the real ones, the block tables packed at their own width inside a wider view (the row
    stride given on the device), no host lists."""
    tables = meta.block_tables
    seqs, width = tables.shape[0] + empty_slots, tables.shape[1]
    flat = torch.full((seqs * width + 5,), -7, dtype=torch.int32)  # junk past the packed rows
    flat[: tables.numel()] = tables.reshape(-1)
    flat[tables.numel() : seqs * width] = 0
    total = int(meta.query_start_loc[-1])
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.cat([meta.query_start_loc, torch.full((empty_slots,), total)]).int(),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(empty_slots, dtype=torch.int32)]),
        block_tables=flat[: flat.numel() // seqs * seqs].view(seqs, -1),
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        block_size=meta.block_size,
        query_start_loc_host=[],
        seq_lens_host=[],
        min_query_len=0,
        block_table_stride=torch.tensor([width], dtype=torch.int32),
    )


def random_tables(seq_lens, block_size: int, num_blocks: int, gen) -> torch.Tensor:
    """Blocks placed at random; padding entries point at random blocks (never to be followed)."""
    max_blocks = max(math.ceil(s / block_size) for s in seq_lens) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    used = 0
    for b, s in enumerate(seq_lens):
        n = math.ceil(s / block_size)
        tables[b, :n] = torch.tensor(perm[used : used + n])
        used += n
    return tables


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    names = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "block_table_stride")
    for name in names:
        if getattr(meta, name) is not None:
            setattr(meta, name, getattr(meta, name).to(DEVICE))
    return meta


class LatentBatch:
    """Sequences' latents and rope keys, the cached prefix written, queries for the new tokens."""

    def __init__(
        self, q_lens, seq_lens, heads, rank, rope, dtype, *, block_size=4, seed=0, padded=False
    ):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens, self.rank = q_lens, seq_lens, rank
        num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
        tables = random_tables(seq_lens, block_size, num_blocks, gen)
        slots = [
            tables[b, torch.arange(s) // block_size] * block_size + torch.arange(s) % block_size
            for b, s in enumerate(seq_lens)
        ]
        meta = step_metadata(q_lens, seq_lens, tables, block_size)
        meta = as_padded_step(meta) if padded else meta
        # Unwritten rows hold NaN: a kernel that reads one poisons its output.
        self.cache = torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=dtype)
        self.latents = [torch.randn(s, rank, generator=gen).to(dtype) for s in seq_lens]
        self.k_rots = [torch.randn(s, rope, generator=gen).to(dtype) for s in seq_lens]
        rows = self.cache.view(-1, rank + rope)
        for slot, c, k, q, s in zip(
            slots, self.latents, self.k_rots, q_lens, seq_lens, strict=True
        ):
            rows[slot[: s - q]] = torch.cat([c, k], dim=-1)[: s - q]
        self.new_latent = torch.cat(
            [c[s - q :] for c, q, s in zip(self.latents, q_lens, seq_lens, strict=True)]
        )
        self.new_k_rot = torch.cat(
            [k[s - q :] for k, q, s in zip(self.k_rots, q_lens, seq_lens, strict=True)]
        )
        total = sum(q_lens)
        self.q_latent = torch.randn(total, heads, rank, generator=gen).to(dtype)
        self.q_rot = torch.randn(total, heads, rope, generator=gen).to(dtype)
        self.meta = to_device(meta)
        self.cache = self.cache.to(DEVICE)
        self.new_latent, self.new_k_rot = self.new_latent.to(DEVICE), self.new_k_rot.to(DEVICE)
        self.q_latent, self.q_rot = self.q_latent.to(DEVICE), self.q_rot.to(DEVICE)

    def store(self) -> None:
        triton_mla.store_latent(self.new_latent, self.new_k_rot, self.cache, self.meta.slot_mapping)

    def reference(self, scale: float) -> torch.Tensor:
        """float64 causal attention in latent space, sequence by sequence."""
        outs, start = [], 0
        for c, k, q_len, s in zip(
            self.latents, self.k_rots, self.q_lens, self.seq_lens, strict=True
        ):
            ql = self.q_latent[start : start + q_len].cpu().double()
            qr = self.q_rot[start : start + q_len].cpu().double()
            scores = torch.einsum("qhr,kr->hqk", ql, c.double())
            scores = (scores + torch.einsum("qhp,kp->hqk", qr, k.double())) * scale
            visible = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,kr->qhr", probs, c.double()))
            start += q_len
        return torch.cat(outs)


STEPS = {
    "decode": ([1] * 5, [9, 1, 17, 4, 30]),
    "prefill": ([7, 12], [7, 12]),
    "mixed-prefix-chunks": ([1, 6, 1, 9, 3], [13, 6, 2, 20, 11]),
}


@pytest.mark.parametrize("padded", [False, True], ids=["plain-step", "padded-step"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize(
    "heads, rank, rope, dtype",
    [(4, 32, 16, torch.float32), (3, 15, 8, torch.float32), (16, 512, 64, HALF)],
    ids=["small", "odd-widths", "v2-widths"],
)
def test_absorbed_attention_matches_float64(step, heads, rank, rope, dtype, padded):
    q_lens, seq_lens = STEPS[step]
    seed = len(step) + heads
    batch = LatentBatch(q_lens, seq_lens, heads, rank, rope, dtype, seed=seed, padded=padded)
    batch.store()
    out = torch.full_like(batch.q_latent, float("nan"))
    result = triton_mla.absorbed_attention(
        batch.q_latent, batch.q_rot, batch.cache, batch.meta, 0.3, out=out
    )
    assert result.data_ptr() == out.data_ptr()
    err = rel_err(out, batch.reference(0.3))
    assert err < TOL[dtype], f"relative error {err:.2e}"


def test_decode_splits_follow_the_batch_shape_and_agree():
    """Small decode batches split their keys; every split count gives the same attention."""
    cpu = torch.device("cpu")
    assert triton_mla.decode_splits(1, 1, cpu) == triton_mla.MAX_SPLITS
    assert triton_mla.decode_splits(256, 1, cpu) == 1
    assert triton_mla.decode_splits(64, 1, cpu) == 4
    batch = LatentBatch([1] * 3, [40, 3, 70], 4, 32, 16, torch.float32, seed=3, padded=True)
    batch.store()
    ref = batch.reference(0.2)
    prefill = triton_mla.MLAConfig(2, 4, 16, 1, 4, 1)
    for splits in (1, 2, 16):  # 16 splits over 3 keys leave most shares empty
        decode = triton_mla.MLAConfig(1, 4, 16, splits, 4, 1)
        out = triton_mla.absorbed_attention(
            batch.q_latent, batch.q_rot, batch.cache, batch.meta, 0.2, configs=(decode, prefill)
        )
        assert rel_err(out, ref) < TOL[torch.float32], f"{splits} splits"


def test_store_latent_writes_its_rows_and_skips_negative_slots():
    batch = LatentBatch([2, 3], [5, 3], 2, 15, 8, torch.float32, seed=5)
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    triton_mla.store_latent(batch.new_latent, batch.new_k_rot, batch.cache, slots)
    rows = batch.cache.view(-1, 23)
    keep = slots >= 0
    expected = torch.cat([batch.new_latent, batch.new_k_rot], dim=-1)[keep]
    assert torch.equal(rows[slots[keep]], expected)
    assert rows[batch.meta.slot_mapping[1]].isnan().all()  # its slot was skipped


@pytest.mark.parametrize("padded", [False, True], ids=["plain-step", "padded-step"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_the_two_forms_split_a_step_and_match_float64(dtype, padded):
    """A decode, a prompt whose context fits the expanded buffers, a prompt chunk behind a
    prefix that does not, a decode: the expanded form writes the fitting prompt's rows and
    nothing else, the absorbed form every other row; each matches float64."""
    heads, nope, rope, v_dim, rank = 3, 16, 8, 24, 20
    q_lens, seq_lens = [1, 6, 4, 1], [9, 6, 10, 2]
    gen = torch.Generator().manual_seed(6)
    batch = LatentBatch(q_lens, seq_lens, heads, rank, rope, dtype, seed=6, padded=padded)
    batch.store()
    w_kv = (torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.3).to(dtype).to(DEVICE)
    # 12 rows: the 6-token prompt's context fits (rows 0-5), the chunk's 10 rows do not.
    expansion = triton_mla.expand_context(batch.cache, batch.meta, w_kv, heads, num_rows=12)
    assert expansion.kv_start[:4].tolist() == [0, 0, 6, 16]
    q_nope = torch.randn(sum(q_lens), heads, nope, generator=gen).to(dtype).to(DEVICE)
    out = torch.full((sum(q_lens), heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    triton_mla.expanded_attention(q_nope, batch.q_rot, expansion, batch.meta, 0.25, out)
    latent_out = torch.full_like(batch.q_latent, float("nan"))
    triton_mla.absorbed_attention(
        batch.q_latent, batch.q_rot, batch.cache, batch.meta, 0.3, out=latent_out,
        expansion=expansion,
    )  # fmt: skip
    latent_ref = batch.reference(0.3)
    start = 0
    for b, (c, k, q_len, s) in enumerate(
        zip(batch.latents, batch.k_rots, q_lens, seq_lens, strict=True)
    ):
        rows = slice(start, start + q_len)
        start += q_len
        if b != 1:  # the absorbed form's
            assert torch.isnan(out[rows]).all()
            assert rel_err(latent_out[rows], latent_ref[rows]) < TOL[dtype]
            continue
        assert torch.isnan(latent_out[rows]).all()
        kv_ref = (c.double() @ w_kv.cpu().double().T).view(s, heads, nope + v_dim)
        keys = torch.cat([kv_ref[..., :nope], k.double()[:, None].expand(-1, heads, -1)], -1)
        q = torch.cat([q_nope, batch.q_rot], -1)[rows].cpu().double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.25
        visible = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        ref = torch.einsum("hqk,khv->qhv", probs, kv_ref[..., nope:])
        assert rel_err(out[rows], ref) < TOL[dtype]


# ---------------------------------------------------------------------------
# The layer: kernel path against the plain path
# ---------------------------------------------------------------------------


def mla_layer(dims: MLADims, seed: int) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    layer = MultiHeadLatentAttention(dims, dims.qk_dim**-0.5, bias=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    return layer.to(DEVICE)


@pytest.mark.parametrize("expand", [True, False], ids=["expanded-prefill", "absorbed-only"])
def test_layer_kernels_match_the_plain_path(expand):
    """Four steps through one layer, float32: prompts; a decode beside two new prompts; a
    decode, a prompt's second chunk and a decode; decode."""
    dims = MLADims(
        hidden=48, num_heads=4, q_lora_rank=None, kv_lora_rank=32, nope_dim=16, rope_dim=8, v_dim=12
    )
    torch.manual_seed(7)
    layer = MultiHeadLatentAttention(dims, dims.qk_dim**-0.5, bias=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    layer = layer.to(DEVICE)
    gen = torch.Generator().manual_seed(8)
    tables = torch.randperm(12, generator=gen).view(3, 4)
    # Expanded (where it fits) in the steps with prompt tokens: the first three.
    steps = [
        ([9, 5], [9, 5]),
        ([1, 6, 4], [10, 6, 4]),
        ([1, 3, 1], [11, 9, 5]),
        ([1] * 3, [12, 10, 6]),
    ]
    inputs = [torch.randn(sum(q), dims.hidden, generator=gen).to(DEVICE) for q, _ in steps]
    outputs, expanded = {}, []
    for kernels in (False, True):
        layer.attn.use_triton = kernels
        layer.expand_min_tokens = 1 if expand else None
        layer.attn.bind_kv_cache([torch.full((12, 4, 40), float("nan"), device=DEVICE)])
        outputs[kernels] = []
        for x, (q_lens, seq_lens) in zip(inputs, steps, strict=True):
            meta = to_device(step_metadata(q_lens, seq_lens, tables, 4))
            with torch.no_grad(), forward_context(meta):
                outputs[kernels].append(layer(x, lambda t: t * 0.5))
            expanded.append(layer._expands(meta, x))
    assert expanded[4:] == [expand, expand, expand, False]
    for plain, fast in zip(outputs[False], outputs[True], strict=True):
        assert rel_err(fast, plain) < TOL[torch.float32]


# ---------------------------------------------------------------------------
# The engine: a DeepSeek model's routing through the kernels
# ---------------------------------------------------------------------------


@pytest.mark.skipif(
    HAS_CUDA, reason="on CUDA, test_parity_deepseek_v*::test_cuda_records_what_the_cpu_records"
)
@pytest.mark.parametrize(
    "family, shape",
    [
        ("deepseek_v2", dict(q_lora_rank=None, first_k_dense_replace=1)),
        ("deepseek_v3", dict(kv_lora_rank=15, rope_interleave=False, n_group=2, topk_group=1)),
    ],
    ids=["v2-q-proj", "v3-odd-latent"],
)
def test_engine_routes_the_same_through_the_kernels(tmp_path, family, shape):
    """float32 under the interpreter: chunked prefill (expanded where the context fits the
    step, absorbed where not), prefix hits and decode give the plain path's tokens and routing
    rows exactly."""
    from support.hf_reference import make_tiny_checkpoint
    from support.parity import prompts

    from moetrace.config import EngineConfig
    from moetrace.engine.llm_engine import LLMEngine
    from moetrace.engine.sampling import SamplingParams
    from moetrace.layers.mla import LatentCache, MultiHeadLatentAttention
    from moetrace.models.loader import load_model

    ckpt = make_tiny_checkpoint(family, tmp_path / "m", seed=5, **shape)
    runs = []
    for kernels in (False, True):
        model = load_model(str(ckpt), device=DEVICE, dtype="float32").model
        config = EngineConfig(
            num_kv_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=8
        )
        eng = LLMEngine(model, config, DEVICE)
        for module in model.modules():
            if isinstance(module, LatentCache):
                module.use_triton = kernels  # the runner turns kernels on only on CUDA
            if isinstance(module, MultiHeadLatentAttention):
                module.expand_min_tokens = 1  # prompt chunks through the expanded form too
        for i, (rid, ids) in enumerate(prompts(5, short=False, long=21).items()):
            eng.add_request(rid, ids, SamplingParams(max_tokens=5, ignore_eos=True), index=i)
        runs.append({f.request_id: f for f in eng.run()})
    for rid, plain in runs[0].items():
        fast = runs[1][rid]
        assert fast.output_token_ids.tolist() == plain.output_token_ids.tolist(), rid
        np.testing.assert_array_equal(fast.routed_experts, plain.routed_experts, err_msg=rid)
