"""Automatic checks: what the program's own operations may get wrong.

`checked(fn, errors=...)` adds them by kind: out-of-bounds indices
(`index_checks`), division by zero (`div_checks`) and NaNs made from NaN-free
inputs (`nan_checks`). Each kind is a rule (`_CONDITIONS`) that, given an
equation and its values, says whether it went wrong and what to report.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from kups.effects import reduce_shards, source_of

from ._check import _FORMATTER, _scalar
from ._first import first_true, last_axis, unravel, value_at

user_checks: frozenset[str] = frozenset({"user"})
"""A `check(pred, ...)` whose predicate is false."""
index_checks: frozenset[str] = frozenset({"index"})
"""An out-of-bounds index in `gather`, `scatter*`, `dynamic_slice` or
`dynamic_update_slice` (which JAX clamps, fills or drops without a word)."""
div_checks: frozenset[str] = frozenset({"div"})
"""A zero divisor in `div` or `rem` (integer or float)."""
nan_checks: frozenset[str] = frozenset({"nan"})
"""An operation whose output holds a NaN while none of its inputs does."""
float_checks: frozenset[str] = nan_checks | div_checks
"""`nan_checks | div_checks`, as in `jax.experimental.checkify`."""
automatic_checks: frozenset[str] = float_checks | index_checks
"""Every check `checked` adds by itself: `index_checks | div_checks | nan_checks`."""
all_checks: frozenset[str] = automatic_checks | user_checks
"""`automatic_checks | user_checks`."""


@dataclasses.dataclass(frozen=True)
class _AutoCheck:
    """The static part of an automatic check: what it reports and where. Compared
    by value, so that an equation met when a loop body is scanned ahead and when it
    runs is the same site (and equal reports of one line share a slot, which is
    harmless: only the first failure is ever recorded)."""

    kind: str
    primitive: str
    location: str
    template: str  # `str.format` template with positional fields for the payload
    payload: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each value

    @property
    def avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct(shape, np.dtype(dtype)) for shape, dtype in self.payload)

    def format(self, arrays: Sequence[Any], sharded: bool = False) -> str:
        """The message with the payload `arrays`; `sharded`: it happened inside
        `shard_map`, where shapes and element indices are those of the shard's block."""
        values = [_scalar(a) for a in arrays]
        if "{within}" not in self.template:
            return _FORMATTER.format(self.template, *values)
        within = " of this shard's block" if sharded else ""
        return _FORMATTER.format(self.template, *values, within=within)


_SCATTERS = frozenset(
    {
        "scatter",
        *(f"scatter{sep}{op}" for sep in "-_" for op in ("add", "sub", "mul", "min", "max")),
    }
)
_INDEXING = frozenset({"gather", "dynamic_slice", "dynamic_update_slice"}) | _SCATTERS
_DIVISIONS = frozenset({"div", "rem"})
# Operations that only move, pick or relabel elements: from NaN-free inputs they
# cannot make a NaN, so nan_checks does not spend a reduction on them. (`gather`
# is not one: in "fill" mode it writes NaN for an out-of-bounds index.)
_MOVES_ONLY = frozenset(
    {
        "broadcast_in_dim",
        "concatenate",
        "convert_element_type",
        "copy",
        "copy_p",
        "dynamic_slice",
        "dynamic_update_slice",
        "expand_dims",
        "reshape",
        "rev",
        "select_n",
        "slice",
        "squeeze",
        "tile",
        "transpose",
        # Collectives that move or pick values across shards.
        "ppermute",
        "pbroadcast",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "pmax",
        "pmin",
    }
)
# Collectives that sum over shards: a shard's output may hold another shard's NaN.
_SUMS_ACROSS_SHARDS = frozenset({"psum", "psum_invariant", "reduce_scatter", "psum_scatter"})


_UNKNOWN = "unknown"


def _eqn_location(eqn: JaxprEqn, enclosing: str | None = None) -> str:
    """`file.py:LINE` of the user's code behind `eqn`, else `enclosing` (see
    `source_of`), else `"unknown"` (for a walk that fills it in later)."""
    return source_of(eqn, enclosing) or _UNKNOWN


def _is_inexact(dtype: Any) -> bool:
    return isinstance(dtype, np.dtype) and bool(jnp.issubdtype(dtype, jnp.inexact))


class _IndexLayout(NamedTuple):
    """How an indexing equation reads its indices: the operand axis of each entry of
    the indices' last dimension and the largest in-bounds start on that axis."""

    operand_axes: tuple[int, ...]
    upper: tuple[int, ...]


def _index_layout(eqn: JaxprEqn) -> _IndexLayout | None:
    """The index layout of a `gather`, `scatter*`, `dynamic_slice` or
    `dynamic_update_slice`, or `None` when it reads no index."""
    name, params = eqn.primitive.name, eqn.params
    operand_shape = tuple(eqn.invars[0].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
    ndim = len(operand_shape)
    if name == "dynamic_slice":
        window = tuple(params["slice_sizes"])
        axes = tuple(range(ndim))
    elif name == "dynamic_update_slice":
        window = tuple(eqn.invars[1].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
        axes = tuple(range(ndim))
    elif name == "gather":
        if math.prod(eqn.invars[1].aval.shape) == 0:  # pyright: ignore[reportAttributeAccessIssue]
            return None
        window = tuple(params["slice_sizes"])
        axes = tuple(params["dimension_numbers"].start_index_map)
    else:  # scatter*: the update window's extent along each operand axis
        if math.prod(eqn.invars[1].aval.shape) == 0:  # pyright: ignore[reportAttributeAccessIssue]
            return None
        numbers = params["dimension_numbers"]
        updates_shape = eqn.invars[2].aval.shape  # pyright: ignore[reportAttributeAccessIssue]
        size_one = {*numbers.inserted_window_dims, *getattr(numbers, "operand_batching_dims", ())}
        window_dims = iter(numbers.update_window_dims)
        window = tuple(
            1 if d in size_one else updates_shape[next(window_dims)] for d in range(ndim)
        )
        axes = tuple(numbers.scatter_dims_to_operand_dims)
    if not axes:
        return None
    return _IndexLayout(axes, tuple(operand_shape[a] - window[a] for a in axes))


def _index_array(eqn: JaxprEqn, invals: Sequence[Any]) -> jax.Array:
    """The indices an equation reads, with one entry per operand axis last."""
    name = eqn.primitive.name
    ndim = len(eqn.invars[0].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
    if name == "dynamic_slice":
        return jnp.stack([jnp.asarray(i) for i in invals[1 : 1 + ndim]])
    if name == "dynamic_update_slice":
        return jnp.stack([jnp.asarray(i) for i in invals[2 : 2 + ndim]])
    return jnp.asarray(invals[1])


def _automatic_checks(
    eqn: JaxprEqn, kinds: frozenset[str], enclosing: str | None
) -> tuple[_AutoCheck, ...]:
    """The automatic checks of `kinds` that apply to `eqn` (no control flow), inside
    control flow at `enclosing`."""
    name = eqn.primitive.name
    found = []
    scalar = ((), "int32")
    if "index" in kinds and name in _INDEXING and _index_layout(eqn) is not None:
        shape = tuple(eqn.invars[0].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
        template = (
            f"out-of-bounds index {{}} on axis {{}} of an operand of shape {shape}{{within}} in "
            f"'{name}' (in bounds: 0 to {{}})"
        )
        found.append(
            _AutoCheck("index", name, _eqn_location(eqn, enclosing), template, (scalar,) * 3)
        )
    if "div" in kinds and name in _DIVISIONS:
        divisor_shape = tuple(eqn.invars[1].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
        if divisor_shape:
            template = f"division by zero in '{name}' (divisor element {{}}{{within}})"
            payload = (((len(divisor_shape),), "int32"),)
        else:
            template, payload = f"division by zero in '{name}'", ()
        found.append(_AutoCheck("div", name, _eqn_location(eqn, enclosing), template, payload))
    if (
        "nan" in kinds
        and name not in _MOVES_ONLY
        and not eqn.effects  # effects (a `sow`, a callback) pass their values on
        and any(_is_inexact(v.aval.dtype) for v in eqn.outvars)  # pyright: ignore[reportAttributeAccessIssue]
    ):
        template = f"'{name}' produced a NaN from inputs without NaN"
        found.append(_AutoCheck("nan", name, _eqn_location(eqn, enclosing), template, ()))
    return tuple(found)


def _out_of_bounds(
    eqn: JaxprEqn, invals: Sequence[Any], outvals: Sequence[Any]
) -> tuple[jax.Array, list[jax.Array]]:
    del outvals
    layout = _index_layout(eqn)
    assert layout is not None
    indices = _index_array(eqn, invals)
    upper = np.asarray(layout.upper)
    # A bound past the index dtype's range is one no index of that dtype passes.
    bound = np.minimum(upper, np.iinfo(indices.dtype).max).astype(indices.dtype)
    outside = jnp.logical_or(indices < 0, indices > bound)
    first, flat = first_true(outside)
    entry = last_axis(first, len(layout.operand_axes))
    payload = [
        value_at(indices, flat, first, indices.ndim).astype(jnp.int32),
        jnp.asarray(layout.operand_axes, jnp.int32)[entry],
        jnp.asarray(upper, jnp.int32)[entry],
    ]
    return jnp.any(outside), payload


def _zero_divisor(
    eqn: JaxprEqn, invals: Sequence[Any], outvals: Sequence[Any]
) -> tuple[jax.Array, list[jax.Array]]:
    del outvals
    zero = jnp.asarray(invals[1]) == 0
    if not zero.ndim:
        return zero, []
    first, _ = first_true(zero)
    return jnp.any(zero), [unravel(first, zero.shape)]


def _new_nan(
    eqn: JaxprEqn, invals: Sequence[Any], outvals: Sequence[Any]
) -> tuple[jax.Array, list[jax.Array]]:
    def any_nan(values: Iterable[Any]) -> jax.Array:
        flags = [jnp.any(jnp.isnan(v)) for v in map(jnp.asarray, values) if _is_inexact(v.dtype)]
        return functools.reduce(jnp.logical_or, flags, jnp.zeros((), jnp.bool_))

    given = any_nan(invals)
    if eqn.primitive.name in _SUMS_ACROSS_SHARDS:
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        named = tuple(a for a in axes if not isinstance(a, int))  # not positional axes
        given = reduce_shards(given.astype(jnp.int32), named, op="max") > 0
    return jnp.logical_and(any_nan(outvals), jnp.logical_not(given)), []


_CONDITIONS: dict[
    str, Callable[[JaxprEqn, Sequence[Any], Sequence[Any]], tuple[jax.Array, list[jax.Array]]]
] = {"index": _out_of_bounds, "div": _zero_divisor, "nan": _new_nan}
