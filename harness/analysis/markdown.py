"""Markdown pieces the report's sections share: a table, a percentage."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def pct(x: float | None) -> str:
    return "none" if x is None else f"{x:.1%}"
