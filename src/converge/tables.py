"""Tables of results: the row type and cell formatting shared by ``converge report`` and the apps' sections."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class Table(NamedTuple):
    """One table: a caption, a header and rows of cells."""

    caption: str
    header: Sequence[str]
    rows: Sequence[Sequence[Any]]


def fmt(value: Any) -> str:
    """A cell: 3 significant digits for floats, yes/no for booleans, an en dash for missing values."""
    if value is None:
        return "\u2013"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def percent(value: float | None) -> str:
    """A fraction as a whole percentage, or an en dash for a missing value."""
    return "\u2013" if value is None else f"{100 * value:.0f}%"
