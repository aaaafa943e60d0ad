"""`report="reaching"`: how one equation passes origins on.

An equation's floating output is checked: finite, its origin is `_FINE` (a NaN
that a `where`, a slice or an overwrite dropped is forgotten); otherwise it
inherits the earliest origin of its inputs, or is a new event here when no
input held a NaN or Inf with an origin. Equations that cannot change whether a
value is finite (reshapes, transposes, negation, ...) pass the origin on with
no check, and values computed from constants alone carry none.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import JaxprEqn

from kups.effects import (
    HandlerResult,
    default_primitive_handler,
    reduce_shards,
)

from ._constants import _is_literal
from ._position import _NO_SHARD
from ._sites import (
    _is_float,
    _Sites,
    collective_axes,
    gathers_only,
    keeps_elements,
    widening_cast,
)
from ._taint_kept import _selected, _survivors, _taken_pieces
from ._taint_origin import (
    _DATA,
    _EXTERNAL,
    _FINE,
    _FINITE,
    _as_slot,
    _concrete_finite,
    _earliest,
    _finite_and_nan,
    _is_float_aval,
    _Origin,
    _shape,
    _Taint,
    _validated,
)
from ._taint_pieces import (
    _ACCUMULATING,
    MAX_CHECKED_PIECES,
    _Pieces,
    accumulated,
    origin_of_slice,
    pieces_made,
)
from ._taint_rows import broadcast_rows, origin_of_rows, row_write_at_run_time, rows_made
from ._taint_tables import (
    _COLLECTIVE_MOVES,
    _COLLECTIVES,
    _ELEMENTWISE,
    _FILTERS,
    _MOVES,
    _MOVING_FILTERS,
    _OVERWRITES,
    _PER_OPERAND,
    _TRANSPARENT,
)


def _code_vectors(site: int, pos: Any) -> tuple[Any, Any]:
    """`info` of a new event of `site` without and with a NaN, before `pos`."""
    length = pos.shape[0]
    inf, nan = np.zeros(length, np.int32), np.zeros(length, np.int32)
    inf[0], nan[0] = 2 * site, 2 * site + 1
    if not isinstance(pos, (jax.Array, Tracer)):
        return inf + pos, nan + pos
    return inf, nan


def _new_info(site: int, pos: Any, has_nan: Any) -> Any:
    inf, nan = _code_vectors(site, pos)
    code = jax.lax.select_n(has_nan, inf, nan)
    if isinstance(pos, (jax.Array, Tracer)):
        code = jax.lax.add(pos, code)
    return code


def _scale(value: Any) -> float | None:
    """The magnitude of a concrete real scalar, else `None`."""
    if isinstance(value, Tracer) or np.ndim(value) != 0 or not _is_float(value):
        return None
    if jnp.issubdtype(jnp.result_type(value), jnp.complexfloating):
        return None
    magnitude = abs(float(value))
    return magnitude if np.isfinite(magnitude) else None


def _class_of(eqn: JaxprEqn, invals: list[Any], outval: Any, kinds: tuple[str, ...]) -> str:
    name = eqn.primitive.name
    if any(_is_float_aval(v.aval) and 0 in _shape(v) for v in eqn.invars):
        return "create"  # a reduction of nothing: `max` of no elements is -inf
    complex_out = jnp.issubdtype(outval.dtype, jnp.complexfloating)
    if name in _TRANSPARENT and not complex_out:
        # sin(inf) and cos(inf) are NaN: watching NaNs (or Infs) alone, they make one.
        both = "nan" in kinds and "inf" in kinds
        return "transparent" if both or name not in ("sin", "cos") else "create"
    if "inf" not in kinds or "nan" not in kinds:
        # An unwatched Inf may become a NaN (inf * 0) anywhere else.
        return "filter" if name in _FILTERS else "create"
    # A multiplication by a constant of at most 1 in magnitude (a learning rate),
    # or a division by one of at least 1 (a mean), cannot overflow; a NaN or Inf
    # stays one (inf * 0 is NaN).
    scales = [_scale(value) for value in invals]
    real_pair = not complex_out and len(invals) == 2
    if name == "mul" and real_pair and any(s is not None and s <= 1.0 for s in scales):
        return "transparent"
    if name == "div" and real_pair and scales[1] is not None and scales[1] >= 1.0:
        return "transparent"
    if widening_cast(eqn):
        return "transparent"
    if name in _FILTERS:
        return "filter"
    return "create"


def _taint_equation(
    sites: _Sites, interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The fallback handler of report="reaching": re-binds the equation and gives
    each output its origin."""
    outvals = default_primitive_handler(interpreter, state, eqn, invals).outvals
    if state.scope.passive:
        return HandlerResult(state, outvals)
    origins = interpreter.origins_of(eqn.invars, eqn)
    if all(o is None for o in origins) and not any(
        _is_float(value) and not isinstance(value, Tracer) and not _concrete_finite(value)
        for value in invals
    ):
        # Constants alone, none of them a NaN/Inf written in the program.
        interpreter.set_origins(eqn.outvars, [None] * len(eqn.outvars))
        interpreter.learn(eqn, invals)
        return HandlerResult(state, outvals)
    finite = interpreter.finite[-1]
    if finite:
        # Constants known to be finite (`jnp.where(m, x, 0.0)`'s zeros) hold none.
        origins = [
            _FINITE if o is None and not _is_literal(v) and v in finite else o
            for v, o in zip(eqn.invars, origins, strict=True)
        ]
    pieces = interpreter.pieces_of(eqn.invars)
    # Indices computed from literals are known while tracing.
    invals = interpreter.static(eqn, invals)
    if pieces[0] is not None and isinstance(origins[0], _Origin) and _is_float(outvals[0]):
        # A slice of an array whose parts came from different inputs.
        sliced = origin_of_slice(eqn, invals, pieces[0], outvals[0], sites.kinds)
        if sliced is not None:
            origins = [sliced, *origins[1:]]
    rows = interpreter.rows_of(eqn.invars[0]) if eqn.invars else None
    if rows is not None and _is_float(outvals[0]):
        # A slice of a scan's stacked output: the rows it keeps.
        sliced = origin_of_rows(eqn, invals, rows, outvals[0], sites.kinds)
        if sliced is not None:
            origins = [sliced, *origins[1:]]
    pending = interpreter.pending[-1]
    site, out_origins = _propagate(
        sites, state, eqn, invals, origins, outvals, pending, pieced=any(pieces)
    )
    interpreter.pending[-1] = pending + (site is not None)
    interpreter.set_origins(eqn.outvars, out_origins)
    made = pieces_made(eqn, invals, origins, pieces)
    if made is None and eqn.primitive.name in _ELEMENTWISE and any(pieces):
        made = _elementwise_pieces(
            sites, state, eqn, invals, origins, pieces, outvals, pending, site
        )
    elif made is None and eqn.primitive.name in _ACCUMULATING and pieces[0] is not None:
        made = _accumulated_pieces(sites, state, eqn, invals, pieces[0], outvals[0], pending, site)
    if made is not None:
        interpreter.set_pieces(eqn.outvars[0], made)
    in_rows = [interpreter.rows_of(v) for v in eqn.invars]
    length = state.pos.shape[0]
    of, at = _OVERWRITES.get(eqn.primitive.name, (0, 0))
    if (
        eqn.primitive.name in _OVERWRITES
        and in_rows[of] is None
        and all(isinstance(origins[i], _Origin) for i in (of, at))
        and row_write_at_run_time(eqn, invals)
    ):
        # Whole rows written at an index computed at run time: the written rows
        # get the update's origin, the others keep the buffer's.
        in_rows[of] = broadcast_rows(
            _as_slot(origins[of], eqn.invars[of].aval, length), np.shape(invals[of])[0]
        )
    if any(r is not None for r in in_rows) and len(eqn.outvars) == 1:
        # A buffer written row by row (or a scan's stacked output) keeps its rows.
        update = _as_slot(origins[at], eqn.invars[at].aval, length)
        rows = rows_made(eqn, invals, update, in_rows)
        if rows is not None:
            interpreter.set_rows(eqn.outvars[0], rows)
    return HandlerResult(state, outvals)


def _propagate(
    sites: _Sites,
    state: _Taint,
    eqn: JaxprEqn,
    invals: list[Any],
    origins: list[Any],
    outvals: list[Any],
    pending: int,
    *,
    pieced: bool = False,
) -> tuple[int | None, list[Any]]:
    """The site of `eqn` if it can make a NaN/Inf (else `None`), and the origins
    of its outputs; its events are stamped `tick + pending`. `pieced`: an input
    has parts of different origins (`_taint_pieces`)."""
    name = eqn.primitive.name
    now = None
    floats_in = [i for i, value in enumerate(invals) if _is_float(value)]
    out_origins: list[Any] = []
    site: int | None = None
    collective = name in _COLLECTIVES and bool(state.scope.manual_axes)
    across: dict[tuple[int, ...], Any] = {}
    for j, outval in enumerate(outvals):
        if not _is_float(outval):
            out_origins.append(_DATA)
            continue
        if np.size(outval) == 0:
            out_origins.append(_FINITE)
            continue
        inputs = [j] if name in _PER_OPERAND else floats_in
        traced = [origins[i] for i in inputs if isinstance(origins[i], _Origin)]
        external = any(
            origins[i] is _EXTERNAL or (isinstance(origins[i], _Origin) and origins[i].external)
            for i in inputs
        )
        constant = any(
            origins[i] is None and not _concrete_finite(invals[i], sites.kinds) for i in inputs
        )
        # A filter of parts keeps their origins through the site it is (see
        # `_elementwise_pieces`).
        filters = (name in _MOVING_FILTERS or gathers_only(eqn)) and not pieced
        moves = name in _MOVES or filters or keeps_elements(eqn) or widening_cast(eqn)
        if moves and external and not constant and not collective:
            # Moving what an argument may hold is not computing with it: the
            # equation that does is where its NaN/Inf is first seen.
            if name in _OVERWRITES and len(traced) > 1:
                traced = _survivors(eqn, invals, origins, sites.kinds)
            elif name == "select_n" and len(traced) > 1:
                traced = _selected(invals, origins, sites.kinds)
            moved = _earliest(traced) if traced else None
            if moved is not None and filters:
                moved = _validated(moved, outval, sites.kinds)  # it may leave it out
            out_origins.append(_EXTERNAL if moved is None else _Origin(moved.w, moved.info, True))
            continue
        if collective and name in _COLLECTIVE_MOVES and external and not constant:
            # The same, between shards: each shard's output may hold any shard's.
            moved = _across_shards(state, _earliest(traced), eqn.params) if traced else None
            out_origins.append(_EXTERNAL if moved is None else _Origin(moved.w, moved.info, True))
            continue
        unknown = external or constant
        kind = "create" if collective else _class_of(eqn, invals, outval, sites.kinds)
        if name in _OVERWRITES and len(traced) > 1:
            traced = _survivors(eqn, invals, origins, sites.kinds)
        elif name == "select_n" and len(traced) > 1:
            traced = _selected(invals, origins, sites.kinds)
        if kind != "create" and not unknown:
            if not traced:
                out_origins.append(_FINITE)
                continue
            inherited = _earliest(traced)
            if kind == "filter":
                inherited = _validated(inherited, outval, sites.kinds)
            out_origins.append(inherited)
            continue
        # It may create a NaN/Inf here.
        if site is None:
            site = sites.add_at(eqn, state.scope.loop_depth, state.scope)
        inherited = _earliest(traced) if traced else None
        if collective:
            key = tuple(inputs)
            if key not in across:
                across[key] = _across_shards(state, inherited, eqn.params)
            inherited = across[key]
        fine, has_nan = _finite_and_nan(outval, sites.kinds)
        info = _new_info(site, state.pos, has_nan)
        if now is None:
            now = _plus(state.tick, pending)
        if inherited is None:
            w = jax.lax.select_n(fine, jnp.asarray(now, jnp.int32), _FINE)
        else:
            w = jax.lax.select_n(fine, jax.lax.min(inherited.w, now), _FINE)
            info = jax.lax.select_n(jax.lax.lt(inherited.w, now), info, inherited.info)
        out_origins.append(_Origin(w, info, False))
    return site, out_origins


def _elementwise_pieces(
    sites: _Sites,
    state: _Taint,
    eqn: JaxprEqn,
    invals: list[Any],
    origins: list[Any],
    pieces: list[Any],
    outvals: list[Any],
    pending: int,
    site: int | None,
) -> _Pieces | None:
    """The pieces of an elementwise equation's output whose operands have pieces
    along one axis and range (or one origin each): each range gets the origin
    `_propagate` would give an output of just that range, with the equation's
    own event (`site`, stamped `tick + pending`) where it makes a NaN/Inf there."""
    (outval,) = outvals
    if not _is_float(outval):
        return None
    shape = np.shape(outval)
    layouts = {(p.axis, p.bounds) for p in pieces if p is not None}
    if len(layouts) != 1:
        return None
    axis, bounds = layouts.pop()
    if len(bounds) - 1 > MAX_CHECKED_PIECES:
        return None
    per_operand = []
    # An operand that may hold a NaN/Inf of no site (an argument, a constant):
    # like `_propagate`, the equation is then where such a NaN/Inf is first seen.
    unknown = False
    for i, (value, origin, own) in enumerate(zip(invals, origins, pieces, strict=True)):
        if own is not None:
            operand = list(own.origins)
        elif not _is_float(value):
            continue
        elif np.shape(value) not in ((), shape):
            return None
        elif isinstance(origin, _Origin):
            unknown = unknown or origin.external
            operand = [origin] * (len(bounds) - 1)
        else:
            unknown = unknown or not (origin is _FINITE or _concrete_finite(value, sites.kinds))
            continue
        if eqn.primitive.name == "select_n":
            operand = _taken_pieces(invals, i, operand, axis, bounds, sites.kinds)
        per_operand.append(operand)
    kind = "create" if unknown else _class_of(eqn, invals, outval, sites.kinds)
    sources = [[o[k] for o in per_operand] for k in range(len(bounds) - 1)]
    return _checked_parts(sites, state, outval, axis, bounds, sources, kind, pending, site)


def _accumulated_pieces(
    sites: _Sites,
    state: _Taint,
    eqn: JaxprEqn,
    invals: list[Any],
    own: _Pieces,
    outval: Any,
    pending: int,
    site: int | None,
) -> _Pieces | None:
    """The pieces of a sum, product or cumulative equation's output
    (`accumulated`), each range checked where the equation can make a NaN/Inf
    (an overflow)."""
    if not _is_float(outval) or len(own.origins) > MAX_CHECKED_PIECES:
        return None
    found = accumulated(eqn, invals, own)
    if found is None:
        return None
    (axis, bounds), sources = found
    kind = _class_of(eqn, invals, outval, sites.kinds)
    return _checked_parts(sites, state, outval, axis, bounds, sources, kind, pending, site)


def _checked_parts(
    sites: _Sites,
    state: _Taint,
    outval: Any,
    axis: int,
    bounds: tuple[int, ...],
    sources: list[list[Any]],
    kind: str,
    pending: int,
    site: int | None,
) -> _Pieces | None:
    """`outval`'s pieces along `axis` at `bounds`: range `k` computed from the
    origins `sources[k]` by an equation of class `kind` (see `_class_of`) and
    `site`, as `_propagate` would give an output of just that range."""
    parts = []
    for k, origins in enumerate(sources):
        traced = [o for o in origins if isinstance(o, _Origin)]
        if kind != "create":
            if not traced:
                parts.append(_FINITE)
                continue
            inherited = _earliest(traced)
            if kind == "filter":
                piece = jax.lax.slice_in_dim(outval, bounds[k], bounds[k + 1], axis=axis)
                inherited = _validated(inherited, piece, sites.kinds)
            parts.append(inherited)
            continue
        if site is None:
            return None
        piece = jax.lax.slice_in_dim(outval, bounds[k], bounds[k + 1], axis=axis)
        fine, has_nan = _finite_and_nan(piece, sites.kinds)
        info = _new_info(site, state.pos, has_nan)
        now = _plus(state.tick, pending)
        if not traced:
            w = jax.lax.select_n(fine, jnp.asarray(now, jnp.int32), _FINE)
        else:
            inherited = _earliest(traced)
            w = jax.lax.select_n(fine, jax.lax.min(inherited.w, now), _FINE)
            info = jax.lax.select_n(jax.lax.lt(inherited.w, now), info, inherited.info)
        parts.append(_Origin(w, info, False))
    return _Pieces(axis, bounds, tuple(parts))


# `tick` stops growing here (ordering events made after 2**30 others, per shard,
# by their site instead), so that `tick` plus the equations of one jaxpr stays
# below the reserved values.
_TICK_LIMIT = 2**30


def _plus(tick: Any, count: int) -> Any:
    if count == 0:
        return tick
    if isinstance(tick, (jax.Array, Tracer)):
        return jax.lax.add(tick, np.int32(count))
    return np.int32(int(tick) + count)


def _flush(interpreter: Any, state: _Taint) -> _Taint:
    """`state` with `tick` advanced past the events of the jaxpr being run so far.

    Within one run of a jaxpr, the equations that can make a NaN/Inf stamp their
    events `tick + j` (the j-th of them): one addition, no update of `tick`.
    """
    count = interpreter.pending[-1]
    if count == 0:
        return state
    interpreter.pending[-1] = 0
    tick = state.tick
    if isinstance(tick, (jax.Array, Tracer)):
        tick = jax.lax.min(tick, np.int32(_TICK_LIMIT))
    else:
        tick = np.int32(min(int(tick), _TICK_LIMIT))
    return state._replace(tick=_plus(tick, count))


def _across_shards(state: _Taint, origin: _Origin | None, params: Any) -> _Origin:
    """The earliest of the shards' `origin`s over the collective's axes (the first
    shard in mesh order on ties): every shard's output may hold any shard's NaN."""
    if origin is None:
        origin = _Origin(_FINE, np.zeros(state.pos.shape[0], np.int32), False)
    return _earliest_over(state.here.reshape(()), origin, collective_axes(params))


def _earliest_over(own: Any, origin: _Origin, axes: tuple[Any, ...]) -> _Origin:
    """The earliest of the shards' `origin`s over `axes`, the same on every shard;
    `own` is the shard's index in the mesh (the first shard wins ties)."""
    # `where` on the shard index makes the values varying, as the collectives need.
    varying = own >= 0
    w = jnp.where(varying, origin.w, _FINE)
    first = reduce_shards(w, axes, op="min")
    candidate = jnp.where(w == first, own, _NO_SHARD)
    chosen = own == reduce_shards(candidate, axes, op="min")
    info = reduce_shards(jnp.where(chosen, origin.info, 0), axes, op="sum")
    return _Origin(first, info, origin.external)
