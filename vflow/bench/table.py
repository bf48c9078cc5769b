"""Plain-text tables for the demo, ``python -m vflow bench`` and the benchmark scripts.

One formatter, so that every table vflow prints lines up the same way: a header, a
rule of dashes, then the rows, columns two spaces apart and padded to their widest
cell. Text columns are left-aligned and number columns right-aligned, so that digits
line up; ``format_table`` tells them apart by their cells unless told.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_table", "is_number"]

# A number as the tables print one: optional sign, digits with thousands commas or a
# decimal point, an exponent, a unit suffix (%, x, s) or a min-max range of two such.
_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?(?:%|x|s)?"
_NUMBER_CELL = re.compile(rf"{_NUMBER}(?:-{_NUMBER})?", re.IGNORECASE)
# Cells that stand for a missing value: they neither make a column text nor a number.
_PLACEHOLDERS = frozenset({"", "-", "n/a", "nan", "inf", "-inf"})


def is_number(cell: str) -> bool:
    """Whether ``cell`` reads as a number ("1,234", "-0.5", "1.2e-06", "95%", "1.50x",
    "12.1-13.4"): such cells are right-aligned."""
    return _NUMBER_CELL.fullmatch(cell.strip()) is not None


def _column_alignment(cells: Sequence[str]) -> str:
    values = [c.strip() for c in cells if c.strip().lower() not in _PLACEHOLDERS]
    return "r" if values and all(is_number(c) for c in values) else "l"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> str:
    """The table as lines of text (no trailing newline or trailing spaces).

    ``align`` has one letter per column, ``l`` (left) or ``r`` (right). Without it the
    first column is left-aligned (it names the row) and every other column is
    right-aligned when all its cells are numbers or placeholders (``-``, ``n/a``,
    blank), left-aligned otherwise. Every row must have one cell per header.
    """
    width = len(headers)
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(
                f"format_table: row {i} has {len(row)} cells but there are {width} headers"
            )
    if align is None:
        align = "l" + "".join(_column_alignment([row[i] for row in rows]) for i in range(1, width))
    elif len(align) != width or set(align) - {"l", "r"}:
        raise ValueError(
            f"format_table: align must be one letter 'l' or 'r' per column ({width}), got {align!r}"
        )
    widths = [max([len(headers[i]), *(len(row[i]) for row in rows)]) for i in range(width)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(w) if a == "r" else cell.ljust(w)
            for cell, w, a in zip(cells, widths, align, strict=True)
        )
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])
