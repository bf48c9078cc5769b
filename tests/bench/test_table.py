"""vflow/bench/table.py: one formatter for every table vflow prints."""

from __future__ import annotations

import pytest

from vflow.bench.table import format_table, is_number


@pytest.mark.parametrize(
    "cell", ["1", "-0.5", "1,234", "1.2e-06", "95%", "1.50x", "12.1-13.4", "0.25s", " 7 "]
)
def test_numbers(cell: str) -> None:
    assert is_number(cell)


@pytest.mark.parametrize("cell", ["", "-", "n/a", "met", "1.0 (IQR 0.1)", "<= 1.05", "v1.2"])
def test_not_numbers(cell: str) -> None:
    assert not is_number(cell)


def test_number_columns_right_text_columns_left() -> None:
    table = format_table(
        ["name", "ms", "note", "share"],
        [["a", "1.5", "ok", "95%"], ["longer", "12.25", "n/a", "-"], ["b", "-", "x", "5%"]],
    )
    assert table.splitlines() == [
        "name       ms  note  share",
        "------  -----  ----  -----",
        "a         1.5  ok      95%",
        "longer  12.25  n/a       -",
        "b           -  x        5%",
    ]


def test_the_first_column_names_the_row_even_when_numeric() -> None:
    lines = format_table(["V", "ms"], [["1", "2.0"], ["16", "3.0"]]).splitlines()
    assert lines[2:] == ["1   2.0", "16  3.0"]


def test_explicit_alignment_and_no_trailing_spaces() -> None:
    lines = format_table(["a", "b"], [["x", ""], ["yy", "z"]], align="rl").splitlines()
    assert lines == [" a  b", "--  -", " x", "yy  z"]


@pytest.mark.parametrize(
    ("headers", "rows", "align", "message"),
    [
        (["a", "b"], [["1"]], None, "row 0 has 1 cells but there are 2 headers"),
        (["a", "b"], [["1", "2"]], "l", "one letter 'l' or 'r' per column"),
        (["a", "b"], [["1", "2"]], "lc", "one letter 'l' or 'r' per column"),
    ],
)
def test_bad_input_is_named(
    headers: list[str], rows: list[list[str]], align: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        format_table(headers, rows, align)
