"""MXFP4 experts re-laid once at load so the fused-MoE kernel decodes them without shuffles.

Checkpoints store a matrix ``W [N, K]`` as bytes ``[N, K/2]`` (two e2m1 codes a
byte, the low nibble the earlier k) and one e8m0 scale per 32 values,
``[N, K/32]``.  Decoding that on a GPU without FP4 tensor cores cost the
kernel about nine instructions a value, most of them moving nibbles into
the order its matrix product wants (docs/benchmarks.md).  The *fragment*
layout stores the same codes in that order instead:

* **Words.**  Row ``n``'s 32-value group ``g`` is 16 bytes, four
  little-endian 32-bit words ``t = 0..3``.  Word ``t`` holds the eight codes
  of ``k = 32 g + 8 q + 2 t + p`` (``q = 0..3``, ``p = 0..1``): exactly what
  lane ``t`` of a four-lane quad holds of that row in the A operand of a
  16x16 bf16 tensor-core product (``mma``/``wgmma``: k pairs ``2t, 2t+1`` and
  ``2t+8, 2t+9`` of each 16-deep slab).  The kernel multiplies weights as the
  left operand, so a word decodes into four finished operand registers.
* **Chunks.**  A row's groups come in chunks of four (128 values, 64 bytes;
  the last chunk may hold fewer), and inside a chunk the words go lane by
  lane: word ``t`` of group ``j`` at ``t * n + j`` (``n`` groups in the
  chunk).  Lane ``t`` then reads its four words of a chunk as one 16-byte
  load, and the quad of a row reads the row's 64 bytes side by side: a warp
  reads eight rows' chunks, every 32-byte sector it touches used in full, and
  its words reach their registers in the order the decoder takes them
  (group-major words put the four 16-byte loads of a lane 64 bytes apart
  and cost the copy twice the sectors; docs/benchmarks.md).
* **Chunk-major rows.**  A matrix stores chunk 0 of every row, then chunk 1
  of every row, and so on (``[C, N, 64]`` bytes, the short last chunk
  ``[N, 16 n]``), as its scales are: one K step of a tile of rows is then one
  contiguous block (8 KB for 128 rows) where row-major rows put it in 64-byte
  pieces a row apart (1,440 bytes at gpt-oss's widths), and the GEMMs on
  gpt-oss-20b's experts at batch 256 took 8% longer (docs/benchmarks.md).
  The tensor keeps the shape ``[N, K/2]`` of the bytes it holds; only their
  order changes (``chunks_first`` and ``rows_first``).
* **Bits.**  Pair ``q`` decodes to one register of two bf16 values:
  ``(word << 3 q) & 0x81C081C0`` for ``q < 3``, and three shifts for ``q = 3``
  (the bits left over): each code's sign lands on a bf16 sign bit and its
  exponent and mantissa on the lowest exponent bits and the top mantissa bit,
  which reads as the e2m1 value times ``2**-126`` (``0.5`` as a subnormal).
  One bf16 multiply by ``2**(s - 1)`` then gives the value exactly
  (``PAIR_SHIFTS`` has the positions; ``pack_codes`` and ``unpack_codes`` are
  the definition, ``word_order`` the chunk order).
* **Rows of a gate/up matrix.**  The checkpoint alternates gate and up rows;
  here each 16 rows are 8 gate rows then the 8 up rows of the same channels,
  so the kernel's gate and up outputs of a channel sit in one thread.
* **Scales** are stored per chunk of four groups, rows side by side:
  ``[C, N, 4]`` (``C = scale_chunks(K)``; a short last chunk padded with
  127).  A K step's scales of consecutive rows are then consecutive 4-byte
  words (the checkpoint's ``[N, K/32]`` rows put each row's four bytes in a
  sector of their own).

The bytes take the checkpoint's space (the scale padding adds 2 bytes a row
at gpt-oss's widths).  Everything here is plain torch, on any device.
"""

from __future__ import annotations

import torch

LAYOUTS = ("checkpoint", "fragment")
GROUP = 32  # values per e8m0 scale
CHUNK = 4  # groups per chunk: one K step of 128 values, whose words go lane by lane
CHUNK_BYTES = GROUP * CHUNK // 2  # 64: a whole chunk of one row
SCALE_PAD = 127  # 2**0, for the padding (never multiplied into a value)
# Lane-0 bit positions of a pair's two codes (lane 1: +16), per pair q: sign, then
# mantissa, exponent bit 0, exponent bit 1.  Pairs 0-2 are one shift of pair 0's
# positions (the bf16 target); pair 3 takes the bits they leave.
PAIR_SHIFTS = (
    (15, 6, 7, 8),
    (12, 3, 4, 5),
    (9, 0, 1, 2),
    (14, 10, 11, 13),
)

# The fast decoder's PTX, one 32-bit word to its four bf16x2 pairs ($0..$3) times the
# bf16x2 factor $5 = 2**(s - 1), twice; $4 is the word.  Kept beside the bits it decodes
# (``kernels/triton_mxfp4.py`` runs it) so that tests without a GPU can execute it.
FAST_DECODE_PTX = """
{
.reg .b32 t0, t1, t2;
and.b32 $0, $4, 0x81C081C0;
mul.rn.bf16x2 $0, $0, $5;
shl.b32 t0, $4, 3;
and.b32 $1, t0, 0x81C081C0;
mul.rn.bf16x2 $1, $1, $5;
shl.b32 t0, $4, 6;
and.b32 $2, t0, 0x81C081C0;
mul.rn.bf16x2 $2, $2, $5;
shr.b32 t0, $4, 4;
and.b32 t0, t0, 0x00C000C0;
shr.b32 t1, $4, 5;
and.b32 t1, t1, 0x01000100;
shl.b32 t2, $4, 1;
and.b32 t2, t2, 0x80008000;
or.b32 t0, t0, t1;
or.b32 $3, t0, t2;
mul.rn.bf16x2 $3, $3, $5;
}
"""


def scale_chunks(k: int) -> int:
    """Chunks of four scale groups for ``k`` values along K."""
    return -(-k // (GROUP * CHUNK))


def scale_shape(rows: int, k: int) -> tuple[int, int, int]:
    """The fragment scales of a ``[rows, k]`` matrix: ``(scale_chunks(k), rows, 4)``."""
    return scale_chunks(k), rows, CHUNK


def word_order(groups: int, device: torch.device | None = None) -> torch.Tensor:
    """Stored word ``i`` of a row of ``groups`` groups is group-major word ``word_order(...)[i]``
    (word ``t`` of group ``g`` is group-major word ``4 g + t``)."""
    order = []
    for first in range(0, groups, CHUNK):
        n = min(CHUNK, groups - first)
        order += [4 * (first + j) + t for t in range(4) for j in range(n)]
    return torch.tensor(order, device=device)


def chunk_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales ``[..., N, G]`` to ``[..., scale_chunks(32 G), N, 4]``, padded with ``SCALE_PAD``."""
    groups = scales.shape[-1]
    chunks = scale_chunks(GROUP * groups)
    padded = scales.new_full((*scales.shape[:-1], chunks * CHUNK), SCALE_PAD)
    padded[..., :groups] = scales
    return padded.unflatten(-1, (chunks, CHUNK)).movedim(-2, -3).contiguous()


def unchunk_scales(chunked: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of ``chunk_scales``: ``[..., C, N, 4]`` to ``[..., N, groups]``."""
    return chunked.movedim(-3, -2).flatten(-2)[..., :groups].contiguous()


def chunks_first(blocks: torch.Tensor) -> torch.Tensor:
    """Fragment bytes with each row's chunks side by side (``[..., N, K/2]``) to the stored
    chunk-major order: the whole chunks ``[..., C, N, 64]``, then the last chunk ``[..., N, 16 n]``
    when it is short.  Same shape, bytes reordered."""
    rows, width = blocks.shape[-2:]
    whole = width // CHUNK_BYTES * CHUNK_BYTES
    head = blocks[..., :whole].unflatten(-1, (-1, CHUNK_BYTES)).movedim(-2, -3).flatten(-3)
    tail = blocks[..., whole:].flatten(-2)
    return torch.cat((head, tail), dim=-1).unflatten(-1, (rows, width)).contiguous()


def rows_first(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``chunks_first``."""
    rows, width = blocks.shape[-2:]
    whole = width // CHUNK_BYTES * CHUNK_BYTES
    flat = blocks.flatten(-2)
    head = (
        flat[..., : rows * whole]
        .unflatten(-1, (whole // CHUNK_BYTES, rows, CHUNK_BYTES))
        .movedim(-3, -2)
    )
    tail = flat[..., rows * whole :].unflatten(-1, (rows, width - whole))
    return torch.cat((head.flatten(-2), tail), dim=-1).contiguous()


def _reorder_words(blocks: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Row bytes ``[..., K/2]`` with their 32-bit words permuted: word ``i`` from ``order[i]``."""
    words = blocks.contiguous().view(torch.int32)
    return words.index_select(-1, order).view(torch.uint8)


def checkpoint_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Checkpoint bytes ``[..., K/2]`` to codes ``[..., K]`` (uint8 0..15, low nibble first)."""
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)


def checkpoint_blocks(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` back to checkpoint bytes ``[..., K/2]``."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` (K a multiple of 32) to fragment bytes ``[..., K/2]``."""
    c = codes.to(torch.int64).unflatten(-1, (-1, 4, 4, 2))  # [..., g, q, t, p]
    words = torch.zeros(c.shape[:-3] + (4,), dtype=torch.int64, device=codes.device)
    for q, (sign, *mag) in enumerate(PAIR_SHIFTS):
        for p in range(2):
            code = c[..., q, :, p]  # [..., g, t]
            lane = 16 * p
            words |= ((code >> 3) & 1) << (sign + lane)
            for bit, pos in enumerate(mag):
                words |= ((code >> bit) & 1) << (pos + lane)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous().view(torch.uint8).flatten(-2)  # little-endian words


def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Fragment bytes ``[..., K/2]`` back to codes ``[..., K]``."""
    words = blocks.contiguous().view(torch.int32).unflatten(-1, (-1, 4)).to(torch.int64)
    words = words & 0xFFFFFFFF  # [..., g, t]
    pairs = []
    for sign, *mag in PAIR_SHIFTS:
        lanes = []
        for p in range(2):
            lane = 16 * p
            code = ((words >> (sign + lane)) & 1) << 3
            for bit, pos in enumerate(mag):
                code |= ((words >> (pos + lane)) & 1) << bit
            lanes.append(code)
        pairs.append(torch.stack(lanes, dim=-1))  # [..., g, t, p]
    codes = torch.stack(pairs, dim=-3)  # [..., g, q, t, p]
    return codes.flatten(-4).to(torch.uint8)


def gate_up_rows(rows: int, device: torch.device | None = None) -> torch.Tensor:
    """Fragment row ``i`` of a gate/up matrix is checkpoint row ``gate_up_rows(...)[i]``.

    Checkpoint rows alternate gate and up (``2c``, ``2c + 1`` for channel ``c``);
    fragment rows come 16 at a time: gate rows of 8 channels, then their up rows.
    """
    if rows % 16:
        raise ValueError(f"a fragment gate/up matrix needs rows in multiples of 16, got {rows}")
    index = torch.arange(rows, device=device).view(-1, 8, 2)  # [block, channel, gate/up]
    return index.transpose(1, 2).reshape(-1)


def to_fragment(
    blocks: torch.Tensor, scales: torch.Tensor, *, gate_up: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint ``blocks [..., N, K/2]``, ``scales [..., N, K/32]`` to the fragment layout.

    ``gate_up``: the rows alternate gate and up (they are regrouped, see
    ``gate_up_rows``).  Returns ``(blocks [..., N, K/2], scales [...,
    scale_chunks(K), N, 4])``, the blocks' bytes chunk-major (``chunks_first``).
    """
    k = blocks.shape[-1] * 2
    if k % GROUP or scales.shape[-1] != k // GROUP or scales.shape[:-1] != blocks.shape[:-1]:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair"
        )
    if gate_up:
        order = gate_up_rows(blocks.shape[-2], blocks.device)
        blocks, scales = blocks.index_select(-2, order), scales.index_select(-2, order)
    packed = pack_codes(checkpoint_codes(blocks))
    packed = _reorder_words(packed, word_order(k // GROUP, blocks.device))
    return chunks_first(packed), chunk_scales(scales)


def from_fragment(
    blocks: torch.Tensor, scales: torch.Tensor, *, gate_up: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_fragment``: checkpoint ``(blocks, scales)``, rows in checkpoint order."""
    k = blocks.shape[-1] * 2
    inverse_words = torch.argsort(word_order(k // GROUP, blocks.device))
    codes = unpack_codes(_reorder_words(rows_first(blocks), inverse_words))
    out_blocks, out_scales = checkpoint_blocks(codes), unchunk_scales(scales, k // GROUP)
    if gate_up:
        inverse = torch.argsort(gate_up_rows(blocks.shape[-2], blocks.device))
        out_blocks = out_blocks.index_select(-2, inverse)
        out_scales = out_scales.index_select(-2, inverse)
    return out_blocks, out_scales.contiguous()
