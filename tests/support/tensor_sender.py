"""A colocated trainer's side of SGLang's ``update_weights_from_tensor``, on the CPU.

Run as a script: loads a checkpoint's tensors, serializes them as SGLang's
``MultiprocessingSerializer`` does (torch's ``ForkingPickler``, base64) with
CPU tensors shared through files (``file_system``), prints the payload on one
line and keeps the tensors alive until a line arrives on standard input.
On a GPU (``device``) the tensors travel as CUDA IPC handles, as a colocated
trainer's do. ``flattened_bucket`` packs them as SGLang's ``FlattenedTensorBucket`` (one
uint8 tensor and a metadata record per tensor, pickled under SGLang's module
name, as a trainer that imports SGLang pickles it).
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__)


class TensorSender:
    """The sender process; ``payload`` is its base64 line."""

    def __init__(
        self,
        checkpoint: Path,
        names: list[str],
        load_format: str = "direct",
        device: str = "cpu",
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(checkpoint), load_format, device, *names],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.payload = self.proc.stdout.readline().strip()
        assert self.payload, self.proc.stderr.read() if self.proc.stderr else ""

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        return self.proc.wait(30)


def _main(checkpoint: str, load_format: str, device: str, names: list[str]) -> None:
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as mp
    import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reducers)
    from safetensors.torch import load_file

    mp.set_sharing_strategy("file_system")
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"), device=device)
    named = [(name, tensors[name]) for name in names]
    if load_format == "flattened_bucket":
        obj = _bucket(named, torch)
    else:
        obj = named
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    print(base64.b64encode(buf.getvalue()).decode(), flush=True)
    sys.stdin.readline()  # the server has read them


def _bucket(named, torch):
    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: object
        dtype: object
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    parts_of_name = module.__name__.split(".")
    for i in range(1, len(parts_of_name)):  # its parent packages, for pickle's import check
        sys.modules.setdefault(".".join(parts_of_name[:i]), types.ModuleType(parts_of_name[i - 1]))
    sys.modules[module.__name__] = module
    parts, metadata, offset = [], [], 0
    for name, tensor in named:
        flat = tensor.contiguous().view(torch.uint8).reshape(-1)
        metadata.append(
            FlattenedTensorMetadata(
                name, tensor.shape, tensor.dtype, offset, offset + flat.numel(), tensor.numel()
            )
        )
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
