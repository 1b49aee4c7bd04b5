"""Where the Triton kernel tests run: on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not HAS_CUDA
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# A test module's ``pytestmark``: counted with the GPU tests, skipped where no kernel can run.
KERNEL_TEST_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)"),
]
