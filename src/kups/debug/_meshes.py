"""The mesh the NaN reports' own arrays are typed for.

On a mesh with Explicit axes, JAX types every value for the mesh, and some of
its operations (`dynamic_update_slice`, a loop's carry) want their operands typed
for the same one. The reports' tables and buffers are made from constants, typed
for no mesh: they are typed for the mesh in effect (`jax.set_mesh`) or, where
none is (a jitted function given arrays placed on the mesh), for the mesh the
program's values are typed for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from jax.core import Tracer

from kups.effects import to_current_mesh


def mesh_of(avals: Iterable[Any]) -> Any:
    """The mesh in effect or, where none is, the first (non-empty) mesh one of
    `avals` is typed for; `None` when neither is."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for aval in avals:
        typed = getattr(getattr(aval, "sharding", None), "mesh", None)
        if typed is not None and not typed.empty:
            return typed
    return None


def on_mesh(tree: Any, mesh: Any) -> Any:
    """`tree` with each traced array typed for `mesh`: those typed for another
    variant of it retyped (`to_current_mesh`), those typed for no mesh made
    replicated over it. Without a `mesh`, `tree` as it is."""
    if mesh is None or mesh.empty:
        return tree

    def replicated(leaf: Any) -> Any:
        if isinstance(leaf, Tracer) and jax.typeof(leaf).sharding.mesh.empty:
            return jax.reshard(leaf, jax.sharding.PartitionSpec())
        return leaf

    with jax.sharding.use_abstract_mesh(mesh):
        return jax.tree.map(replicated, to_current_mesh(tree))


def for_mesh_of(value: Any, ref: Any) -> Any:
    """`value` typed for the mesh `ref` is (or the one in effect), for an update
    of `ref` (`dynamic_update_slice` wants both typed alike): an origin made from
    constants is typed for no mesh, a buffer of origins for the program's."""
    return on_mesh(value, mesh_of([jax.typeof(ref)]))
