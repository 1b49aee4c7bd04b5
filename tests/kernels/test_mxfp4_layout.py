"""The fragment layout of MXFP4 experts (``kernels/mxfp4_layout.py``), on the CPU without Triton.

The kernel's fast decoder is a block of PTX; here a tiny emulator of its five
instructions runs it on packed words, so the layout and the assembly are
checked together against an independent decoder of the e2m1 and e8m0 bits
(``gpt_oss_helpers``) wherever the tests run, GPU or not.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from support.gpt_oss import e2m1_values

from moetrace.kernels import mxfp4_layout as layout
from moetrace.layers.moe import MoEExperts
from moetrace.layers.mxfp4 import FAST_SCALE_MAX, dequantize_mxfp4


def random_mxfp4(shape: tuple[int, ...], k: int, seed: int, scales=(100, 129)):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(*scales, (*shape, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("gate_up", [False, True])
def test_fragment_round_trip(gate_up):
    """Three experts (odd), 96 values along K (a 64-value group tail); rows back in order."""
    blocks, scales = random_mxfp4((3, 48), 96, seed=1)
    packed, chunked = layout.to_fragment(blocks, scales, gate_up=gate_up)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert chunked.shape == (3, layout.scale_chunks(96), 48, 4) == (3, 1, 48, 4)
    assert (chunked[..., 3:] == layout.SCALE_PAD).all()
    assert not torch.equal(packed, blocks)
    back_blocks, back_scales = layout.from_fragment(packed, chunked, gate_up=gate_up)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)


def test_gate_up_rows_come_eight_gate_then_eight_up():
    order = layout.gate_up_rows(32).tolist()
    assert order[:16] == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert order[16:] == [16 + r for r in order[:16]]
    with pytest.raises(ValueError):
        layout.gate_up_rows(24)


def test_scale_chunks_hold_four_groups():
    assert layout.scale_chunks(2880) == 23  # gpt-oss: 90 groups, the last chunk of 2
    assert layout.scale_chunks(32) == 1
    assert layout.scale_chunks(512) == 4


def test_a_chunk_stores_its_words_lane_by_lane():
    """Five groups: a chunk of four, lane t's words side by side, then a chunk of one."""
    order = layout.word_order(5).tolist()
    assert order[:16] == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    assert order[16:] == [16, 17, 18, 19]
    assert sorted(layout.word_order(90).tolist()) == list(range(360))
    # and a short chunk of two: lane t's two words at 2 t
    assert layout.word_order(6).tolist()[16:] == [16, 20, 17, 21, 18, 22, 19, 23]


def test_words_are_stored_chunk_major():
    """Row n's 64 bytes of whole chunk c at (c N + n) * 64; the short last chunk (two groups at
    gpt-oss's 2,880) after them, 32 bytes a row; each piece as the row's lane-by-lane words."""
    blocks, scales = random_mxfp4((24,), 2880, seed=10)
    packed, _ = layout.to_fragment(blocks, scales, gate_up=False)
    rows = layout._reorder_words(
        layout.pack_codes(layout.checkpoint_codes(blocks)), layout.word_order(90)
    )
    flat = packed.flatten()
    for n, c in ((0, 0), (5, 3), (23, 21), (9, 0)):
        assert torch.equal(flat[(c * 24 + n) * 64 :][:64], rows[n, 64 * c : 64 * c + 64])
    tail = 22 * 24 * 64
    for n in (0, 7, 23):
        assert torch.equal(flat[tail + 32 * n :][:32], rows[n, 22 * 64 :])
    assert torch.equal(layout.rows_first(packed), rows)


def test_scales_of_a_chunk_sit_row_by_row():
    """Row n's four scales of chunk c are the four bytes at (c N + n) * 4."""
    _, scales = random_mxfp4((24,), 2880, seed=9)
    _, chunked = layout.to_fragment(torch.zeros(24, 1440, dtype=torch.uint8), scales, gate_up=False)
    flat = chunked.flatten()

    def at(c: int, n: int) -> list[int]:
        return flat[(c * 24 + n) * 4 :][:4].tolist()

    for n, c in ((0, 0), (5, 3), (23, 21)):
        assert at(c, n) == scales[n, 4 * c : 4 * c + 4].tolist()
    assert at(22, 7) == [*scales[7, 88:90].tolist(), 127, 127]


# ------------------------------------------------------------------ the fast decoder's PTX


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """Round to nearest even (subnormals kept), as PTX's ``mul.rn.bf16x2`` rounds."""
    t = torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def run_fast_ptx(words: np.ndarray, factors: np.ndarray) -> list[np.ndarray]:
    """Execute ``FAST_DECODE_PTX`` on uint32 arrays: ``$4`` = words, ``$5`` = factors."""
    regs = {"$4": words.astype(np.uint32), "$5": factors.astype(np.uint32)}

    def val(x: str) -> np.ndarray:
        return regs[x] if x in regs else np.uint32(int(x, 0))

    for line in layout.FAST_DECODE_PTX.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *srcs = [a.strip() for a in args.split(",")]
        a = val(srcs[0])
        b = val(srcs[1])
        if op == "and.b32":
            regs[d] = a & b
        elif op == "or.b32":
            regs[d] = a | b
        elif op == "shl.b32":
            regs[d] = (a << b) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            regs[d] = a >> b
        elif op == "mul.rn.bf16x2":
            lanes = []
            for shift in (0, 16):
                x = _bf16_bits_to_f32((a >> shift) & 0xFFFF).astype(np.float64)
                y = _bf16_bits_to_f32((b >> shift) & 0xFFFF).astype(np.float64)
                lanes.append(_f32_to_bf16_bits(x * y) << shift)  # exact products here
            regs[d] = lanes[0] | lanes[1]
        else:
            raise AssertionError(f"the emulator lacks {op!r}")
    return [regs[f"${i}"] for i in range(4)]


def test_the_emulator_reads_every_instruction():
    ops = {line.split()[0] for line in re.findall(r"^\s*([a-z].*);", layout.FAST_DECODE_PTX, re.M)}
    assert ops == {"and.b32", "or.b32", "shl.b32", "shr.b32", "mul.rn.bf16x2"}


@pytest.mark.parametrize("scale", [0, 1, 64, 119, 126, 127, FAST_SCALE_MAX])
def test_fast_ptx_decodes_every_code_exactly(scale):
    """All 16 codes in every position of a group (0.5 subnormal, -0 keeps its sign), at
    scales from the bottom of the e8m0 range to the fast decoder's limit."""
    gen = np.random.default_rng(scale)
    codes = np.stack([np.roll(np.arange(32) % 16, r) for r in range(16)])  # [16 rows, 32 k]
    codes = np.concatenate([codes, gen.integers(0, 16, (16, 32))]).astype(np.uint8)
    blocks = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
    packed = layout.pack_codes(layout.checkpoint_codes(blocks)).numpy()
    words = packed.view(np.uint32)  # [rows, 4]: word t of the row's one group
    factor = ((scale + 126) << 7) * 0x10001
    pairs = run_fast_ptx(words, np.full_like(words, factor))
    want = e2m1_values(codes.astype(np.int64)) * 2.0 ** (scale - 127)
    for q, pair in enumerate(pairs):
        for p in range(2):
            got = _bf16_bits_to_f32((pair >> (16 * p)) & 0xFFFF)  # [rows, t]
            k = 8 * q + 2 * np.arange(4) + p
            expect = want[:, k]
            np.testing.assert_array_equal(got, expect.astype(np.float32), err_msg=f"q={q} p={p}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(expect))


def test_fast_ptx_is_wrong_past_its_scale_limit():
    """Past ``FAST_SCALE_MAX`` the bf16 factor overflows: such experts take the generic decoder."""
    words = layout.pack_codes(torch.full((1, 32), 2, dtype=torch.uint8)).numpy().view(np.uint32)
    scale = FAST_SCALE_MAX + 1
    pairs = run_fast_ptx(words, np.full_like(words, ((scale + 126) << 7) * 0x10001))
    assert not np.isfinite(_bf16_bits_to_f32(pairs[0] & 0xFFFF)).all()


# ------------------------------------------------------------------ experts keep either layout


def experts_pair(seed: int, scales=(110, 125)) -> tuple[MoEExperts, MoEExperts]:
    """The same random MXFP4 experts (5 of them) loaded into each layout, float32."""
    pair = []
    gen = torch.Generator().manual_seed(seed)
    w13 = random_mxfp4((5, 128), 96, seed, scales)
    w2 = random_mxfp4((5, 96), 64, seed + 1, scales)
    b13, b2 = torch.randn(5, 128, generator=gen), torch.randn(5, 96, generator=gen)
    for kind in layout.LAYOUTS:
        experts = MoEExperts(
            5,
            96,
            64,
            "clamped_swiglu",
            bias=True,
            activation_args={"alpha": 1.702, "limit": 7.0},
            weight_format="mxfp4",
            mxfp4_layout=kind,
        )
        with torch.no_grad():
            experts.load_mxfp4("w13", *w13)
            experts.load_mxfp4("w2", *w2)
            experts.b13.copy_(b13)
            experts.b2.copy_(b2)
        pair.append(experts)
    return pair[0], pair[1]


def test_plain_path_reads_both_layouts_alike():
    checkpoint, fragment = experts_pair(seed=3)
    assert checkpoint.mxfp4_layout == "checkpoint" and fragment.mxfp4_layout == "fragment"
    assert fragment.w13_scale.shape == (5, 1, 128, 4) and checkpoint.w13_scale.shape == (5, 128, 3)
    for e in range(5):
        want = checkpoint._dense_weights(e, torch.float32)
        got = fragment._dense_weights(e, torch.float32)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    blocks = checkpoint.w2[2].unflatten(-1, (-1, 16))
    assert torch.equal(
        fragment._dense_weights(2, torch.float32)[1],
        dequantize_mxfp4(blocks, checkpoint.w2_scale[2], torch.float32),
    )
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 96, generator=gen)
    ids = torch.randint(0, 5, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    want = checkpoint.forward_torch(x, weights, ids)
    assert torch.equal(want, fragment.forward_torch(x, weights, ids))


def test_wide_scales_are_flagged_at_load():
    """A scale past the fast decoder's limit sends those experts to the generic decoder."""
    _, fragment = experts_pair(seed=5)
    assert not fragment.mxfp4_wide_scales
    _, wide = experts_pair(seed=5, scales=(120, FAST_SCALE_MAX + 2))
    assert wide.mxfp4_wide_scales


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="swizzled"):
        MoEExperts(2, 64, 96, weight_format="mxfp4", mxfp4_layout="swizzled")
