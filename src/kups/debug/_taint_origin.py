"""`report="reaching"`: the origin every floating value carries.

The origin of a floating value is `(w, info)`: `w` orders creation events (the
value of `tick` when the event happened: a per-shard count of the equations
that could create one), `_FINE` if the value is finite, `_UNKNOWN` if it may
hold a NaN or Inf that no equation of the program created (an argument);
`info` is `[2 * site + is_nan, shard, iteration of each loop...]` of the event.
Origins are kept per jaxpr on the Python side, cross sub-program boundaries in
the context (`_IO`), become loop carries, and are reduced over the shards of a
`shard_map`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from kups.effects import (
    to_current_mesh,
)

from ._sites import _is_float, _is_float_aval, _Scope

_FINE = np.int32(2**31 - 1)  # w of a finite value


_UNKNOWN = np.int32(2**31 - 2)  # w of a value that may hold a NaN/Inf of no site


class _Marker:
    """A static origin: `_DATA` (a value that is not floating, computed from the
    arguments), `_EXTERNAL` (a floating argument: it may hold a NaN/Inf that no
    equation made), `_FINITE` (a floating value known to be finite)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_DATA = _Marker("data")


_EXTERNAL = _Marker("external")


_FINITE = _Marker("finite")


class _Origin:
    """A traced origin: `w` (int32 scalar) and `info` (int32 vector), see above.
    `external` (static) says that `w` may be `_UNKNOWN`."""

    def __init__(self, w: Any, info: Any, external: bool) -> None:
        self.w = w
        self.info = info
        self.external = external


jax.tree_util.register_pytree_node(
    _Origin,
    lambda o: ((o.w, o.info), o.external),
    lambda external, children: _Origin(*children, external),
)


class _IO:
    """The origins that cross a sub-program's boundary, in the context: those of
    its inputs when the handler calls the interpreter, those of its outputs when
    the interpreter returns. `role` (static) says how they map to the jaxpr's
    inputs and outputs; `counts` (static) splits them into groups; `finite`
    (static), for a call's inputs, which are constants known to be finite."""

    def __init__(
        self,
        role: str,
        counts: tuple[int, ...],
        origins: tuple[Any, ...],
        finite: tuple[bool, ...] = (),
    ) -> None:
        self.role = role
        self.counts = counts
        self.origins = origins
        self.finite = finite

    def groups(self) -> list[list[Any]]:
        parts, start = [], 0
        for count in self.counts:
            parts.append(list(self.origins[start : start + count]))
            start += count
        return parts


jax.tree_util.register_pytree_node(
    _IO,
    lambda io: ((io.origins,), (io.role, io.counts, io.finite)),
    lambda aux, children: _IO(aux[0], aux[1], children[0], aux[2]),
)


class _Taint(NamedTuple):
    """The context of report="reaching".

    - `io`: the origins crossing the boundary of the sub-program being entered
      or left (`_IO`), else `None`.
    - `tick`: the count of equations run so far that could create a NaN/Inf.
    - `pos`: `[0, shard, iteration of each loop...]`, padded with -1 to the
      deepest loop nesting of the program: a new event's `info` is `pos` plus
      its site code.
    - `here`: the current shard's index in the mesh (see `_State.here`).
    - `scope`: static facts about where the current equation is (`_Scope`).
    """

    io: Any
    tick: Any
    pos: Any
    here: Any
    scope: _Scope


def _initial_taint() -> _Taint:
    return _Taint(
        io=_IO("top", (), ()),
        tick=np.int32(0),
        pos=None,
        here=np.int32(0),
        scope=_Scope(),
    )


def fenced(io: _IO) -> _IO:
    """`io` with its traced origins computed once, where they cross into or out of
    a sub-program. An origin is a few scalar operations on the flags of the checks
    before it; XLA fuses them into whatever uses them, so each origin that leaves
    separately would compute its history again (the compiled step ran 1.5 times
    slower). Here they leave packed in one vector (per set of varying manual
    axes) through one `optimization_barrier`: one kernel computes them all."""
    leaves, tree = jax.tree.flatten(io.origins, is_leaf=lambda x: isinstance(x, _Origin))
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Origin) and isinstance(leaf.w, Tracer):
            axes = {_varying(leaf.w), _varying(leaf.info)}
            if len(axes) == 1:
                groups.setdefault(axes.pop(), []).append(i)
    if not groups:
        return io
    for members in groups.values():
        parts = []
        for i in members:
            parts += [jax.lax.broadcast(leaves[i].w, (1,)), jnp.asarray(leaves[i].info)]
        packed = jax.lax.optimization_barrier(jax.lax.concatenate(parts, 0))
        start = 0
        for i in members:
            width = np.shape(leaves[i].info)[0]
            w = jax.lax.index_in_dim(packed, start, keepdims=False)
            info = jax.lax.slice_in_dim(packed, start + 1, start + 1 + width)
            leaves[i] = _Origin(w, info, leaves[i].external)
            start += 1 + width
    return _IO(io.role, io.counts, tuple(jax.tree.unflatten(tree, leaves)))


def _varying(value: Any) -> Any:
    """The manual mesh axes `value` varies over (inside a `shard_map`)."""
    return getattr(jax.typeof(value), "vma", frozenset())


def _float_origin(aval: Any, origin: Any) -> Any:
    return origin if _is_float_aval(aval) else _DATA


def _all_reduce(op: Callable[..., Any], value: Any) -> Any:
    if value.ndim == 0:
        return value
    return op(value, tuple(range(value.ndim)))


def _not_finite(value: Any, kinds: tuple[str, ...]) -> Any:
    """Elementwise, whether `value` is of `kinds` (a NaN, an Inf)."""
    if tuple(kinds) == ("nan",):
        return jnp.isnan(value)
    if tuple(kinds) == ("inf",):
        return jnp.isinf(value)
    return jnp.logical_not(jnp.isfinite(value))


def _finite(value: Any, kinds: tuple[str, ...] = ("nan", "inf")) -> Any:
    """Whether no element of `value` is of `kinds` (a NaN, an Inf: with both, whether
    every element is finite), a traced scalar."""
    if tuple(kinds) == ("inf",):
        return jax.lax.bitwise_not(_all_reduce(jax.lax.reduce_or, jnp.isinf(value)))
    if tuple(kinds) == ("nan",):
        return jax.lax.bitwise_not(_all_reduce(jax.lax.reduce_or, jnp.isnan(value)))
    if jnp.issubdtype(value.dtype, jnp.complexfloating):
        value = jnp.stack([jnp.real(value), jnp.imag(value)])
    return _all_reduce(jax.lax.reduce_and, jax.lax.is_finite(value))


def _finite_and_nan(value: Any, kinds: tuple[str, ...] = ("nan", "inf")) -> tuple[Any, Any]:
    """Whether no element of `value` is of `kinds` (see `_finite`), and whether one
    is a NaN.

    One pass: a reduction of both flags at once. (Not a `reduce_max` of the
    magnitudes: the maximum of a sharded array is combined across devices by an
    all-reduce that does not propagate NaNs on CPU, JAX 0.10.2.)
    """
    if tuple(kinds) == ("inf",):
        return _finite(value, kinds), np.bool_(False)
    if tuple(kinds) == ("nan",):
        fine = _finite(value, kinds)
        return fine, jax.lax.bitwise_not(fine)
    if value.ndim == 0 or jnp.issubdtype(value.dtype, jnp.complexfloating):
        return _finite(value), _all_reduce(jax.lax.reduce_or, jax.lax.ne(value, value))
    finite, nan = jax.lax.reduce(
        (jax.lax.is_finite(value), jax.lax.ne(value, value)),
        (np.bool_(True), np.bool_(False)),
        _and_or,
        tuple(range(value.ndim)),
    )
    return finite, nan


def _and_or(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    return jax.lax.bitwise_and(a[0], b[0]), jax.lax.bitwise_or(a[1], b[1])


def _earliest(origins: list[_Origin]) -> _Origin:
    """The origin with the smallest `w` (the first, on ties)."""
    # Origins made inside an `auto_axes` / `explicit_axes` region are typed for
    # that region's mesh variant.
    origins = to_current_mesh(origins)
    first = origins[0]
    for other in origins[1:]:
        later = jax.lax.lt(other.w, first.w)
        first = _Origin(
            jax.lax.min(first.w, other.w),
            jax.lax.select_n(later, first.info, other.info),
            first.external or other.external,
        )
    return first


def _concrete_finite(value: Any, kinds: tuple[str, ...] = ("nan", "inf")) -> bool:
    """Whether a constant is known (now, while tracing) to be finite."""
    if isinstance(value, Tracer) or not _is_float(value):
        return False
    array = np.asarray(value)
    # Large closed-over arrays are not copied to the host to find out.
    if array.size > 4096:
        return False
    bad = {"nan": np.isnan, "inf": np.isinf}
    return not any(bool(bad[kind](array).any()) for kind in kinds)


def _validated(origin: Any, value: Any, kinds: tuple[str, ...]) -> Any:
    """The origin of a part (a scan's slice, a shard's block) of a value of
    `origin`: the part may be finite."""
    if not isinstance(origin, _Origin):
        return origin
    return _Origin(
        jax.lax.select_n(_finite(value, kinds), origin.w, _FINE), origin.info, origin.external
    )


def _as_slot(origin: Any, aval: Any, length: int) -> Any:
    """`origin` as a loop carry or a branch output: traced, and `external`, so that
    every iteration and every branch give the same structure."""
    if not _is_float_aval(aval):
        return _DATA
    if isinstance(origin, _Origin):
        return _Origin(origin.w, origin.info, True)
    w = _FINE if origin is _FINITE else _UNKNOWN
    return _Origin(w, np.zeros((length,), np.int32), True)


def _merged_slot(acc: Any, origin: Any, aval: Any, length: int) -> Any:
    """A scan's stacked output: the earliest origin over the iterations so far."""
    if not _is_float_aval(aval):
        return _DATA
    return _earliest([acc, _as_slot(origin, aval, length)])


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


class _Flag:
    """A static boolean inside `_IO` (a Python bool would be a traced leaf)."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __bool__(self) -> bool:
        return self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Flag) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)
