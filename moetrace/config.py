"""Engine settings, named as vLLM names them so users know them already."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Positions, slots and block ids live in int32 arrays (and CUDA kernels index with them).
INT32_MAX = 2**31 - 1
MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block; vLLM offers up to 256


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    capture_routing: bool = True
    capture_weights: str | None = None  # "float16"/"float32": gate weights beside the ids
    force_routing: bool = False  # scoring requests may route through given experts (replay)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0  # KV budget when running on the CPU
    seed: int = 0
    enforce_eager: bool = False  # CUDA: no CUDA graphs (steps still run at padded sizes)
    max_cudagraph_capture_size: int = 2048  # CUDA: steps up to this many tokens replay graphs
    use_kernels: bool = True  # CUDA: Triton attention and fused MoE (False: plain torch)
    capture_ring_size: int = 2  # pinned host slots for routing rows in flight
    async_scheduling: bool | None = None  # None: on for CUDA (schedule step N+1 while N runs)

    def validate(self) -> None:
        from moetrace.errors import MoetraceError

        checks = [
            (
                1 <= self.block_size <= MAX_BLOCK_SIZE
                and self.block_size & (self.block_size - 1) == 0,
                f"--block-size must be a power of two up to {MAX_BLOCK_SIZE}, got {self.block_size}",
            ),
            (
                self.num_kv_blocks is None or 1 <= self.num_kv_blocks <= INT32_MAX,
                f"--num-kv-blocks must be in 1..{INT32_MAX}, got {self.num_kv_blocks}",
            ),
            (
                self.num_kv_blocks is None or self.num_kv_blocks * self.block_size <= INT32_MAX,
                f"--num-kv-blocks {self.num_kv_blocks} of {self.block_size} tokens: more than "
                f"{INT32_MAX} KV slots",
            ),
            (
                1 <= self.max_num_seqs <= INT32_MAX,
                f"--max-num-seqs must be in 1..{INT32_MAX}, got {self.max_num_seqs}",
            ),
            (
                1 <= self.max_num_batched_tokens <= INT32_MAX,
                f"--max-num-batched-tokens must be in 1..{INT32_MAX}, "
                f"got {self.max_num_batched_tokens}",
            ),
            (
                self.max_model_len is None or 1 <= self.max_model_len <= INT32_MAX,
                f"--max-model-len must be in 1..{INT32_MAX}, got {self.max_model_len}",
            ),
            (
                self.max_cudagraph_capture_size >= 1,
                "--max-cudagraph-capture-size must be at least 1, "
                f"got {self.max_cudagraph_capture_size}",
            ),
            (
                0 < self.gpu_memory_utilization <= 1,
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (
                self.capture_weights in (None, "float16", "float32"),
                f"--weights-dtype must be float16 or float32, got {self.capture_weights!r}",
            ),
            (
                self.capture_weights is None or self.capture_routing,
                "capturing gate weights needs routing capture",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise MoetraceError(message)

    def to_dict(self) -> dict:
        return asdict(self)
