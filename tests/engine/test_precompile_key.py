"""Neither cache a run reads is stale after a change: the ahead-of-time variant list is
keyed by the kernels' sources and every setting that picks variants, so an edited kernel
never reuses a list that names the variants of its old compile-time arguments; and
Triton's own cache files each binary under its kernel's source and its callees'."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moetrace.kernels
from moetrace import envs
from moetrace.config import EngineConfig
from moetrace.engine.precompile import _kernel_sources_digest


def test_an_edited_kernel_changes_the_key(tmp_path: Path) -> None:
    copy = tmp_path / "kernels"
    shutil.copytree(Path(moetrace.kernels.__file__).parent, copy)
    assert _kernel_sources_digest(str(copy)) == _kernel_sources_digest()
    (copy / "notes.txt").write_text("not a kernel")
    assert _kernel_sources_digest(str(copy)) == _kernel_sources_digest()
    attention = copy / "triton_attention.py"
    attention.write_text(attention.read_text() + "\n# a new constexpr elsewhere\n")
    assert _kernel_sources_digest(str(copy)) != _kernel_sources_digest()


def test_a_renamed_kernel_file_changes_the_key(tmp_path: Path) -> None:
    copy = tmp_path / "kernels"
    shutil.copytree(Path(moetrace.kernels.__file__).parent, copy)
    (copy / "triton_norm.py").rename(copy / "triton_norms.py")
    assert _kernel_sources_digest(str(copy)) != _kernel_sources_digest()


def _key(**changes) -> str:
    from moetrace.engine.precompile import variants_key

    settings = {
        "hf_config": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64},
        "dtype": "torch.bfloat16",
        "config": EngineConfig(),
        "max_model_len": 4096,
        "capability": (9, 0),
        **changes,
    }
    return variants_key(**settings)


def test_every_setting_that_picks_variants_changes_the_list_key(monkeypatch) -> None:
    pytest.importorskip("triton")
    for name in [n for n in envs.ENVIRONMENT if n in os.environ]:
        monkeypatch.delenv(name)
    same = _key()
    assert _key() == same
    others = [
        _key(hf_config={"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128}),
        _key(dtype="torch.float16"),
        _key(config=EngineConfig(max_num_batched_tokens=4096)),
        _key(max_model_len=8192),
        _key(capability=(10, 0)),
    ]
    assert same not in others and len(set(others)) == len(others)
    # A kernel switch set in the environment launches other variants: another list.
    monkeypatch.setenv("MOETRACE_SINK_DECODE_PACK", "2")
    assert _key() != same
    monkeypatch.setenv("MOETRACE_SINK_DECODE_PACK", "1")  # its default: the same variants
    assert _key() == same


_CACHE_KEYS = """
import moetrace.kernels.triton_attention as attention, moetrace.kernels.triton_norm as norm
print(attention._paged_attention_kernel.cache_key, norm._rotary_kernel.cache_key)
"""


def _triton_keys(root: Path) -> list[str]:
    """Triton's cache keys of two kernels that call ``triton_rounding`` helpers, in a
    process that imports moetrace from ``root``."""
    done = subprocess.run(
        [sys.executable, "-c", _CACHE_KEYS],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.slow  # two processes that import torch and Triton
def test_tritons_cache_key_follows_an_edited_helper_in_another_module(tmp_path: Path) -> None:
    """Triton files a compiled kernel under a hash of its source and of every jit function
    it calls, across modules: an edit two calls down (``round_to`` calls
    ``round_to_bf16``) gives the kernels that reach it new keys, so a changed kernel never
    loads a binary compiled from its old source."""
    pytest.importorskip("triton")
    from moetrace.kernels import triton_attention, triton_norm

    installed = [
        triton_attention._paged_attention_kernel.cache_key,
        triton_norm._rotary_kernel.cache_key,
    ]
    package = Path(moetrace.kernels.__file__).parents[1]
    shutil.copytree(
        package, tmp_path / "moetrace", ignore=shutil.ignore_patterns("__pycache__", "assets")
    )
    assert _triton_keys(tmp_path) == installed  # the copy's place is not in the key
    rounding = tmp_path / "moetrace" / "kernels" / "triton_rounding.py"
    text = rounding.read_text()
    assert text.count("0x7FFF") == 1
    rounding.write_text(text.replace("0x7FFF", "0x7FFE"))  # round_to_bf16's rounding bias
    edited = _triton_keys(tmp_path)
    assert all(a != b for a, b in zip(edited, installed, strict=True))
