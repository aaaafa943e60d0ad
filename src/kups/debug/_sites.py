"""The sites: the equations `kups.debug` can report, registered while tracing
(primitive, source line, loops and manual mesh axes around them), and the
static scope of the equation being interpreted."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from kups.effects import (
    Handler,
    source_location,
)


@dataclasses.dataclass(frozen=True)
class _Site:
    """An equation that can produce a NaN, as registered while tracing.

    `loop_depth` is the number of loops around it, `manual_axes` the manual mesh
    axes around it and `mesh_axes` all axes of their mesh, both `((name, size), ...)`
    in mesh order.
    """

    primitive: str
    file: str | None
    line: int | None
    loop_depth: int
    manual_axes: tuple[tuple[Any, int], ...]
    mesh_axes: tuple[tuple[Any, int], ...]


@dataclasses.dataclass(frozen=True)
class _Scope:
    """Static facts about where the current equation is (a static context leaf):
    the manual mesh axes around it, all axes of their mesh, and the innermost call
    (`jit`, `checkpoint`, ...) being interpreted, with which of its inputs are
    constants there."""

    manual_axes: tuple[tuple[Any, int], ...] = ()
    mesh_axes: tuple[tuple[Any, int], ...] = ()
    frame: _Frame | None = None
    # Used by report="reaching" only: the number of loops around the equation, and
    # whether the jaxpr being run is passive (it has no floating output, so nothing
    # it computes can reach one: its equations are only re-bound).
    loop_depth: int = 0
    passive: bool = False


@dataclasses.dataclass(frozen=True)
class _Frame:
    """A call's body and which of its inputs are constants at the call site. For a
    `cond`, `branches` are all its branches, which take the same inputs: the
    frame of the one that runs is made when it does."""

    jaxpr: Jaxpr
    constant_inputs: tuple[bool, ...]
    branches: tuple[Jaxpr, ...] = ()
    # Which inputs are constants known to be finite (a literal `0.0` passed in).
    finite_inputs: tuple[bool, ...] = ()


class _Sites:
    """The equations checked during one trace, by index."""

    def __init__(self, kinds: tuple[str, ...] = ("nan", "inf")) -> None:
        self.sites: list[_Site] = []
        # What is watched: NaNs, Infs or both.
        self.kinds = kinds
        # The source of the control-flow equations being interpreted, innermost
        # last: the fallback for an equation with no user frame of its own (JAX
        # keeps none for `lax.cond(p, jnp.log, ...)`, whose branch is jnp's code).
        self.enclosing: list[tuple[str, int]] = []

    def add(self, eqn: JaxprEqn, state: Any) -> int:
        return self.add_at(eqn, state.position.depth, state.scope)

    def add_at(self, eqn: JaxprEqn, loop_depth: int, scope: _Scope) -> int:
        """Registers `eqn` as a site inside `loop_depth` loops, in `scope`."""
        location = source_location(eqn) or (self.enclosing[-1] if self.enclosing else None)
        file, line = location if location is not None else (None, None)
        self.sites.append(
            _Site(eqn.primitive.name, file, line, loop_depth, scope.manual_axes, scope.mesh_axes)
        )
        return len(self.sites) - 1


def _is_float(value: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(value), jnp.inexact)


def _located(sites: _Sites, handler: Handler) -> Handler:
    """`handler`, with its equation's source the enclosing one while it runs."""

    def located(interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]) -> Any:
        location = source_location(eqn)
        if location is None:
            return handler(interpreter, state, eqn, invals)
        sites.enclosing.append(location)
        try:
            return handler(interpreter, state, eqn, invals)
        finally:
            sites.enclosing.pop()

    return located


def _is_float_aval(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def widening_cast(eqn: JaxprEqn) -> bool:
    """Whether `eqn` converts floats to a float dtype that holds each of them, so
    that it makes no Inf and keeps every NaN and Inf."""
    if eqn.primitive.name != "convert_element_type":
        return False
    source = getattr(eqn.invars[0].aval, "dtype", None)
    target = eqn.params["new_dtype"]
    floats = source is not None and all(jnp.issubdtype(d, jnp.floating) for d in (source, target))
    return floats and bool(jnp.finfo(target).max >= jnp.finfo(source).max)


def gathers_only(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a `gather` that takes elements of its operand only (`x[i]`),
    not one that fills out-of-bounds indices with a value (`mode="fill"`, a NaN for
    floats by default)."""
    return (
        eqn.primitive.name == "gather"
        and eqn.params.get("mode") != jax.lax.GatherScatterMode.FILL_OR_DROP
    )


def keeps_elements(eqn: JaxprEqn) -> bool:
    """Whether `eqn` gives each output element one of its inputs' as it is, negated
    or in absolute value (`neg`, `abs` of real numbers, `sort`): it makes no
    NaN/Inf and drops none."""
    name = eqn.primitive.name
    if name == "abs":
        dtype = getattr(eqn.invars[0].aval, "dtype", None)
        return dtype is not None and not jnp.issubdtype(dtype, jnp.complexfloating)
    return name in ("neg", "sort")


def collective_axes(params: Any) -> tuple[Any, ...]:
    """The mesh axes a collective's params (`axes`, `axis_name`) name, without
    the positional axes of a `vmap`."""
    axes = params.get("axes", params.get("axis_name", ()))
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    return tuple(a for a in axes if not isinstance(a, int))


def scan_layout(eqn: JaxprEqn) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a scan, from the shapes alone (a carry and a
    const have the same shape outside and inside the body; an `xs` or a `ys`
    gains the leading `length` axis)."""
    body = eqn.params["jaxpr"]
    body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
    num_carry = 0
    for outer, inner in zip(eqn.outvars, body.outvars, strict=True):
        if _shape_of(outer) != _shape_of(inner):
            break
        num_carry += 1
    num_unstacked = 0
    for outer, inner in zip(eqn.invars, body.invars, strict=True):
        if _shape_of(outer) != _shape_of(inner):
            break
        num_unstacked += 1
    return num_unstacked - num_carry, num_carry


def _shape_of(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))
