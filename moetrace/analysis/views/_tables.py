"""Formatting shared by the views' renderers: rich tables and number cells."""

from __future__ import annotations

from rich import box
from rich.table import Table


def table(title: str) -> Table:
    """Tables without vertical rules: ten numeric columns still fit 80 characters."""
    return Table(title=title, box=box.SIMPLE_HEAVY)


def id_table(
    title: str,
    width: int,
    columns: list[tuple[str, str]],
    rows: list[tuple[str, list[str]]],
) -> Table:
    """A table of requests, ``(id, cells)`` per row, whose ids are never cut.

    Served ids share their first characters (``cmpl-...``), so an id cut short
    hides which request a row is: the id column gets the width the figures
    leave of ``width`` (at least 8), and a longer id folds onto more lines.
    ``columns``: each other column's header and justification.
    """
    natural = [
        max([len(w) for w in header.split()] + [len(cells[i]) for _, cells in rows])
        for i, (header, _) in enumerate(columns)
    ]
    # Padding collapsed: every column takes its width and two spaces, the edges one more.
    left = width - sum(n + 2 for n in natural) - 4
    longest = max((len(rid) for rid, _ in rows), default=2)
    t = table(title)
    t.collapse_padding = True
    shown = max(2, min(longest, max(8, left)))
    # (rich counts the first column's collapsed edge padding in its width)
    t.add_column("id", justify="left", overflow="fold", width=shown + 1)
    for (header, justify), n in zip(columns, natural, strict=True):
        t.add_column(header, justify=justify, width=n)  # a header of two words may wrap
    for rid, cells in rows:
        t.add_row(rid, *cells)
    return t


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
