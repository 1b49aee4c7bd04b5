"""The device memory of an idle engine's weights and KV cache, given up for a colocated
trainer and taken back (SGLang's release/resume memory occupation, vLLM's sleep/wake).

Released weights are copied to host memory first (pinned on CUDA), unless the
caller will send new ones anyway (vLLM's sleep level 2): then they are
dropped and their memory holds garbage until an update fills it.  Each
parameter keeps its ``nn.Parameter`` and gets new storage when it comes back,
so the modules, the weight map and the tied embeddings follow; the KV cache is
freed and allocated again at its planned size, empty, with the prefix cache
forgotten.  Both move, so the CUDA graphs that pointed at them are dropped
on release and captured anew once everything is back (a graph replays fixed
addresses, and no allocator here keeps them as SGLang's and vLLM's
virtual-memory allocators do).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moetrace.engine.llm_engine import LLMEngine

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


class MemoryRelease:
    """Releases and resumes one engine's memory by tag; the engine must be idle."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.released: set[str] = set()
        self._params = list(dict.fromkeys(engine.model.parameters()))  # tied ones once
        self._held: list[torch.Tensor | None] = []  # host copies (None: dropped), by parameter
        self._layout: list[tuple[torch.Size, torch.dtype]] = []

    def release(self, tags: Iterable[str], *, keep_weights: bool = True) -> None:
        """Give up the memory of ``tags`` (``weights``, ``kv_cache``); already released ones
        are left as they are."""
        tags = [t for t in tags if t not in self.released]
        if not tags:
            return
        self.engine.drain()
        self.engine.runner.drop_graphs()  # they replay addresses that are about to go
        if KV_CACHE in tags:
            self.engine.block_manager.reset_prefix_cache()
            self.engine.runner.free_kv_cache()
        if WEIGHTS in tags:
            self._release_weights(keep_weights)
        self.released.update(tags)
        _return_cached_memory(self.engine.device)

    def resume(self, tags: Iterable[str]) -> None:
        """Take the memory of ``tags`` back; with everything back, capture the graphs again."""
        tags = [t for t in tags if t in self.released]
        if WEIGHTS in tags:
            self._resume_weights()
        if KV_CACHE in tags:
            self.engine.runner.allocate_kv_cache()
        self.released.difference_update(tags)
        if tags and not self.released:
            self.engine.runner.recapture()

    def _release_weights(self, keep: bool) -> None:
        pin = self.engine.device.type == "cuda"
        self._held, self._layout = [], []
        with torch.no_grad():
            for param in self._params:
                self._layout.append((param.shape, param.dtype))
                held = None
                if keep:
                    held = torch.empty(param.shape, dtype=param.dtype, pin_memory=pin)
                    held.copy_(param.data)
                self._held.append(held)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _resume_weights(self) -> None:
        device = self.engine.device
        with torch.no_grad():
            for param, held, (shape, dtype) in zip(
                self._params, self._held, self._layout, strict=True
            ):
                data = torch.empty(shape, dtype=dtype, device=device)
                if held is not None:
                    data.copy_(held)
                param.data = data
        self._held, self._layout = [], []


def _return_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's freed blocks back to the driver (what a trainer sees)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
