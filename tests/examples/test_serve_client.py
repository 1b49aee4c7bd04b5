"""examples/serve_client.py on its own: how tensors are bucketed, and a server that cannot start.

The routes and both weight pushes run against a live server in
test_r3_loop.py; these are the parts that loop never exercises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import serve_client  # noqa: E402  (a script's sibling module, not a package)


def test_buckets_keep_the_order_and_close_before_passing_the_limit():
    sizes = [40, 40, 40, 200, 8, 8]  # bytes (uint8 tensors)
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    got = [[name for name, _ in b] for b in serve_client.buckets(named, 100)]
    assert got == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]  # a tensor past the limit alone


def test_a_server_that_cannot_start_says_why_in_one_line(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(serve_client.ServerError) as refused:
        serve_client.Server(None, str(missing), ["--device", "cpu"], None)
    message = str(refused.value)
    assert "\n" not in message
    assert "did not start" in message and str(missing) in message
