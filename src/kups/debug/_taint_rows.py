"""`report="reaching"`: the origin of each row of a scan's stacked outputs and
of the buffers loops write row by row.

Iteration `i` of a scan makes row `i` of each `ys`. Its origin is kept in a row
of a carried buffer (`_Rows`: `w` and `info` per row) instead of being merged
into one origin per array, so that a slice of the stacked output (`ys[k:]`,
`ys[-1]`, `ys[idx]`) takes the origins of only the rows it keeps whose part of
the result is not finite. Any other equation on the stacked output uses its
origin, the earliest of the rows'.

A loop carry that the body only overwrites by whole rows (`carried_rows`, read
from the body's jaxpr before it runs) carries `_Rows` the same way: each write
gives the rows it covers the update's origin (`rows_made`), and the rows cross
`jit` and custom-derivative calls in the context (`with_rows`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import JaxprEqn, Literal

from ._meshes import for_mesh_of, mesh_of, on_mesh
from ._sites import scan_layout, widening_cast
from ._taint_origin import _FINE, _not_finite, _Origin, _shape
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


def no_rows(length: int, info_length: int, eqn: JaxprEqn) -> _Rows:
    """The rows of a stacked output of `eqn` before any iteration wrote one:
    finite.

    On a mesh (`jax.set_mesh`, or the one `eqn`'s values are typed for), typed
    for it, as the origins written into them are (a NumPy array is typed for no
    mesh, and `dynamic_update_slice` wants both typed alike)."""
    mesh = mesh_of(v.aval for v in (*eqn.outvars, *eqn.invars) if not isinstance(v, Literal))
    if mesh is None:
        return _Rows(np.full((length,), _FINE), np.zeros((length, info_length), np.int32))
    w = jnp.full((length,), _FINE, jnp.int32)
    return on_mesh(_Rows(w, jnp.zeros((length, info_length), jnp.int32)), mesh)


def written(rows: _Rows, index: Any, origin: _Origin) -> _Rows:
    """`rows` with row `index` (the iteration) given `origin`."""
    index = jnp.asarray(index, jnp.int32)
    w = for_mesh_of(jnp.reshape(origin.w, (1,)), rows.w)
    info = for_mesh_of(jnp.reshape(origin.info, (1, -1)), rows.info)
    w = jax.lax.dynamic_update_slice(rows.w, w, (index,))
    info = jax.lax.dynamic_update_slice(rows.info, info, (index, np.int32(0)))
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


# Equations a row-written buffer passes through unchanged, row for row (a
# `convert_element_type` only to a float type that holds every value: a
# narrowing one may make an Inf).
_PASSED = frozenset({"copy", "copy_p", "convert_element_type"})


def _passes(eqn: JaxprEqn) -> bool:
    if eqn.primitive.name not in _PASSED or len(eqn.invars) != 1:
        return False
    return eqn.primitive.name != "convert_element_type" or widening_cast(eqn)


# Selections between whole buffers by one predicate: (predicate, cases) with
# `lax.select_n`'s order of cases (equinox's `select_if_vmap(p, x, y)` is `x`
# where `p`).
_SELECTS = frozenset({"select_n", "select_if_vmap"})


def _written_window(eqn: JaxprEqn, shape: tuple[int, ...]) -> tuple[Any, int, bool] | None:
    """For an overwrite of whole rows of a buffer of `shape` (`dynamic_update_slice`,
    a one-window `scatter`, equinox's `maybe_set` at one index): the position of
    its start index among the inputs (a scalar), the number of rows written, and
    whether an update out of range is dropped (else its start is clamped)."""
    name = eqn.primitive.name
    if name == "dynamic_update_slice":
        update = _shape(eqn.invars[1])
        if tuple(update[1:]) != shape[1:]:
            return None
        return 2, update[0], False
    if name == "scatter":
        numbers = eqn.params["dimension_numbers"]
        update = _shape(eqn.invars[2])
        if (
            numbers.operand_batching_dims
            or tuple(numbers.scatter_dims_to_operand_dims) != (0,)
            or int(np.prod(_shape(eqn.invars[1]))) != 1
        ):
            return None
        inserted = tuple(numbers.inserted_window_dims)
        window = [1] if inserted == (0,) else [] if inserted == () else None
        if window is None:
            return None
        window.extend(update[d] for d in numbers.update_window_dims)
        if len(window) != len(shape) or tuple(window[1:]) != shape[1:]:
            return None
        return 1, window[0], str(eqn.params["mode"]).endswith("FILL_OR_DROP")
    if name == "maybe_set":
        leaves = eqn.invars[3:]
        if eqn.params.get("i_static") is not None or len(leaves) != 1 or _shape(leaves[0]):
            return None
        return 3, 1, True
    return None


# Calls whose sub-jaxpr takes the equation's inputs one to one, by parameter.
_CALL_JAXPRS = ("jaxpr", "call_jaxpr")


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr


class _Roots:
    """Where the values of a jaxpr come from, as buffers written row by row: for
    a variable, the input of the jaxpr it is (`(index, wrote)`: `wrote` if whole
    rows of it were overwritten on the way), or `None`. Sees through copies,
    casts, selections of whole buffers, overwrites of rows, calls, and the
    carries of loops that are such buffers themselves."""

    def __init__(self, jaxpr: Any) -> None:
        self.jaxpr = jaxpr
        self.inputs = {v: k for k, v in enumerate(jaxpr.invars)}
        self.producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        self.memo: dict[Any, Any] = {}

    def of(self, var: Any, depth: int = 0) -> tuple[int, bool] | None:
        if isinstance(var, Literal) or depth > 256:
            return None
        if var in self.inputs:
            return self.inputs[var], False
        if var not in self.memo:
            self.memo[var] = self._of(var, depth)
        return self.memo[var]

    def _of(self, var: Any, depth: int) -> tuple[int, bool] | None:
        eqn = self.producer.get(var)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if _passes(eqn):
            return self.of(eqn.invars[0], depth + 1)
        if name in _SELECTS:
            if _shape(eqn.invars[0]):
                return None
            found = [self.of(v, depth + 1) for v in eqn.invars[1:]]
            if any(f is None for f in found) or len({f[0] for f in found if f}) != 1:
                return None
            return found[0][0], any(f[1] for f in found if f)  # pyright: ignore[reportOptionalSubscript]
        if _written_window(eqn, _shape(var)) is not None:
            found = self.of(eqn.invars[1 if name == "maybe_set" else 0], depth + 1)
            return None if found is None else (found[0], True)
        inner = _through(eqn, eqn.outvars.index(var))
        if inner is None:
            return None
        outer, wrote = inner
        found = self.of(eqn.invars[outer], depth + 1)
        return None if found is None else (found[0], found[1] or wrote)


def _through(eqn: JaxprEqn, j: int) -> tuple[int, bool] | None:
    """For output `j` of a call, `while` or `scan`: the input of the equation
    it is, as a buffer written row by row (`(index, wrote)`), or `None`."""
    name = eqn.primitive.name
    if name == "while":
        body = _open(eqn.params["body_jaxpr"])
        start = eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]
        found = carried_rows(body, body.invars[eqn.params["body_nconsts"] :], body.outvars)
        return (start + j, True) if found[j] else None
    if name == "scan":
        body = _open(eqn.params["jaxpr"])
        consts, carries = scan_layout(eqn)
        if j >= carries:
            return None
        found = carried_rows(body, body.invars[consts : consts + carries], body.outvars[:carries])
        return (consts + j, True) if found[j] else None
    if name == "cond":
        found = [_Roots(_open(b)).of(_open(b).outvars[j]) for b in eqn.params["branches"]]
        if any(f is None for f in found) or len({f[0] for f in found if f}) != 1:
            return None
        return 1 + found[0][0], any(f[1] for f in found if f)  # pyright: ignore[reportOptionalSubscript]
    for key in _CALL_JAXPRS:
        sub = eqn.params.get(key)
        if sub is not None and len(_open(sub).invars) == len(eqn.invars):
            return _Roots(_open(sub)).of(_open(sub).outvars[j])
    return None


def cond_rows(eqn: JaxprEqn, has_rows: list[bool]) -> tuple[int, ...]:
    """The outputs of a `cond` that are its operands' buffers written row by row
    in every branch (or passed on), where the operand (`has_rows[k]` for
    `eqn.invars[1 + k]`) has rows: they leave every branch with rows."""
    rowed = []
    for j in range(len(eqn.outvars)):
        found = _through(eqn, j)
        if found is not None and has_rows[found[0] - 1]:
            rowed.append(j)
    return tuple(rowed)


def row_write_at_run_time(eqn: JaxprEqn, invals: list[Any]) -> bool:
    """Whether `eqn` overwrites whole rows of a buffer of at most `MAX_ROWS` rows
    at an index computed at run time (at one known while tracing, the buffer's
    pieces are exact already)."""
    operand = 1 if eqn.primitive.name == "maybe_set" else 0
    shape = np.shape(invals[operand])
    found = _written_window(eqn, shape) if shape and shape[0] <= MAX_ROWS else None
    return found is not None and isinstance(invals[found[0]], Tracer)


def carried_rows(jaxpr: Any, ins: list[Any], outs: list[Any]) -> list[bool]:
    """Which loop carries (body input `ins[k]`, output `outs[k]`) are buffers the
    body writes row by row: the output is the input with whole rows overwritten
    (`_written_window`), possibly copied, cast, selected between such buffers,
    or passed through calls and inner loops that do the same. Only those keep
    the origin of each row from iteration to iteration."""
    roots = _Roots(jaxpr)
    rows = []
    for var_in, var_out in zip(ins, outs, strict=True):
        shape = _shape(var_in)
        found = roots.of(var_out) if shape and 0 < shape[0] <= MAX_ROWS else None
        rows.append(found is not None and jaxpr.invars[found[0]] is var_in and found[1])
    return rows


def broadcast_rows(origin: _Origin, length: int) -> _Rows:
    """Rows that each have `origin` (a loop slot's: traced)."""
    w = jnp.broadcast_to(jnp.asarray(origin.w, jnp.int32), (length,))
    info = jnp.broadcast_to(origin.info, (length, np.shape(origin.info)[0]))
    return _Rows(w, info)


def rows_made(eqn: JaxprEqn, invals: list[Any], update: Any, rows: list[Any]) -> _Rows | None:
    """The rows of the output of `eqn` on buffers whose inputs have `rows`:
    passed on, selected, or written (rows of the update get `update`, its
    origin as a loop slot's). `None` where the equation ends them."""
    name = eqn.primitive.name
    if name in _PASSED:
        return rows[0] if _passes(eqn) else None
    if name in _SELECTS:
        cases = rows[1:]
        if any(r is None for r in cases) or np.shape(invals[0]):
            return None
        if name == "select_if_vmap":
            cases = cases[::-1]
        which = invals[0]
        return _Rows(
            jax.lax.select_n(which, *(r.w for r in cases)),
            jax.lax.select_n(which, *(r.info for r in cases)),
        )
    operand = 1 if name == "maybe_set" else 0
    own = rows[operand] if operand < len(rows) else None
    found = _written_window(eqn, tuple(np.shape(invals[operand])))
    if own is None or found is None:
        return None
    at, length, drops = found
    size = np.shape(invals[operand])[0]
    start = jnp.asarray(invals[at], jnp.int32).reshape(())
    if name == "maybe_set":
        start = jnp.where(start < 0, start + size, start)  # `xs.at[i]` counts from the end
    inside = (start >= 0) & (start <= size - length)
    width = np.shape(own.info)[1]
    w = jnp.broadcast_to(jnp.asarray(update.w, jnp.int32), (length,))
    info = jnp.broadcast_to(update.info, (length, width))
    # Where the update is dropped (out of range, or `maybe_set`'s predicate is
    # false), the rows stay: the window is written back as it was (clamped into
    # range, as `dynamic_update_slice` clamps), touching only its rows.
    kept = [jnp.logical_not(inside)] if drops else []
    if name == "maybe_set":
        kept.append(jnp.logical_not(jnp.asarray(invals[0]).reshape(())))
    if kept:
        keep = functools.reduce(jnp.logical_or, kept)
        w = jnp.where(keep, jax.lax.dynamic_slice(own.w, (start,), (length,)), w)
        old = jax.lax.dynamic_slice(own.info, (start, np.int32(0)), (length, width))
        info = jnp.where(keep, old, info)
    return _Rows(
        jax.lax.dynamic_update_slice(own.w, for_mesh_of(w, own.w), (start,)),
        jax.lax.dynamic_update_slice(own.info, for_mesh_of(info, own.info), (start, np.int32(0))),
    )


class _RowSlot:
    """The loop slot of a carry written row by row: its origin (as any carry's)
    and its rows. The origin stays the array's inside the loop; the rows give
    the exact one once the loop is done (`rows_origin`)."""

    def __init__(self, origin: Any, rows: _Rows) -> None:
        self.origin = origin
        self.rows = rows


jax.tree_util.register_pytree_node(
    _RowSlot, lambda r: ((r.origin, r.rows), None), lambda _, children: _RowSlot(*children)
)
