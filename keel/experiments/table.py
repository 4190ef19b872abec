"""Markdown tables as data: a header and rows of cells, rendered by :func:`markdown_table`, the one
writer of the tables in the study report, the claims' sections and the presets' summaries."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table_row(cells: Iterable[object]) -> str:
    """One markdown table line: ``| a | b |`` (each cell as ``str``; a cell's own ``|`` is not escaped)."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: the header ``head``, the separator (``|---|`` per column) and one
    line per row of ``rows`` (:func:`table_row`)."""
    return [table_row(head), "|" + "---|" * len(head)] + [table_row(r) for r in rows]
