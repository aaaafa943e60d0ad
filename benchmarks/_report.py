"""What every benchmark section returns, and how it is printed."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Target:
    """One target: a measured figure, the bound, and whether it holds."""

    figure: str
    value: float
    bound: str
    met: bool
    note: str = ""


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    """The result of one benchmark section."""

    name: str
    title: str
    method: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Section:
        data = json.loads(text)
        data["tables"] = [Table(**t) for t in data["tables"]]
        data["targets"] = [Target(**t) for t in data["targets"]]
        return Section(**data)


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1e-3 else f"{value:.3f}"
    return str(value)


def markdown_table(table: Table) -> str:
    lines = [f"**{table.title}**", ""] if table.title else []
    lines.append("| " + " | ".join(table.columns) + " |")
    lines.append("|" + "|".join("---" for _ in table.columns) + "|")
    for row in table.rows:
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    return "\n".join(lines)


def targets_table(targets: list[Target]) -> Table:
    return Table(
        "",
        ["figure", "value", "target", "met", "note"],
        [
            [t.figure, t.value, t.bound, "**met**" if t.met else "**NOT met**", t.note]
            for t in targets
        ],
    )


def section_markdown(section: Section, level: int = 2) -> str:
    parts = [f"{'#' * level} {section.title}", "", section.method.strip(), ""]
    for table in section.tables:
        parts += [markdown_table(table), ""]
    if section.targets:
        parts += [markdown_table(targets_table(section.targets)), ""]
    for note in section.notes:
        parts += [note.strip(), ""]
    return "\n".join(parts)


def main(run: Any) -> None:
    """`python -m benchmarks.<section> [--quick] [--json]`: runs one section."""
    quick = "--quick" in sys.argv
    section = run(quick=quick)
    if "--json" in sys.argv:
        print(section.to_json())
    else:
        print(section_markdown(section))
