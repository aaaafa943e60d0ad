"""Where an equation runs: how deep loops nest around it, and which shard.

The position and shard machinery of `kups.debug` in one place: loop depths of
sub-programs (to give loop carries a fixed shape), each shard's index in the
mesh as a value sharded into a `shard_map` body (no `axis_index` needed: JAX
before 0.10.2 cannot lower one inside a nested `shard_map`), and collectives
one axis at a time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params

from kups.effects import (
    contains_subjaxprs,
)

# A shard key larger than any shard's linear index: "no NaN on this shard".
_NO_SHARD = 2**31 - 1


_LOOPS = frozenset({"scan", "while"})


_LOOP_DEPTH: weakref.WeakKeyDictionary[Jaxpr, int] = weakref.WeakKeyDictionary()


def _subjaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    for sub in jaxprs_in_params(eqn.params):
        yield sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def _eqn_loop_depth(eqn: JaxprEqn) -> int:
    """How deep loops nest in `eqn`, itself included."""
    if not contains_subjaxprs(None, eqn, []):
        return 0
    inner = max((_loop_depth(sub) for sub in _subjaxprs(eqn)), default=0)
    return inner + (eqn.primitive.name in _LOOPS)


def _loop_depth(jaxpr: Jaxpr) -> int:
    """How deep loops nest in `jaxpr` and its sub-programs."""
    depth = _LOOP_DEPTH.get(jaxpr)
    if depth is None:
        depth = max((_eqn_loop_depth(eqn) for eqn in jaxpr.eqns), default=0)
        _LOOP_DEPTH[jaxpr] = depth
    return depth


def _all_axes(reduce: Callable[[Any, Any], Any], value: Any, axes: tuple[Any, ...]) -> Any:
    # One axis at a time: a collective over an axis tuple along some of which the
    # value is varying and along others invariant is an error in JAX 0.10.
    if value.size == 0:
        # Nothing to reduce (the iterations outside any loop). A fresh constant is
        # what the collective would give, invariant; XLA 0.11.2 crashes compiling
        # a collective over an empty array.
        return jnp.zeros(value.shape, value.dtype)
    for axis in axes:
        value = reduce(value, axis)
    return value


def _shard_indices(
    offset: Any, mesh_axes: tuple[tuple[Any, int], ...], manual: tuple[Any, ...]
) -> Any:
    """Every shard's index in the mesh, `offset` plus the part of the `manual` axes,
    as an array with one dimension per manual axis (mesh order) to shard over them."""
    strides, stride = {}, 1
    for name, size in reversed(mesh_axes):
        strides[name] = stride
        stride *= size
    sizes = dict(mesh_axes)
    index = jnp.asarray(offset, jnp.int32).reshape(())
    for position, name in enumerate(manual):
        shape = [1] * len(manual)
        shape[position] = sizes[name]
        part = jnp.arange(sizes[name], dtype=jnp.int32) * strides[name]
        index = index + part.reshape(shape)
    return index


def _spec_names(spec: Any) -> set[Any]:
    names: set[Any] = set()
    for entry in spec if spec is not None else ():
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names
