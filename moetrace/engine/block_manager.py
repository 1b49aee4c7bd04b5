"""Paged KV cache bookkeeping: blocks, reference counts and the prefix cache.

A block holds the KV of ``block_size`` consecutive tokens.  Full blocks whose
tokens were all computed are registered under a hash chained over every token
before them, so a later request with the same prefix reuses them instead of
recomputing.  Freed blocks stay findable until they are handed out again
(least recently freed first).

Every fresh allocation bumps the block's ``epoch``.  The routing manager stamps
each stored row with the epoch its block had when the step was scheduled, so a
row left behind by an earlier owner of the block is recognised as stale.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from moetrace.engine.request import Request


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a block given its parent's hash: equal only for equal prefixes."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.epochs = np.zeros(num_blocks, dtype=np.int64)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_key: dict[int, tuple[int, tuple]] = {}  # block -> (hash, Request.cache_key)
        self._cached: dict[int, int] = {}  # hash -> block
        self._hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        # Requests alive when the prefix cache was reset (new weights): their blocks hold KV of
        # the old weights, so none of them is ever registered for reuse.
        self._uncacheable: set[str] = set()

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` must add so that its table covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(request.block_table))

    def _full_block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, request.cache_key(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks that hold the start of ``request``'s tokens.

        The last token is always left to compute, since the step must produce
        its logits; so a hit stops one token short of the request's length
        (or earlier: ``Request.num_cacheable_tokens``).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = max(0, request.num_cacheable_tokens) // bs
        hits: list[int] = []
        for i, h in enumerate(self._full_block_hashes(request, max_blocks)):
            block = self._cached.get(h)
            if block is None:
                break
            key = request.cache_key(i * bs, (i + 1) * bs)
            if self._block_key[block][1] != key:  # hash collision: never trust it
                break
            hits.append(block)
        return hits

    # ----------------------------------------------------------------- changes
    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_key.pop(block, None)
        if key is not None and self._cached.get(key[0]) == block:
            del self._cached[key[0]]
        self.ref_counts[block] = 1
        self.epochs[block] += 1
        return block

    def allocate(self, request: Request, num_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Grow ``request``'s block table to cover ``num_tokens``; False if blocks run out.

        ``cached_prefix`` (from ``find_cached_prefix``) is attached first; those
        blocks are shared, not copied.
        """
        reused_free = sum(1 for b in cached_prefix if self.ref_counts[b] == 0)
        need = self.blocks_needed(request, num_tokens) - len(cached_prefix)
        if need + reused_free > len(self._free):
            return False
        for block in cached_prefix:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            request.block_table.append(block)
        for _ in range(max(0, need)):
            request.block_table.append(self._take_free_block())
        return True

    def register_computed_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Make ``request``'s full blocks among its first ``num_tokens`` findable by later requests.

        ``num_tokens`` counts tokens that are both known and computed (default:
        ``num_computed_tokens``).
        """
        if not self.enable_prefix_caching or request.request_id in self._uncacheable:
            return
        known = request.num_computed_tokens if num_tokens is None else num_tokens
        num_full = known // self.block_size
        bs = self.block_size
        for i, h in enumerate(self._full_block_hashes(request, num_full)):
            block = request.block_table[i]
            if block in self._block_key:
                continue
            self._block_key[block] = (h, request.cache_key(i * bs, (i + 1) * bs))
            self._cached.setdefault(h, block)

    def free(self, request: Request) -> None:
        """Drop ``request``'s hold on its blocks; tail blocks are reused first."""
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
        request.block_table = []

    def forget(self, request: Request) -> None:
        """Drop per-request hash memo once the request is gone for good."""
        self._hashes.pop(request.request_id, None)
        self._uncacheable.discard(request.request_id)

    def reset_prefix_cache(self, live: Iterable[Request] = ()) -> int:
        """Forget every cached block (their KV was computed under other weights); ``live``
        requests keep their blocks but never offer them for reuse.  Returns the entries dropped."""
        dropped = len(self._cached)
        self._cached.clear()
        self._block_key.clear()
        self._uncacheable.update(r.request_id for r in live)
        return dropped

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def check_no_leaks(self) -> None:
        """Every block is free and unreferenced (call when no request is live)."""
        held = np.flatnonzero(self.ref_counts)
        if held.size or len(self._free) != self.num_blocks:
            raise AssertionError(f"KV blocks still held: {held.tolist()[:10]}")
