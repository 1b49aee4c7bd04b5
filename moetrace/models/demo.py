"""The built-in ``demo`` model: a tiny trained Qwen3-MoE shipped inside the package.

``demo`` is only a name for an ordinary checkpoint directory
(``moetrace/assets/demo``), loaded by the same code as any other, so the demo
exercises the real path and its trace can be checked against transformers.
It was trained by ``tools/train_demo.py`` on the Python standard library's
source and docs (docs/demo-model.md), so its experts have specialised and a
trace of it shows structure.  Layer 0 is dense (``mlp_only_layers``): dense
layers get no routing rows.
"""

from __future__ import annotations

import json
from pathlib import Path

DEMO_NAME = "demo"
DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
# The shipped config.json, for callers that need the demo's shape without loading it.
DEMO_CONFIG: dict = json.loads((DEMO_DIR / "config.json").read_text(encoding="utf-8"))


def model_dir(model: str) -> Path:
    """The checkpoint directory a MODEL argument names (``demo`` is the shipped one)."""
    return DEMO_DIR if model == DEMO_NAME else Path(model).expanduser()
