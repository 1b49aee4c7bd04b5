"""The ahead-of-time variant list is keyed by the kernels' sources, so an edited kernel
never reuses a list that names the variants of its old compile-time arguments."""

from __future__ import annotations

import shutil
from pathlib import Path

import moetrace.kernels
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
