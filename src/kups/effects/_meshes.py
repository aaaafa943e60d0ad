"""The abstract mesh the context's arrays are typed for, along one jaxpr.

Inside an `auto_axes` or `explicit_axes` region, equations run under a variant of
the mesh with other axis types, and JAX rejects an operation (a handler's, on the
context) whose operands are typed for another one. So the context's arrays follow
the program into the region and out of it, as `auto_axes` reshards the user's
values. Out of a region into code traced with no mesh in effect (the region's mesh
came from its arguments), they go back to the mesh they had before it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax.extend.core import JaxprEqn

from . import _compat

_NO_SCOPE = contextlib.nullcontext()


class ContextMesh:
    """Tracks the mesh of the context while an interpreter walks one jaxpr.

    `enter(eqn, ctx)` before each equation retypes the context for the equation's
    mesh and gives the scope to run the equation (and its handler) in; `leave(ctx)`
    after the last one types the context back for the mesh the jaxpr started in.
    """

    __slots__ = ("current", "home", "start")

    def __init__(self) -> None:
        self.start = self.current = _compat.current_mesh()
        # The mesh the context was typed for before the first region changed it.
        self.home: Any = None

    def enter(self, eqn: JaxprEqn, ctx: Any) -> tuple[Any, Any]:
        """`(ctx, scope)`: the context typed for the mesh `eqn` runs under, and the
        context manager to run the equation in."""
        current = self.current
        eqn_mesh = _compat.equation_mesh(eqn)
        if eqn_mesh is current:
            return ctx, _NO_SCOPE
        # Staged under the enclosing mesh inside a shard_map body: the equation
        # runs, and its handler sees the context, under the body's.
        keep = _compat.drops_manual_axes(eqn_mesh, current)
        if keep:
            eqn_mesh = current
        elif eqn_mesh != current:
            if self.home is None:
                self.home = current if not current.empty else _typed_mesh(ctx)
            target = eqn_mesh
            if eqn_mesh.empty:  # type the context like the values it meets here
                target = _compat.values_mesh(eqn) or self.home
            ctx = retyped(ctx, target)
            self.current = eqn_mesh
        return ctx, (_compat.abstract_mesh(current) if keep else _NO_SCOPE)

    def leave(self, ctx: Any) -> Any:
        """The context typed for the mesh the jaxpr started in."""
        start = self.start
        if self.current is start or self.current == start:
            return ctx
        return retyped(ctx, start if not start.empty else self.home)


def _typed_mesh(ctx: Any) -> Any:
    """The mesh the context's first array typed for one is typed for, if any."""
    for leaf in jax.tree.leaves(ctx):
        mesh = _compat.typed_mesh(leaf)
        if mesh is not None:
            return mesh
    return None


def retyped(ctx: Any, mesh: Any) -> Any:
    """The context with its arrays typed for `mesh` (unchanged for `None`)."""
    if mesh is None:
        return ctx
    return jax.tree.map(lambda leaf: _compat.retype_for_mesh(leaf, mesh), ctx)
