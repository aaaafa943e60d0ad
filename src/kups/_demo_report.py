"""How the demo that `python -m kups` runs prints: headings, wrapped text,
tables and the `[ok]` / `[FAIL]` lines of its verifications, tallied."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence


class Report:
    """Prints the demo and tallies its verifications."""

    def __init__(self, color: bool):
        self.color = color
        self.passed = 0
        self.failed: list[str] = []

    def style(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def heading(self, text: str) -> None:
        print()
        print(self.style(text, "1"))
        print(self.style("-" * len(text), "1"))

    def text(self, text: str = "") -> None:
        print(text)

    def para(self, text: str, indent: str = "", dim: bool = False) -> None:
        """Prints `text` wrapped to 88 columns."""
        text = textwrap.fill(text, 88, initial_indent=indent, subsequent_indent=indent)
        print(self.dim(text) if dim else text)

    def dim(self, text: str) -> str:
        return self.style(text, "2")

    def verify(self, ok: bool, claim: str, detail: str = "") -> None:
        """Prints `[ok] claim` or `[FAIL] claim: detail` and tallies it."""
        if ok:
            self.passed += 1
            print(f"  {self.style('[ok]', '32')} {claim}")
        else:
            self.failed.append(claim)
            print(f"  {self.style('[FAIL]', '31;1')} {claim}" + (f": {detail}" if detail else ""))


def table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return indent + "  ".join(cells).rstrip()

    rule = indent + "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])
