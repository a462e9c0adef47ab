"""Tables that fit the terminal, and the ``-o`` output formats (as kubectl's).

A column has a priority: when the rows do not fit the terminal's width, the
least important columns are left out (``--wide`` / ``-o wide`` keeps them
all), and the ones kept never cut a cell: a state, a number or a time is
shown whole, on one line; free text wraps. Only when the columns that are
always shown still do not fit is the one with the longest cells (a job's or a
node's name) shortened in its middle with "…", so that its end (the id's
unique suffix) stays and every border stays on the screen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import typer
from rich.console import Console
from rich.table import Table

FORMATS = ("table", "wide", "json", "yaml")

#: the ``-o`` option of the listing commands
OutputOpt = typer.Option("table", "-o", "--output", help="table (fits the terminal), wide (every column), "
                                                           "json or yaml.")


@dataclass(frozen=True)
class Col:
    """A column: its header, how important it is (0 = always shown; higher
    is dropped first) and whether its cells may wrap (free text) or must be
    shown whole (ids, numbers, times)."""

    header: str
    priority: int = 0
    wrap: bool = False
    justify: str = "left"


#: a name shortened to fit is never shorter than this (its head, "…" and its tail)
MIN_NAME = 16


def _width(header: str, cells: Sequence[str]) -> int:
    return max([len(header), *(len(c) for c in cells)]) + 3  # padding and the border


def middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its head, "…" and its tail."""
    if len(text) <= width:
        return text
    tail = (width - 1) // 2
    return text[:width - 1 - tail] + "…" + text[len(text) - tail:]


def _shorten(cols: Sequence[Col], need: dict[int, int], keep: list[int], width: int) -> dict[int, int]:
    """The columns to shorten and their widths (cells only), so that the
    kept columns fit in ``width``: the widest whole-cell column first, never
    below :data:`MIN_NAME` nor its header."""
    widths: dict[int, int] = {}
    over = sum(need[k] for k in keep) + 1 - width
    for i in sorted((k for k in keep if not cols[k].wrap), key=lambda k: -need[k]):
        if over <= 0:
            break
        floor = max(MIN_NAME, len(cols[i].header))
        cut = min(over, need[i] - 3 - floor)
        if cut > 0:
            widths[i] = need[i] - 3 - cut
            over -= cut
    return widths


def fit(title: str, cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int, wide: bool = False,
        hint: str = "-o wide") -> Table:
    """A table of ``rows`` with the columns that fit in ``width`` characters
    (all of them if ``wide``); the title says how many were left out."""
    keep = list(range(len(cols)))
    short: dict[int, int] = {}
    if not wide:
        need = {i: _width(c.header, [r[i] for r in rows]) if not c.wrap else len(c.header) + 3
                for i, c in enumerate(cols)}
        for i in sorted(keep, key=lambda i: (-cols[i].priority, -i)):
            if sum(need[k] for k in keep) + 1 <= width or cols[i].priority == 0:
                continue
            keep.remove(i)
        short = _shorten(cols, need, keep, width)
        rows = [[middle(c, short[i]) if i in short else c for i, c in enumerate(r)] for r in rows]
    dropped = len(cols) - len(keep)
    t = Table(title=title + (f" ({dropped} more columns with {hint})" if dropped else ""))
    for i in keep:
        c = cols[i]
        if c.wrap:
            t.add_column(c.header, justify=c.justify, overflow="fold")  # type: ignore[arg-type]
        else:
            t.add_column(c.header, justify=c.justify, no_wrap=True,  # type: ignore[arg-type]
                         min_width=max([len(c.header), *(len(r[i]) for r in rows)]))
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    return t


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise typer.BadParameter(f"{fmt!r}: choose one of {', '.join(FORMATS)}", param_hint="-o")
    return fmt


def emit(console: Console, fmt: str, data: Any, table: Any) -> None:
    """Print ``data`` as JSON or YAML, or ``table()`` (a callable taking
    ``wide``) as a table."""
    fmt = check_format(fmt)
    if fmt == "json":
        print(json.dumps(data, indent=2))
    elif fmt == "yaml":
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
    elif fmt == "wide":
        wide_console(console).print(table(True))
    else:
        console.print(table(False))


def wide_console(console: Console) -> Console:
    """A console as wide as a wide table needs (lines longer than the terminal, as ``kubectl -o wide``)."""
    return Console(width=max(console.width, 1000), file=console.file, force_terminal=console.is_terminal)


class LineConsole(Console):
    """A console for messages and info lines: they wrap between words at the
    terminal's width, and a word longer than a line (a path) is printed whole
    rather than cut in two."""

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        kwargs.setdefault("overflow", "ignore")
        kwargs.setdefault("crop", False)
        super().print(*objects, **kwargs)
