"""Where an equation runs, for what the toolkit's `Position` does not cover.

`report="first"` and `nan_sites` keep the toolkit's `Position`; what is here
serves the `report="reaching"` walk, whose packed position array orders NaN
origins, and the per-site records of `nan_sites`: loop depths of sub-programs
(to give loop carries a fixed shape), each shard's index in the mesh as a value
sharded into a `shard_map` body (no `axis_index` needed: JAX before 0.10.2
cannot lower one inside a nested `shard_map`), a shard's coordinates from that
index, and the first shard elementwise (`reduce_shards` rounds).
"""

from __future__ import annotations

import weakref
from typing import Any

import jax.numpy as jnp
from jax.extend.core import Jaxpr, JaxprEqn

from kups.effects import reduce_shards, sub_jaxprs

# A shard key larger than any shard's linear index: "no NaN on this shard".
_NO_SHARD = 2**31 - 1


_LOOPS = frozenset({"scan", "while"})


_LOOP_DEPTH: weakref.WeakKeyDictionary[Jaxpr, int] = weakref.WeakKeyDictionary()


def _eqn_loop_depth(eqn: JaxprEqn) -> int:
    """How deep loops nest in `eqn`, itself included."""
    subs = sub_jaxprs(eqn)
    if not subs:
        return 0
    return max(_loop_depth(sub) for sub in subs) + (eqn.primitive.name in _LOOPS)


def _loop_depth(jaxpr: Jaxpr) -> int:
    """How deep loops nest in `jaxpr` and its sub-programs."""
    depth = _LOOP_DEPTH.get(jaxpr)
    if depth is None:
        depth = max((_eqn_loop_depth(eqn) for eqn in jaxpr.eqns), default=0)
        _LOOP_DEPTH[jaxpr] = depth
    return depth


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


def _shard_coordinates(
    index: int, manual_axes: tuple[tuple[Any, int], ...], mesh_axes: tuple[tuple[Any, int], ...]
) -> dict[Any, int]:
    """`{axis: coordinate}` over `manual_axes` of the shard of row-major `index` in
    the mesh of `mesh_axes`."""
    coordinates: dict[Any, int] = {}
    for name, size in reversed(mesh_axes):
        index, coordinates[name] = divmod(index, size)
    return {name: coordinates[name] for name, _ in manual_axes}


def _loop_start(eqn: JaxprEqn) -> tuple[int, int]:
    """The first value of a loop's iteration counter and its step: a reversed scan
    counts down from `length - 1`, so that iteration `i` is the one of `xs[i]`."""
    if eqn.primitive.name == "scan" and eqn.params.get("reverse", False):
        return int(eqn.params["length"]) - 1, -1
    return 0, 1


def _first_shard(found: Any, keys: list[Any], own: Any, manual: tuple[Any, ...]) -> Any:
    """Where this shard holds the first event over the `manual` axes: among shards
    with `found`, the smallest `keys` (compared in order, elementwise), then the
    first shard in mesh order (`own` is the shard's index in the mesh). True on
    exactly one shard for each element that any shard found."""
    # `where` on the shard index makes the values varying, as the collectives need.
    chosen = found & (own >= 0)
    for key in (*keys, own):
        value = jnp.where(chosen, key, _NO_SHARD)
        chosen = chosen & (value == reduce_shards(value, manual, op="min"))
    return chosen


def _pick(chosen: Any, value: Any, manual: tuple[Any, ...]) -> Any:
    """`value` of the shard where `chosen` (elementwise over `chosen`'s shape,
    leading axes of `value`), on every shard; 0 where no shard is chosen."""
    mask = chosen.reshape(chosen.shape + (1,) * (value.ndim - chosen.ndim))
    return reduce_shards(jnp.where(mask, value, jnp.zeros_like(value)), manual, op="sum")
