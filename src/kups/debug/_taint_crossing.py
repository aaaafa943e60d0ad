"""What crosses into a call's body (a `jit`, a custom derivative, a `cond`
branch) beside each origin, and back out: the value's `_Pieces` and its rows
(`_taint_rows`). Both ride in the context's `_IO` as pytree nodes."""

from __future__ import annotations

from typing import Any

import jax

from ._taint_pieces import _Pieces
from ._taint_rows import _Rows


class _Pieced:
    """A value's origin and its `_Pieces`, as they cross into a call's body (a
    `jit`: `jnp.flip` is one) and back out of it."""

    def __init__(self, origin: Any, pieces: _Pieces) -> None:
        self.origin = origin
        self.pieces = pieces


jax.tree_util.register_pytree_node(
    _Pieced,
    lambda p: ((p.origin, p.pieces.origins), (p.pieces.axis, p.pieces.bounds)),
    lambda aux, children: _Pieced(children[0], _Pieces(aux[0], aux[1], tuple(children[1]))),
)


def with_pieces(origins: list[Any], pieces: list[_Pieces | None]) -> tuple[Any, ...]:
    """`origins`, each with its value's pieces if it has some."""
    return tuple(o if p is None else _Pieced(o, p) for o, p in zip(origins, pieces, strict=True))


def without_pieces(entries: Any) -> tuple[list[Any], list[_Pieces | None]]:
    """The origins and the pieces of what `with_pieces` made."""
    origins = [e.origin if isinstance(e, _Pieced) else e for e in entries]
    pieces = [e.pieces if isinstance(e, _Pieced) else None for e in entries]
    return origins, pieces


class _Rowed:
    """An entry of a call's `_IO` (an origin, maybe with pieces) with the rows of
    its value, as they cross into a call's body and back out of it."""

    def __init__(self, entry: Any, rows: _Rows) -> None:
        self.entry = entry
        self.rows = rows


jax.tree_util.register_pytree_node(
    _Rowed, lambda r: ((r.entry, r.rows), None), lambda _, children: _Rowed(*children)
)


def with_rows(entries: Any, rows: list[Any]) -> tuple[Any, ...]:
    """`entries`, each with its value's rows if it has some."""
    return tuple(e if r is None else _Rowed(e, r) for e, r in zip(entries, rows, strict=True))


def without_rows(entries: Any) -> tuple[list[Any], list[Any]]:
    """The entries and the rows of what `with_rows` made."""
    rows = [e.rows if isinstance(e, _Rowed) else None for e in entries]
    return [e.entry if isinstance(e, _Rowed) else e for e in entries], rows
