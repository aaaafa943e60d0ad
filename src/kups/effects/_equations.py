"""Facts about an equation that handlers need and that JAX spells differently
between releases."""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import JaxprEqn

from . import _compat, _source


def source_line(eqn: JaxprEqn) -> str:
    """Where the user's code produced `eqn`: `"file.py:LINE (function)"`.

    **Arguments:**

    - `eqn`: an equation, as handlers receive it.

    **Returns:**

    The innermost user frame of the equation's traceback, or `"unknown"`: JAX
    keeps no user frame for the equations inside the jitted body of a `jnp`
    function or of a library's function. For those,
    `kups.effects.toolkit.source_of(eqn, position.enclosing)` gives the line of
    the control flow around them, which `track_position` keeps.

    `eqn.source_info.name_stack`, beside it, is relative too: inside a loop,
    `cond`, `checkpoint` or `jit` body it holds the scopes entered in that
    body, not those around the control-flow equation.
    """
    return _source.source_line(eqn)


def source_location(eqn: JaxprEqn) -> tuple[str, int] | None:
    """`(file, line)` of the user's code that produced `eqn`, or `None`."""
    return _source.user_frame(eqn)


def shard_map_axes(eqn: JaxprEqn) -> tuple[Any, tuple[Any, ...]]:
    """The mesh of a `shard_map` equation and the axes its body makes manual, in
    mesh order.

    **Arguments:**

    - `eqn`: a `shard_map` equation.

    **Returns:**

    `(mesh, manual_axes)`; `manual_axes` is a subset of `mesh.axis_names` for a
    partial-manual body.
    """
    if eqn.primitive.name != "shard_map":
        raise ValueError(f"shard_map_axes needs a shard_map equation, got {eqn.primitive.name!r}.")
    mesh = eqn.params["mesh"]
    manual = _compat.shard_map_manual_axes(eqn.params)
    return mesh, tuple(a for a in mesh.axis_names if a in manual)


def varying_axes(value: Any) -> frozenset[Any]:
    """The manual mesh axes over which a value may differ between shards.

    Inside a `shard_map` body (with `check_vma=True`), JAX tracks for each value
    the manual axes along which it varies; outside, the set is empty.

    **Arguments:**

    - `value`: an array, a tracer, an abstract value (`jax.typeof(x)`,
      `eqn.invars[i].aval`) or a `jax.ShapeDtypeStruct` (such as an
      `Uninitialized` context leaf).

    **Returns:**

    A `frozenset` of mesh axis names.
    """
    if isinstance(value, (jax.ShapeDtypeStruct, _compat.ShapedArray)):
        return _compat.varying_axes(value)
    return _compat.varying_axes(_compat.aval_of(value))


def to_current_mesh(tree: Any, eqn: JaxprEqn | None = None) -> Any:
    """`tree` with each array typed for the abstract mesh in effect.

    Inside `jax.sharding.auto_axes` / `explicit_axes`, JAX runs operations under
    a variant of the mesh with other axis types and rejects operands typed for
    another variant. The interpreter moves the context along with the program;
    a handler that keeps arrays of its own elsewhere (made in one region, used
    in another) can bring them over with this. Arrays typed for no mesh, or for
    an unrelated one, are returned as they are.

    **Arguments:**

    - `tree`: a pytree; its leaves that are arrays are retyped.
    - `eqn`: the equation being handled. Where no mesh is in effect (the region's
      mesh came from its arguments' shardings), the arrays are typed for the mesh
      of `eqn`'s values instead.

    **Returns:**

    The same pytree, each array typed for `jax.sharding.get_abstract_mesh()`.
    """
    mesh = _compat.current_mesh()
    if mesh.empty and eqn is not None:
        mesh = _compat.values_mesh(eqn)
    if mesh is None or mesh.empty:
        return tree
    return jax.tree.map(lambda leaf: _compat.retype_for_mesh(leaf, mesh), tree)
