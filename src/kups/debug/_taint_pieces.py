"""`report="reaching"`: the parts of an array that came from different inputs.

An array's origin is one event, the earliest among what it holds. A
`concatenate`, a `stack`, a `pad` along one axis, or a `dynamic_update_slice`
or one-window `scatter` at an index known while tracing (`_taint_known`) puts
inputs of different origins side by side along an axis: the output remembers
which range of that axis came from which input (`_Pieces`). The ranges follow
the equations that move elements without mixing them (`rev`, `transpose`,
`squeeze`, `broadcast_in_dim`, reshapes that keep the axis whole, reductions
and sorts along other axes, slices themselves), here; elementwise, sum and
cumulative equations check each range on its own (`_taint_rules`). A slice of
it (`slice`, `dynamic_slice`) or a gather of single elements along the axis
then takes the origins of only the pieces it keeps, each kept only if the part
of the output it fills is not finite. The bounds are static: this costs one
finiteness check per piece kept (a masked one at run-time indices), and nothing
where no array has pieces.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import JaxprEqn

from ._sites import widening_cast
from ._taint_origin import (
    _FINE,
    _FINITE,
    _concrete_finite,
    _earliest,
    _not_finite,
    _Origin,
    _validated,
)


class _Pieces(NamedTuple):
    """Along `axis`, elements `bounds[k]` to `bounds[k + 1]` have origin
    `origins[k]` (an `_Origin`, or `_FINITE`)."""

    axis: int
    bounds: tuple[int, ...]
    origins: tuple[Any, ...]


# Elementwise equations of one floating input that keep each element in place.
_IN_PLACE = frozenset(
    {
        "neg",
        "abs",
        "copy",
        "copy_p",
        "floor",
        "ceil",
        "round",
        "sign",
        "pvary",
        "pcast",
        "sharding_constraint",
    }
)

# Equations that check or merge every piece (elementwise ones, `select_n`, a
# gather or a slice at run-time indices) keep at most this many: an array
# flattened from a pytree of many leaves (`ravel_pytree`) would otherwise cost a
# check per leaf at each of them. Past it, the array's origin is used.
MAX_CHECKED_PIECES = 8

# Equations of one input that keep each position along the axes they do not
# name (`axes` or `dimension` params) and make no NaN/Inf.
_ALONG_OTHER_AXES = frozenset({"reduce_max", "reduce_min", "cummax", "cummin", "sort"})


# Equations of one input that sum, multiply or accumulate along the axes they
# name (`axes` or `axis` params): each output range is computed from the ranges
# at its place along other axes, or, accumulating along the pieced axis, from
# the ranges up to it.
_ACCUMULATING = frozenset(
    {"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "cummax", "cummin"}
)


def _piece_origin(origin: Any, value: Any) -> Any:
    """`origin` as a piece's origin, or `None` when it cannot be one (an argument,
    a constant that may hold a NaN/Inf)."""
    if isinstance(origin, _Origin):
        return None if origin.external else origin
    if origin is _FINITE or (origin is None and _concrete_finite(value)):
        return _FINITE
    return None


def pieces_made(
    eqn: JaxprEqn, invals: list[Any], origins: list[Any], pieces: list[_Pieces | None]
) -> _Pieces | None:
    """The pieces of `eqn`'s (only) output, or `None`."""
    name = eqn.primitive.name
    if len(eqn.outvars) != 1:
        return None
    if name == "concatenate":
        return _concatenated(eqn, invals, origins, pieces)
    if name == "pad":
        return _padded(eqn, invals, origins)
    if name == "stack":
        return _stacked(eqn, invals, origins)
    if name == "dynamic_update_slice":
        return _updated(invals, origins, pieces)
    if name == "scatter" and len(invals) == 3:
        return _scattered(eqn, invals, origins, pieces)
    if not pieces or pieces[0] is None:
        return None
    own = pieces[0]
    if len(eqn.invars) == 1 and (name in _IN_PLACE or widening_cast(eqn)):
        return own
    if name == "reshape" and eqn.params.get("dimensions") is None:
        return _reshaped(own, np.shape(invals[0]), tuple(eqn.params["new_sizes"]))
    if name in _ALONG_OTHER_AXES and len(eqn.invars) == 1:
        named = eqn.params.get("axes", (eqn.params.get("dimension", eqn.params.get("axis")),))
        axes = {a % len(np.shape(invals[0])) for a in named}
        if own.axis in axes:
            return None
        if name.startswith("reduce"):
            return own._replace(axis=own.axis - sum(1 for a in axes if a < own.axis))
        return own
    if name == "rev":
        if own.axis not in eqn.params["dimensions"]:
            return own
        size = own.bounds[-1]
        bounds = tuple(size - b for b in reversed(own.bounds))
        return _Pieces(own.axis, bounds, tuple(reversed(own.origins)))
    if name == "transpose":
        return own._replace(axis=list(eqn.params["permutation"]).index(own.axis))
    if name == "squeeze":
        dims = eqn.params["dimensions"]
        if own.axis in dims:
            return None
        return own._replace(axis=own.axis - sum(1 for d in dims if d < own.axis))
    if name == "broadcast_in_dim":
        axis = eqn.params["broadcast_dimensions"][own.axis]
        if eqn.params["shape"][axis] != own.bounds[-1]:
            return None
        return own._replace(axis=axis)
    span = window(eqn, invals)
    if span is not None:
        start, stop, stride = span[own.axis]
        kept = _kept(own, start, stop, stride)
        if len(kept) < 2:
            return None
        bounds = (*(lo for lo, _, _ in kept), kept[-1][1])
        return _Pieces(own.axis, bounds, tuple(o for _, _, o in kept))
    return None


def accumulated(
    eqn: JaxprEqn, invals: list[Any], own: _Pieces
) -> tuple[tuple[int, tuple[int, ...]], list[list[Any]]] | None:
    """For an `_ACCUMULATING` equation on an array of pieces `own`: the axis and
    bounds of its output's ranges, and the pieces' origins each is computed from.
    `None` for a reduction along the pieced axis (it mixes every range)."""
    if len(invals) != 1 or eqn.primitive.name not in _ACCUMULATING:
        return None
    ndim = len(np.shape(invals[0]))
    ranges = [[o] for o in own.origins]
    if "axes" in eqn.params:
        axes = {a % ndim for a in eqn.params["axes"]}
        if own.axis in axes:
            return None
        axis = own.axis - sum(1 for a in axes if a < own.axis)
        return (axis, own.bounds), ranges
    if eqn.params["axis"] % ndim == own.axis:
        # Range k of a cumulative output is computed from ranges 0 to k (k to the
        # last, in reverse).
        order = list(own.origins)
        if eqn.params.get("reverse", False):
            order.reverse()
        ranges = [order[: k + 1] for k in range(len(order))]
        if eqn.params.get("reverse", False):
            ranges.reverse()
    return (own.axis, own.bounds), ranges


def _reshaped(own: _Pieces, shape: tuple[int, ...], new: tuple[int, ...]) -> _Pieces | None:
    """The pieces after a reshape that keeps the pieced axis whole: as it is, merged
    with the axes after it (ranges scaled), or split with every bound falling
    on a multiple of the new axis' step."""
    before = int(np.prod(shape[: own.axis]))
    size = shape[own.axis]
    axis, seen = 0, 1
    while axis < len(new) and (seen < before or (new[axis] == 1 and size != 1)):
        seen *= new[axis]
        axis += 1
    if seen != before or axis == len(new):
        return None
    length = new[axis]
    if length % size == 0:
        scale = length // size
        return _Pieces(axis, tuple(b * scale for b in own.bounds), own.origins)
    step = size // length
    if size % length or any(b % step for b in own.bounds):
        return None
    bounds = tuple(b // step for b in own.bounds)
    if len(set(bounds)) != len(bounds):
        return None
    return _Pieces(axis, bounds, own.origins)


def origin_of_slice(
    eqn: JaxprEqn, invals: list[Any], own: _Pieces | None, outval: Any, kinds: tuple[str, ...]
) -> Any:
    """The origin a slice of an array of pieces `own` takes from it: the earliest
    of the pieces it keeps whose part of `outval` is not finite; `None` when it is
    not such a slice."""
    if own is None:
        return None
    span = window(eqn, invals)
    if span is None:
        found = positions(eqn, invals, own.axis)
        if found is None or len(own.origins) > MAX_CHECKED_PIECES:
            return None
        return _masked_origin(own, outval, *found, kinds)
    start, stop, stride = span[own.axis]
    traced = []
    for lo, hi, origin in _kept(own, start, stop, stride):
        if isinstance(origin, _Origin):
            part = jax.lax.slice_in_dim(outval, lo, hi, axis=own.axis)
            traced.append(_validated(origin, part, kinds))
    return _earliest(traced) if traced else _FINITE


def positions(eqn: JaxprEqn, invals: list[Any], axis: int) -> tuple[int, Any] | None:
    """For a `dynamic_slice` at indices computed at run time, or a `gather` that
    picks single elements along `axis` by a vector of indices (`x[idx]`,
    `jnp.take`): the output axis `axis` becomes, and the index along `axis` (a
    traced vector, -1 where a gather fills) of each position of it. `None` for
    any other equation."""
    name = eqn.primitive.name
    shape = np.shape(invals[0])
    size = shape[axis]
    if name == "dynamic_slice":
        indices = invals[1 : 1 + len(shape)]
        if len(indices) != len(shape):
            return None
        length = eqn.params["slice_sizes"][axis]
        # Out of range, dynamic_slice clamps the start.
        start = jnp.clip(jnp.asarray(indices[axis], np.int32), 0, size - length)
        return axis, start + jnp.arange(length, dtype=np.int32)
    if name != "gather":
        return None
    numbers, indices = eqn.params["dimension_numbers"], invals[1]
    if (
        numbers.operand_batching_dims
        or axis not in numbers.collapsed_slice_dims
        or axis not in numbers.start_index_map
        or np.ndim(indices) != 2
    ):
        return None
    # One batch axis: the output axis that is not an offset axis.
    out_axis = next(i for i in range(len(numbers.offset_dims) + 1) if i not in numbers.offset_dims)
    column = numbers.start_index_map.index(axis)
    index = jax.lax.index_in_dim(jnp.asarray(indices), column, axis=1, keepdims=False)
    if str(eqn.params["mode"]).endswith("FILL_OR_DROP"):
        # Out of range, the element is the fill value, not one of the operand's.
        index = jnp.where((index < 0) | (index >= size), -1, index)
    else:
        index = jnp.clip(index, 0, size - 1)
    return out_axis, index.astype(np.int32)


def _masked_origin(
    own: _Pieces, outval: Any, axis: int, positions: Any, kinds: tuple[str, ...]
) -> Any:
    """The earliest origin of the pieces whose elements, at `positions` along the
    output's `axis` (indices into the pieced axis), are not finite."""
    bad = _not_finite(outval, kinds)
    shape = [1] * np.ndim(outval)
    shape[axis] = -1
    traced = []
    for k, origin in enumerate(own.origins):
        if not isinstance(origin, _Origin):
            continue
        inside = (positions >= own.bounds[k]) & (positions < own.bounds[k + 1])
        hit = jnp.any(bad & inside.reshape(shape))
        traced.append(_Origin(jax.lax.select_n(hit, _FINE, origin.w), origin.info, False))
    return _earliest(traced) if traced else _FINITE


def origin_of_parts(own: _Pieces, value: Any, kinds: tuple[str, ...]) -> Any:
    """The origin of the whole of `value`, an array of pieces `own`: the earliest
    of the pieces whose part of it is not finite (one check per piece); `None`
    past `MAX_CHECKED_PIECES` pieces."""
    if len(own.origins) > MAX_CHECKED_PIECES:
        return None
    traced = [
        _validated(origin, jax.lax.slice_in_dim(value, lo, hi, axis=own.axis), kinds)
        for lo, hi, origin in _ranges(own)
        if isinstance(origin, _Origin)
    ]
    return _earliest(traced) if traced else _FINITE


def _kept(own: _Pieces, start: int, stop: int, stride: int) -> list[tuple[int, int, Any]]:
    """The pieces a slice `start:stop:stride` keeps, as `(lo, hi, origin)` with
    `lo:hi` the range of the slice's output they fill."""
    kept = []
    for k, origin in enumerate(own.origins):
        lo, hi = max(own.bounds[k], start), min(own.bounds[k + 1], stop)
        if lo >= hi:
            continue
        # The output positions of the input indices in lo:hi on the stride.
        first = -(-(lo - start) // stride)
        end = -(-(hi - start) // stride)
        if first < end:
            kept.append((first, end, origin))
    return kept


def window(eqn: JaxprEqn, invals: list[Any]) -> list[tuple[int, int, int]] | None:
    """`(start, stop, stride)` per axis of a `slice`, or of a `dynamic_slice` whose
    indices are known while tracing; `None` for any other equation."""
    name = eqn.primitive.name
    shape = np.shape(invals[0])
    if name == "slice":
        strides = eqn.params["strides"] or (1,) * len(shape)
        return list(
            zip(eqn.params["start_indices"], eqn.params["limit_indices"], strides, strict=True)
        )
    if name == "dynamic_slice":
        indices = invals[1 : 1 + len(shape)]
        if len(indices) != len(shape) or any(isinstance(i, Tracer) for i in indices):
            return None
        sizes = eqn.params["slice_sizes"]
        window = []
        for index, size, dim in zip(indices, sizes, shape, strict=True):
            # Out of range, dynamic_slice clamps the start.
            start = min(max(int(index), 0), dim - size)
            window.append((start, start + size, 1))
        return window
    return None


def _concatenated(
    eqn: JaxprEqn, invals: list[Any], origins: list[Any], pieces: list[_Pieces | None]
) -> _Pieces | None:
    axis = eqn.params["dimension"]
    bounds, parts = [0], []
    for value, origin, own in zip(invals, origins, pieces, strict=True):
        size = np.shape(value)[axis]
        if size == 0:
            continue
        offset = bounds[-1]
        if own is not None and own.axis == axis:
            parts.extend(own.origins)
            bounds.extend(offset + b for b in own.bounds[1:])
            continue
        part = _piece_origin(origin, value)
        if part is None:
            return None
        parts.append(part)
        bounds.append(offset + size)
    if len({id(p) for p in parts if isinstance(p, _Origin)}) < 2:
        return None  # one origin: the array's is exact
    return _Pieces(axis, tuple(bounds), tuple(parts))


def _stacked(eqn: JaxprEqn, invals: list[Any], origins: list[Any]) -> _Pieces | None:
    """A `stack` (JAX 0.12's primitive): one range of the new axis per input."""
    parts = [_piece_origin(origin, value) for value, origin in zip(invals, origins, strict=True)]
    if any(part is None for part in parts) or len({id(p) for p in parts}) < 2:
        return None
    return _Pieces(eqn.params["axis"], tuple(range(len(parts) + 1)), tuple(parts))


def _updated(invals: list[Any], origins: list[Any], pieces: list[_Pieces | None]) -> _Pieces | None:
    """A `dynamic_update_slice` along one axis, at a start known while tracing:
    the operand's ranges before and after the update, the update's in between."""
    operand, update, *indices = invals
    shape, size = np.shape(operand), np.shape(update)
    axes = [d for d, (n, u) in enumerate(zip(shape, size, strict=True)) if n != u]
    if len(axes) != 1 or isinstance(indices[axes[0]], Tracer):
        return None
    axis = axes[0]
    # Out of range, dynamic_update_slice clamps the start.
    start = min(max(int(indices[axis]), 0), shape[axis] - size[axis])
    return _overwritten(
        axis, start, size[axis], (operand, origins[0], pieces[0]), (update, origins[1], pieces[1])
    )


def _scattered(
    eqn: JaxprEqn, invals: list[Any], origins: list[Any], pieces: list[_Pieces | None]
) -> _Pieces | None:
    """A `scatter` (`x.at[i].set(v)`, `x.at[a:b].set(v)`) of one window along
    one axis, spanning the others, at an index known while tracing: as a
    `dynamic_update_slice` there."""
    operand, indices, update = invals
    numbers = eqn.params["dimension_numbers"]
    if (
        isinstance(indices, Tracer)
        or numbers.operand_batching_dims
        or len(numbers.scatter_dims_to_operand_dims) != 1
        or np.size(indices) != 1
    ):
        return None
    shape = np.shape(operand)
    axis = numbers.scatter_dims_to_operand_dims[0]
    # The update's window axes are the operand's axes it does not insert.
    window_of = [d for d in range(len(shape)) if d not in numbers.inserted_window_dims]
    if list(numbers.inserted_window_dims) not in ([], [axis]) or len(window_of) != len(
        numbers.update_window_dims
    ):
        return None
    sizes = dict(zip(window_of, (np.shape(update)[d] for d in numbers.update_window_dims)))
    if any(sizes[d] != shape[d] for d in window_of if d != axis):
        return None
    length = sizes.get(axis, 1)
    start = int(np.asarray(indices).reshape(()))
    if not 0 <= start <= shape[axis] - length:
        if str(eqn.params["mode"]).endswith("FILL_OR_DROP"):
            return pieces[0]  # out of range, the update is dropped
        start = min(max(start, 0), shape[axis] - length)
    # The update's pieces count only along the axis it writes.
    own = pieces[2]
    if own is not None and (
        axis not in sizes or numbers.update_window_dims[window_of.index(axis)] != own.axis
    ):
        own = None
    return _overwritten(
        axis, start, length, (operand, origins[0], pieces[0]), (update, origins[2], own)
    )


def _overwritten(
    axis: int, start: int, length: int, operand: tuple[Any, Any, Any], update: tuple[Any, Any, Any]
) -> _Pieces | None:
    """The pieces of `operand` (value, origin, pieces) with elements `start` to
    `start + length` along `axis` overwritten by `update`: the operand's ranges
    before and after, the update's (or its one origin) in between."""
    stop = start + length
    size = np.shape(operand[0])[axis]
    ranges = []
    for (value, origin, own), offset, extent in ((operand, 0, size), (update, start, length)):
        if own is not None and own.axis == axis:
            parts = [(offset + lo, offset + hi, o) for lo, hi, o in _ranges(own)]
        else:
            whole = _piece_origin(origin, value) if own is None else None
            if whole is None:
                return None
            parts = [(offset, offset + extent, whole)]
        ranges.append(parts)
    kept_operand = [
        (max(lo, a), min(hi, b), o)
        for lo, hi, o in ranges[0]
        for a, b in ((0, start), (stop, size))
        if max(lo, a) < min(hi, b)
    ]
    merged = sorted([*kept_operand, *ranges[1]], key=lambda r: r[0])
    if len({id(o) for _, _, o in merged if isinstance(o, _Origin)}) < 2:
        return None
    bounds = (*(lo for lo, _, _ in merged), merged[-1][1])
    return _Pieces(axis, bounds, tuple(o for _, _, o in merged))


def _ranges(own: _Pieces) -> list[tuple[int, int, Any]]:
    return [(own.bounds[k], own.bounds[k + 1], o) for k, o in enumerate(own.origins)]


def _padded(eqn: JaxprEqn, invals: list[Any], origins: list[Any]) -> _Pieces | None:
    """A `pad` along one axis, without interior padding: padding, operand, padding."""
    config = eqn.params["padding_config"]
    padded = [i for i, (lo, hi, interior) in enumerate(config) if (lo, hi, interior) != (0, 0, 0)]
    if len(padded) != 1:
        return None
    axis = padded[0]
    lo, hi, interior = config[axis]
    if interior != 0 or lo < 0 or hi < 0:
        return None
    operand = _piece_origin(origins[0], invals[0])
    fill = _piece_origin(origins[1], invals[1])
    if (
        operand is None
        or fill is None
        or not (isinstance(operand, _Origin) and isinstance(fill, _Origin))
    ):
        return None
    size = np.shape(invals[0])[axis]
    bounds, parts = [0], []
    for length, part in ((lo, fill), (size, operand), (hi, fill)):
        if length:
            parts.append(part)
            bounds.append(bounds[-1] + length)
    return _Pieces(axis, tuple(bounds), tuple(parts))
