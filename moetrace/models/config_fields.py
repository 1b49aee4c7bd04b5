"""Config fields whose name differs between checkpoints, read one way everywhere.

Kept free of torch so start-up checks (distributed guards) can use it.
"""

from __future__ import annotations

QWEN_EXPERT_KEYS = ("num_experts", "num_local_experts")  # Hub name first, save_pretrained's alias
MIXTRAL_EXPERT_KEYS = ("num_local_experts", "num_experts")


def num_routed_experts(config: dict, keys: tuple[str, ...] = QWEN_EXPERT_KEYS) -> int:
    """The routed-expert count from the first of ``keys`` the config has (0 if none or null)."""
    for key in keys:
        if key in config:
            return int(config[key] or 0)
    return 0
