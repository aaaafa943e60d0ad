"""`report="reaching"`: the origin of each row of a scan's stacked outputs.

Iteration `i` of a scan makes row `i` of each `ys`. Its origin is kept in a row
of a carried buffer (`_Rows`: `w` and `info` per row) instead of being merged
into one origin per array, so that a slice of the stacked output (`ys[k:]`,
`ys[-1]`, `ys[idx]`) takes the origins of only the rows it keeps whose part of
the result is not finite. Any other equation on the stacked output uses its
origin, the earliest of the rows'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from ._taint_origin import _FINE, _not_finite, _Origin
from ._taint_pieces import positions, window

# Scans longer than this merge their rows' origins into one as they run (the
# buffers hold `length * (3 + loop depth)` integers per stacked output).
MAX_ROWS = 2**16


class _Rows:
    """The origins of the rows of a stacked output: `w` (int32, one per row) and
    `info` (int32, one vector per row)."""

    def __init__(self, w: Any, info: Any) -> None:
        self.w = w
        self.info = info


jax.tree_util.register_pytree_node(
    _Rows, lambda r: ((r.w, r.info), None), lambda _, children: _Rows(*children)
)


def no_rows(length: int, info_length: int) -> _Rows:
    """The rows of a stacked output before any iteration wrote one: finite."""
    return _Rows(np.full((length,), _FINE), np.zeros((length, info_length), np.int32))


def written(rows: _Rows, index: Any, origin: _Origin) -> _Rows:
    """`rows` with row `index` (the iteration) given `origin`."""
    index = jnp.asarray(index, jnp.int32)
    w = jax.lax.dynamic_update_slice(rows.w, jnp.reshape(origin.w, (1,)), (index,))
    info = jax.lax.dynamic_update_slice(
        rows.info, jnp.reshape(origin.info, (1, -1)), (index, np.int32(0))
    )
    return _Rows(w, info)


def rows_origin(rows: _Rows) -> _Origin:
    """The origin of the whole stacked output: the earliest row's (the first, on
    ties)."""
    first = jnp.argmin(rows.w)
    return _Origin(rows.w[first], rows.info[first], True)


def origin_of_rows(
    eqn: JaxprEqn, invals: list[Any], rows: _Rows, outval: Any, kinds: tuple[str, ...]
) -> Any:
    """The origin a slice or a gather of single rows of a stacked output takes:
    the earliest of the rows it keeps whose part of `outval` is not finite.
    `None` when `eqn` is no such read."""
    span = window(eqn, invals)
    if span is not None:
        start, stop, stride = span[0]
        index = jnp.arange(start, stop, stride, dtype=np.int32)
        axis = 0
    else:
        found = positions(eqn, invals, 0)
        if found is None:
            return None
        axis, index = found
    ndim = np.ndim(outval)
    if axis >= ndim or np.shape(outval)[axis] != np.shape(index)[0]:
        # The row axis was squeezed away (`ys[k]`): one row, kept whole.
        bad = jnp.reshape(jnp.any(_not_finite(outval, kinds)), (1,))
    else:
        others = tuple(a for a in range(ndim) if a != axis)
        bad = jnp.any(_not_finite(outval, kinds), axis=others)
    taken = index >= 0
    safe = jnp.where(taken, index, 0)
    w = jnp.where(bad & taken, rows.w[safe], _FINE)
    first = jnp.argmin(w)
    return _Origin(w[first], rows.info[safe[first]], True)
