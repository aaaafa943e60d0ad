"""The tables the reports of `kups.instrument` print: text in a terminal, HTML in
a notebook; numbers as text, whether they are Python `int`s, traced values or one
per vmapped element."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

# A section of a table: an optional heading, then rows of cells (the first cell
# is a primitive's name, the others are numbers as text).
Section = tuple[str | None, list[tuple[str, ...]]]


# What stands for a number that has no value here: a tracer, or the shape and
# dtype a `jax.eval_shape` of an instrumented function gives.
_ABSTRACT = (Tracer, jax.ShapeDtypeStruct)


def is_traced(tree: Any) -> bool:
    """Whether any leaf of `tree` is a tracer (the report was made under a
    transformation such as `jax.jit`) or a `jax.eval_shape` result."""
    return any(isinstance(leaf, _ABSTRACT) for leaf in jax.tree.leaves(tree))


def as_int(number: Any) -> int | None:
    """`number` as a Python `int`, or `None` when it is abstract or not a scalar."""
    if isinstance(number, _ABSTRACT) or np.ndim(number) != 0:
        return None
    return int(number)


def format_number(number: Any) -> str:
    """A count or a cost as table text."""
    value = as_int(number)
    if value is not None:
        return str(value)
    if isinstance(number, Tracer):
        return f"traced {jax.typeof(number).str_short()}"
    if isinstance(number, jax.ShapeDtypeStruct):
        return f"abstract {np.dtype(number.dtype).name}{list(number.shape)}"
    # One number per element, as `jax.vmap` of an instrumented function returns them.
    return np.array2string(np.asarray(number))


def text_table(title: str, headers: Sequence[str], sections: Sequence[Section]) -> str:
    """`Title(\\n  table\\n)`: the first column left-aligned, the others right."""
    rows = [row for _, section in sections for row in section]
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, header in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join(
            [f"{first:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))]
        )

    lines = [line(headers), line(["-" * width for width in widths])]
    for heading, section in sections:
        if heading is not None:
            lines.append(heading)
        lines += [line(row) for row in section]
    return f"{title}(\n" + "\n".join("  " + text for text in lines) + "\n)"


def html_table(headers: Sequence[str], sections: Sequence[Section]) -> str:
    """The same table in HTML, for notebooks."""
    body = ""
    for heading, section in sections:
        if heading is not None:
            body += (
                f"<tr><th colspan='{len(headers)}' style='text-align:left'>"
                f"{html.escape(heading)}</th></tr>"
            )
        for first, *rest in section:
            cells = "".join(f"<td style='text-align:right'>{html.escape(c)}</td>" for c in rest)
            body += f"<tr><td><code>{html.escape(first)}</code></td>{cells}</tr>"
    first, *rest = headers
    head = f"<th style='text-align:left'>{html.escape(first)}</th>" + "".join(
        f"<th style='text-align:right'>{html.escape(header)}</th>" for header in rest
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
