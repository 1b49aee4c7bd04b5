"""Every kernel-path step at a padded shape, replayed from a CUDA graph where one is captured.

A step of ``n`` tokens over ``s`` sequences runs at the smallest size ``B >= n``
of a fixed ladder (``token_buckets``), with ``min(B, max_num_seqs) + 1``
sequence slots: the real sequences, one padding sequence that owns tokens
``n..B`` (position 0, KV written to a scratch block nobody else reads) and
empty slots.  Inputs live in static device buffers laid out per size, so a
graph captured for ``B`` serves any step that pads to ``B``: decode-only,
prefill chunks, prefix hits, or a mix.  Sizes above ``max_graph_tokens`` run
the same padded forward eagerly.

Decode-only steps get graphs of their own.  The mixed graph launches the
attention kernel's prefill class too, whose programs find no work in a
decode step and return, which still cost several µs a layer on the H200
(docs/benchmarks.md).  A decode-only step whose padding fits the sequence
slots pads with one-token sequences instead of one long one, so every query
is a decode query and its graph launches the decode class alone.

Why pad eager steps too: a step's results then never depend on whether a graph
ran it (the same kernels see the same shapes), and the kernels see a bounded
set of shapes, all compiled before the first step instead of during the run.

Why full graphs rather than graphs around an eager attention (vLLM's
piecewise mode): the attention kernel's grid depends on the padded shape
alone (``kernels/triton_attention.py``), so nothing needs to run outside.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import numpy as np
import torch

from moetrace.engine.step_plan import StepPlan
from moetrace.forward_context import AttentionMetadata, forward_context

if TYPE_CHECKING:
    from moetrace.models.base import MoEForCausalLM


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, every 16 up to 256, then 8 sizes per doubling (288, 320, ..., 512, 576, ...).

    Beyond 256 the step between sizes is 1/8 of the octave, so a padded step
    wastes at most 1/8 of its tokens (measured: mixed steps stay memory-bound
    there, so a padding token costs far less than an average one).
    """
    sizes = [b for b in (1, 2, 4, 8) if b < max_tokens]
    sizes += list(range(16, min(256, max_tokens - 1) + 1, 16))
    octave = 256
    while octave < max_tokens:
        step = octave // 8
        sizes += [b for b in range(octave + step, 2 * octave + 1, step) if b < max_tokens]
        octave *= 2
    sizes.append(max_tokens)
    return sizes


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class StepBuffers:
    """Static device inputs for one padded size, as views of the shared buffers.

    int64: ids, positions, slots (``B`` each), logits rows (``S``); int32:
    query starts (``S + 1``), sequence lengths (``S``), the tables' row stride,
    then the block tables at the step's own width.  Each run copies only the
    used prefix of each buffer, in one copy per buffer.  Every view starts on
    a 16-byte boundary, as a tensor of its own would: Triton compiles a variant
    per pointer alignment, and the sizes should all share one.
    """

    def __init__(self, dev_i64: torch.Tensor, dev_i32: torch.Tensor, tokens: int, seqs: int):
        self.tokens, self.seqs = tokens, seqs
        t = _up(tokens, 2)
        self.ids = dev_i64[:tokens]
        self.positions = dev_i64[t : t + tokens]
        self.slots = dev_i64[2 * t : 2 * t + tokens]
        self.rows = dev_i64[3 * t : 3 * t + seqs]
        self.i64 = {"ids": 0, "positions": t, "slots": 2 * t, "rows": 3 * t}
        self.i64_used = 3 * t + seqs
        lens = _up(seqs + 1, 4)
        stride = lens + _up(seqs, 4)
        self.tables_offset = stride + 4
        self.i32 = {"query_start": 0, "seq_lens": lens, "stride": stride}
        self.query_start = dev_i32[: seqs + 1]
        self.seq_lens = dev_i32[lens : lens + seqs]
        self.stride = dev_i32[stride : stride + 1]
        tables = dev_i32[self.tables_offset :]
        self.tables = tables[: tables.numel() // seqs * seqs].view(seqs, -1)

    @staticmethod
    def capacity(tokens: int, seqs: int, width: int) -> tuple[int, int]:
        """(int64, int32) elements the largest size needs."""
        return 3 * _up(tokens, 2) + seqs, _up(seqs + 1, 4) + _up(seqs, 4) + 4 + seqs * width


class StepGraphs:
    def __init__(
        self,
        model: MoEForCausalLM,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        *,
        block_size: int,
        scratch_block: int,
        max_model_len: int,
        max_graph_tokens: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_seqs = max_seqs
        self.sizes = token_buckets(max_tokens)
        self.graph_sizes = [b for b in self.sizes if b <= max_graph_tokens] if use_graphs else []
        dev = device
        bs = block_size
        self.scratch_block = scratch_block
        max_s = self.seqs_for(self.sizes[-1])
        max_width = max(-(-max_model_len // bs), -(-self.sizes[-1] // bs))
        n64, n32 = StepBuffers.capacity(self.sizes[-1], max_s, max_width)
        self.dev_i64 = torch.zeros(n64, dtype=torch.int64, device=dev)
        self.dev_i32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        # Two pinned host copies: one is filled while the other's copy may still be queued.
        # (Off CUDA, for the kernels under Triton's interpreter, plain memory and no events.)
        pin = dev.type == "cuda"
        self.host_i64 = [torch.zeros(n64, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_i32 = [torch.zeros(n32, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.turn = 0
        self.buffers = {
            b: StepBuffers(self.dev_i64, self.dev_i32, b, self.seqs_for(b)) for b in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # Decode-only steps (every query one token, padding included), where they fit.
        self.decode_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.decode_logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def seqs_for(self, tokens: int) -> int:
        """Sequence slots of a padded size: every real sequence, plus the padding one."""
        return min(tokens, self.max_seqs) + 1

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.sizes if b >= num_tokens)

    def _slot_per_token(self, size: int) -> bool:
        """Whether every token of a step at ``size`` can have a sequence slot of its own."""
        return size <= self.buffers[size].seqs

    def pads_per_token(self, plan: StepPlan | None, size: int) -> bool:
        """Whether ``plan`` at ``size`` pads with one-token sequences: a decode-only step
        whose real and padding tokens each fit a sequence slot of their own."""
        return plan is not None and plan.decode_only and self._slot_per_token(size)

    # ------------------------------------------------------------------ inputs
    def _stage(self, plan: StepPlan | None, size: int) -> AttentionMetadata:
        """Write the step (or, with no plan, an all-padding step) into the static buffers."""
        buf = self.buffers[size]
        n = 0 if plan is None else plan.num_tokens
        s = 0 if plan is None else plan.num_seqs
        pad = size - n
        per_token = self.pads_per_token(plan, size)
        bs = self.block_size
        slot = self.turn
        self.turn ^= 1
        event = self.copied[slot]
        if event is not None:
            event.synchronize()  # this host copy's previous transfer has been read
        h64 = self.host_i64[slot].numpy()
        h32 = self.host_i32[slot].numpy()
        width = max(1 if plan is None else plan.block_tables.shape[1], -(-pad // bs))
        rows = 0 if plan is None else len(plan.logits_rows)
        q = buf.seqs
        ids, pos, slots, logit_rows = (buf.i64[k] for k in ("ids", "positions", "slots", "rows"))
        starts, lens, stride = (buf.i32[k] for k in ("query_start", "seq_lens", "stride"))
        if plan is not None:
            h64[ids : ids + n] = plan.input_ids
            h64[pos : pos + n] = plan.positions
            h64[slots : slots + n] = plan.slots
            h64[logit_rows : logit_rows + rows] = plan.logits_rows
            h32[starts : starts + s + 1] = plan.query_start
            h32[lens : lens + s] = plan.seq_lens
        h32[starts] = 0
        h64[ids + n : ids + size] = 0
        h64[pos + n : pos + size] = 0
        h64[slots + n : slots + size] = self.scratch_block * bs + np.arange(pad) % bs
        h64[logit_rows + rows : logit_rows + q] = 0
        if per_token:  # padding token i is sequence s + i, of one token
            h32[starts + s + 1 : starts + s + pad + 1] = np.arange(n + 1, size + 1)
            h32[lens + s : lens + s + pad] = 1
            h32[starts + s + pad + 1 : starts + q + 1] = size
            h32[lens + s + pad : lens + q] = 0
        else:  # one padding sequence (of no tokens when pad is 0) ends the step
            h32[starts + s + 1 : starts + q + 1] = size
            h32[lens + s] = pad
            h32[lens + s + 1 : lens + q] = 0
        h32[stride] = width
        tables = h32[buf.tables_offset : buf.tables_offset + q * width].reshape(q, width)
        if plan is not None:
            tables[:s, : plan.block_tables.shape[1]] = plan.block_tables
            tables[:s, plan.block_tables.shape[1] :] = 0
        tables[s:] = self.scratch_block
        used32 = buf.tables_offset + q * width
        self.dev_i64[: buf.i64_used].copy_(self.host_i64[slot][: buf.i64_used], non_blocking=True)
        self.dev_i32[:used32].copy_(self.host_i32[slot][:used32], non_blocking=True)
        if event is not None:
            event.record()
        q_lens = np.diff(plan.query_start) if plan is not None and s else np.zeros(0, np.int64)
        q_lens = np.append(q_lens, 1 if per_token else pad) if pad else q_lens
        return self._meta(
            size,
            max_query_len=int(q_lens.max()) if q_lens.size else 0,
            min_query_len=int(q_lens.min()) if q_lens.size else 0,
        )

    def _meta(self, size: int, *, max_query_len: int, min_query_len: int) -> AttentionMetadata:
        buf = self.buffers[size]
        return AttentionMetadata(
            slot_mapping=buf.slots,
            query_start_loc=buf.query_start,
            seq_lens=buf.seq_lens,
            block_tables=buf.tables,
            max_query_len=max_query_len,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_start_loc_host=[],
            seq_lens_host=[],
            min_query_len=min_query_len,
            block_table_stride=buf.stride,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of every sequence slot's sampled row: ``[seqs_for(size), vocab]``."""
        buf = self.buffers[size]
        model = self.model
        with forward_context(meta):
            hidden = model(buf.ids, buf.positions)
        return model.compute_logits(hidden[buf.rows])

    # ----------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the graph sizes, largest first so smaller ones share its memory pool
        (each with a decode-only graph beside it where ``pads_per_token`` can hold), and
        compile the kernels of the eager sizes, so no step compiles anything.

        No garbage collection while capturing: an earlier engine's runner
        (a reference cycle) freed mid-capture releases CUDA resources, which a
        capture in progress does not allow.
        """
        gc.collect()
        gc.disable()
        try:
            for size in reversed(self.graph_sizes):
                # Warm up outside the graph: kernels compiled and autotuned first.
                self._forward(size, self._stage(None, size))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                meta = self._meta(size, max_query_len=size, min_query_len=1)
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[size] = self._forward(size, meta)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size] = graph
                if size > 1 and self._slot_per_token(size):  # size 1's graph is decode-only
                    graph = torch.cuda.CUDAGraph()
                    meta = self._meta(size, max_query_len=1, min_query_len=1)
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.decode_logits[size] = self._forward(size, meta)
                    self.decode_graphs[size] = graph
            for size in self.sizes:
                if size not in self.graphs:
                    self._forward(size, self._stage(None, size))
            torch.cuda.synchronize()
        finally:
            gc.enable()

    # --------------------------------------------------------------------- run
    def run_hidden(
        self, plan: StepPlan, fill: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every padded token's hidden state and the sampling rows' indices, from the padded
        forward run eagerly: teacher forcing needs all positions, which no graph keeps."""
        size = self.bucket(plan.num_tokens)
        meta = self._stage(plan, size)
        buf = self.buffers[size]
        if fill is not None:
            buf.ids.index_copy_(0, *fill)
        with forward_context(meta):
            hidden = self.model(buf.ids, buf.positions)
        return hidden, buf.rows[: len(plan.logits_rows)]

    def run(self, plan: StepPlan, fill: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Logits of the plan's sampling rows (``[len(plan.logits_rows), vocab]``)."""
        size = self.bucket(plan.num_tokens)
        meta = self._stage(plan, size)
        if fill is not None:
            self.buffers[size].ids.index_copy_(0, *fill)
        captured = self._captured(size, meta)
        if captured is not None:
            captured[0].replay()
            logits = captured[1]
        else:
            logits = self._forward(size, meta)
        return logits[: len(plan.logits_rows)]

    def _captured(
        self, size: int, meta: AttentionMetadata
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The graph (and its logits) that replays a step staged as ``meta`` at ``size``."""
        if meta.max_query_len <= 1 and size in self.decode_graphs:
            return self.decode_graphs[size], self.decode_logits[size]
        if size in self.graphs:
            return self.graphs[size], self.logits[size]
        return None

    def stage_graph(self, plan: StepPlan, size: int) -> torch.cuda.CUDAGraph | None:
        """Stage ``plan`` at ``size`` and return the graph that would replay it (benchmarks
        replay a step's graph on its own)."""
        captured = self._captured(size, self._stage(plan, size))
        return None if captured is None else captured[0]
