"""Engine settings, named as vLLM names them so users know them already."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    capture_routing: bool = True
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
                self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                f"--block-size must be a power of two, got {self.block_size}",
            ),
            (
                self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}",
            ),
            (self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, got {self.max_num_seqs}"),
            (
                self.max_num_batched_tokens >= 1,
                f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}",
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
        ]
        for ok, message in checks:
            if not ok:
                raise MoetraceError(message)

    def to_dict(self) -> dict:
        return asdict(self)
