"""``--help`` that never cuts an option's name, at any width, in a terminal or a pipe.

typer's rich help lays options out as a table whose name column shrinks to
fit 80 columns: ``--enable-return-routed-experts`` printed as
``--enable-return…``, and every flag got a ``<bool>``.  This is click's plain
layout instead: a name longer than its column puts its help on the next line,
flags show as flags, and a value shows as click shows it (``INTEGER``,
``PATH``, ``SHARD...`` for an argument of many values, ``[a|b]`` for a
choice).
Options are grouped under their ``rich_help_panel``, where one is set.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, get_args

from typer._click import Context, HelpFormatter
from typer._click.formatting import join_options
from typer.core import TyperArgument, TyperCommand, TyperOption

OPTIONS = "Options"
_TYPE_NAMES = {int: "INTEGER", float: "FLOAT", str: "TEXT", Path: "PATH", bool: "BOOLEAN"}


def value_metavar(param: TyperArgument | TyperOption) -> str:
    """What stands for the value: the declared metavar, else click's name for its type."""
    desc = param.type_descriptor
    if param.metavar:
        shown = param.metavar
    elif desc.is_choice and desc.choices:
        shown = "[" + "|".join(str(getattr(c, "value", c)) for c in desc.choices) + "]"
    elif desc.is_path:
        shown = "PATH"
    else:
        kind: Any = desc.annotation
        if desc.is_list and get_args(kind):
            kind = get_args(kind)[0]
        shown = _TYPE_NAMES.get(kind, getattr(kind, "__name__", str(kind)).upper())
    # Many values after one name (an argument's); a repeatable option says so in its help.
    repeats = param.nargs != 1
    return shown + "..." if repeats and not shown.endswith("...") else shown


def _term(param: TyperArgument | TyperOption) -> str:
    if isinstance(param, TyperArgument):
        return value_metavar(param) if param.metavar else (param.name or "").upper()

    def spelled(names: list[str]) -> str:
        text, _ = join_options(names)
        return text if param.is_flag or param.count else f"{text} {value_metavar(param)}"

    terms = [spelled(param.opts)]
    if param.secondary_opts:
        terms.append(spelled(param.secondary_opts))
    return " / ".join(terms)


def keep_examples(text: str | None) -> str | None:
    """The docstring with its ``Example...`` lines as written: click rewraps a paragraph,
    which joined an example to the sentence before it and broke commands mid-line."""
    if not text:
        return text
    out: list[str] = []
    for line in inspect.cleandoc(text).splitlines():
        if line.startswith("Example"):
            if out and out[-1].strip():
                out.append("")
            out.append("\b")  # click: the paragraph that follows is not rewrapped
        out.append(line)
    return "\n".join(out)


class HelpCommand(TyperCommand):
    """A typer command whose ``--help`` uses the layout in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = keep_examples(self.help)

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        arguments: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:  # hidden
                continue
            row = (_term(param), record[1])
            if isinstance(param, TyperArgument):
                arguments.append(row)
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or OPTIONS, []).append(
                    row
                )
        sections = [("Arguments", arguments), *panels.items()]
        for title, rows in sections:
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
