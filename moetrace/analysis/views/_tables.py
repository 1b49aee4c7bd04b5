"""Formatting shared by the views' renderers: rich tables and number cells."""

from __future__ import annotations

from rich import box
from rich.table import Table


def table(title: str) -> Table:
    """Tables without vertical rules: ten numeric columns still fit 80 characters."""
    return Table(title=title, box=box.SIMPLE_HEAVY)


def num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def pct(x, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def pairs_text(pairs: list[dict], arrow: str) -> str:
    """Expert pairs as ``a+b (count, xlift)``."""
    return (
        ", ".join(f"{p['a']}{arrow}{p['b']} ({p['count']:,}, x{p['lift']:.1f})" for p in pairs)
        or "-"
    )


def token_label(token: int, text: str | None) -> str:
    return f"{token}" if text is None else f"{token} '{text}'"
