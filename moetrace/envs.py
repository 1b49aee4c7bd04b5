"""Every environment variable moetrace reads for its own settings, in one table.

Each entry has its parser, its default and a line saying what it changes;
`moetrace.envs.get(NAME)` reads it when called (never at import, so a test or
a worker process can set it first).  A bad value is a one-line error naming
the variable.  Variables of other tools (torchrun's ``RANK``, Hugging Face's
``HF_HOME``, Triton's ``TRITON_INTERPRET``) are read where they are used.
docs/contributing.md says how to add one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace.errors import MoetraceError

# Room kept free on the trace's file system: HDF5 must never meet a full disk itself (a
# failed write leaves the file impossible to close), so a run stops while there is room.
DEFAULT_DISK_RESERVE_BYTES = 8 << 20


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]  # raises ValueError on a bad value
    default: Any
    expects: str  # what a value must be, for the error: "a number of ms > 0"
    doc: str


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _choice(*allowed: Any) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        for value in allowed:
            if text == str(value):
                return value
        raise ValueError(text)

    return parse


ENVIRONMENT: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            "MOETRACE_DISK_RESERVE_BYTES",
            _non_negative_int,
            DEFAULT_DISK_RESERVE_BYTES,
            "a whole number of bytes >= 0",
            "free bytes a trace writer keeps on its disk; it stops cleanly (ready for "
            "--resume) rather than let HDF5 meet a full disk",
        ),
        EnvVar(
            "MOETRACE_API_KEY",
            str,
            None,
            "a key",
            "an API key `moetrace serve` accepts besides those of --api-key (vLLM's "
            "VLLM_API_KEY); set, every route but /health needs it",
        ),
        EnvVar(
            "MOETRACE_DIST_TIMEOUT",
            _positive_float,
            1800.0,
            "a number of seconds > 0",
            "seconds a tensor-parallel collective waits (a worker loading a large "
            "checkpoint keeps rank 0 waiting)",
        ),
        EnvVar(
            "MOETRACE_SERVE_SWITCH_INTERVAL_MS",
            _positive_float,
            0.2,
            "a number of ms > 0",
            "Python's thread switch interval while serving: how long the engine thread may "
            "wait for the GIL the HTTP side holds (Python's default is 5 ms)",
        ),
        # Kernel variants kept for the GPU's verdict (docs/benchmarks.md, "Open
        # measurements"); each leaves with its switch once timed.
        EnvVar(
            "MOETRACE_MXFP4_LAYOUT",
            _choice("fragment", "checkpoint"),
            "fragment",
            "fragment or checkpoint",
            "how MXFP4 experts are kept on the device: re-laid-out for the GEMMs' fragments, "
            "or as the checkpoint stores them",
        ),
        EnvVar(
            "MOETRACE_SINK_DECODE_PACK",
            _choice(1, 2),
            1,
            "1 or 2",
            "KV heads one decode program with attention sinks takes (full layers)",
        ),
        EnvVar(
            "MOETRACE_SINK_KEEP_EXPS",
            _flag,
            False,
            "0 or 1",
            "keep the sinks' exponentials in the float32 scores pool between its loops",
        ),
        EnvVar(
            "MOETRACE_SINK_RECIPROCAL",
            _flag,
            True,
            "0 or 1",
            "the sinks' softmax by each row's reciprocal and one correction (1) or by division",
        ),
        EnvVar(
            "MOETRACE_SINK_WINDOW_MAXNREG",
            _non_negative_int,
            0,
            "a whole number of registers >= 0",
            "a register cap for the window layers' one decode tile with sinks (0: none)",
        ),
        EnvVar(
            "MOETRACE_SERVE_TIMELINE",
            Path,
            None,
            "a file path",
            "a JSON file the server writes its step timeline to when it stops "
            "(benchmarks/serve.py reads it); unset, nothing is recorded",
        ),
    )
}


def get(name: str) -> Any:
    """The variable's value now, parsed; its default when unset or empty."""
    var = ENVIRONMENT[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        raise MoetraceError(f"{name} must be {var.expects}, got {text!r}") from None
