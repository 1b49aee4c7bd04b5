"""Shared by the reliability tests: a tiny checkpoint, CLI runners, trace comparison."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from moetrace import open_trace
from support.engine import tiny_qwen3_config

REPO = Path(__file__).resolve().parents[2]
# One intra-op thread: tiny models on a shared 2-core machine run 100x faster so.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
VOCAB = tiny_qwen3_config()["vocab_size"]


def tiny_checkpoint(directory: Path, **overrides) -> Path:
    """A checkpoint directory with only config.json: record it with ``--load-format dummy``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_qwen3_config(**overrides)))
    return directory


def tiny_tensors() -> dict:
    """Random weights of every tensor the tiny checkpoint's model needs."""
    import torch

    from moetrace.models.loader import instantiate

    model = instantiate(tiny_qwen3_config(), "x", torch.float32, torch.device("cpu"))
    return {
        name: torch.randn(model.weights.destination(name).shape) * 0.3
        for name in model.expected_weight_names()
    }


def safetensors_checkpoint(directory: Path, tensors: dict) -> Path:
    """The tiny checkpoint with ``tensors`` as its ``model.safetensors``."""
    from safetensors.torch import save_file

    tiny_checkpoint(directory)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def token_prompts(count: int, seed: int = 0, max_len: int = 20) -> list[dict]:
    """Prompt lines with explicit token ids (the tiny checkpoint has no tokenizer)."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(0, VOCAB, size=12).tolist()
    lines = []
    for i in range(count):
        tail = rng.integers(0, VOCAB, size=int(rng.integers(1, max_len))).tolist()
        lines.append({"id": f"q{i}", "prompt_token_ids": (stem if i % 3 else []) + tail})
    return lines


def reference_run(
    directory: Path, count: int, *, seed: int, max_tokens: int, max_len: int = 20
) -> tuple[Path, Path, Path]:
    """(tiny checkpoint, prompt file, uninterrupted reference trace) for a test module."""
    model = tiny_checkpoint(directory / "tiny")
    prompts = write_jsonl(directory / "p.jsonl", token_prompts(count, seed=seed, max_len=max_len))
    reference = directory / "reference.h5"
    code, _, err = run_cli(*record_args(model, prompts, reference, "--max-tokens", str(max_tokens)))
    assert code == 0, err
    return model, prompts, reference


def record_args(model: Path, prompts: Path | str, out: Path, *extra: str) -> list[str]:
    return ["record", str(model), str(prompts), "-o", str(out), "-q", "--load-format", "dummy"] + [
        *extra
    ]


def run_cli(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    """``moetrace ARGS`` in this process: exit code, stdout, stderr (no torch import per call)."""
    from moetrace.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["moetrace", *args]
    old_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv, sys.stdin = argv, old_stdin
    return code, out.getvalue(), err.getvalue()


def run_proc(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetrace", *args],
        capture_output=True,
        text=True,
        env=ENV if env is None else env,
        timeout=120,
        **kwargs,
    )


def popen(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moetrace", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        **kwargs,
    )


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    text = err.strip()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, text


def requests_by_id(path: Path) -> dict[str, tuple]:
    """id -> (token ids, routing rows, finish reason): what must equal between two runs."""
    with open_trace(path) as trace:
        return {
            r.id: (
                np.concatenate([r.prompt_token_ids, r.output_token_ids]),
                np.asarray(r.routed_experts),
                r.finish_reason,
            )
            for r in trace
        }


def assert_same_requests(got: Path, want: Path) -> int:
    """Every request of ``want`` is in ``got`` with the same tokens and rows; returns the count."""
    a, b = requests_by_id(got), requests_by_id(want)
    assert sorted(a) == sorted(b)
    for rid, (tokens, rows, reason) in b.items():
        np.testing.assert_array_equal(a[rid][0], tokens, err_msg=rid)
        np.testing.assert_array_equal(a[rid][1], rows, err_msg=rid)
        assert a[rid][2] == reason, rid
    return len(b)
