"""Option checks a run makes before it imports torch and the engine.

Importing them takes seconds (2 on an idle machine, up to 18 on a loaded
one), and ``--top-p 2``, ``--device gpu`` or an output that exists waited
that long for their one line.  These checks say the same as the ones made
where the values are used, only first; those stay the rule.
"""

from __future__ import annotations

from pathlib import Path

from moetrace.errors import MoetraceError
from moetrace.output_files import check_new_output

DEVICES = ("auto", "cuda", "cpu")  # what runs/setup.resolve_device takes
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")  # models/loader.DTYPES and auto


def check_before_loading(
    *,
    device: str,
    dtype: str,
    output: Path | None = None,
    overwrite: bool = False,
    resume: bool | None = None,
) -> None:
    """Refuse a device or dtype name no run takes, and an output it may not write.

    ``resume``: whether ``--resume`` was given, None for a command without it.
    """
    if device not in DEVICES:
        raise MoetraceError(f"unknown device {device!r}; choose auto, cuda or cpu")
    if dtype not in DTYPES:
        raise MoetraceError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)}")
    if output is not None:
        if resume and overwrite:
            raise MoetraceError("--resume and --overwrite exclude each other")
        check_new_output(output, overwrite=overwrite or bool(resume), resume=resume is not None)
