"""Constants: a NaN computed from constants alone is part of the program (`jnp.var`
keeps one for an empty reduction and selects it away), not a finding.

Constants are tracked per jaxpr, and per call site into `jit` bodies: the
"frame" of a call is its body and which of its inputs are constants there.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal

from kups.effects import (
    CALL_PRIMITIVES,
    Handler,
    HandlerResult,
    Interpreter,
    sub_jaxprs,
)

from ._sites import _Frame, _Scope, widening_cast

_CONSTANTS: weakref.WeakKeyDictionary[
    Jaxpr, dict[tuple[bool, ...], tuple[frozenset[int], frozenset[Any]]]
] = weakref.WeakKeyDictionary()


def _constant_equations(
    jaxpr: Jaxpr, constant_inputs: tuple[bool, ...]
) -> tuple[frozenset[int], frozenset[Any]]:
    """The equations of `jaxpr` (by `id`) whose inputs are all constants, and the
    variables that hold constants, given which inputs are constants.

    Constants are literals, the jaxpr's own constants, the given inputs, and the
    outputs of equations with only constant inputs and no sub-program.
    """
    by_inputs = _CONSTANTS.setdefault(jaxpr, {})
    if constant_inputs in by_inputs:
        return by_inputs[constant_inputs]
    constant = set(jaxpr.constvars)
    constant.update(v for v, c in zip(jaxpr.invars, constant_inputs, strict=True) if c)
    equations = set()
    for eqn in jaxpr.eqns:
        if sub_jaxprs(eqn):
            continue
        if all(_is_literal(v) or v in constant for v in eqn.invars):
            equations.add(id(eqn))
            constant.update(eqn.outvars)
    result = frozenset(equations), frozenset(constant)
    by_inputs[constant_inputs] = result
    return result


def _is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


# Equations that move the elements of their input as they are: a constant made
# by one from finite values is finite.
_KEEPS_FINITE = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "copy", "copy_p"}
)


def keeps_finite(eqn: JaxprEqn) -> bool:
    """Whether `eqn`'s outputs are finite when its inputs are: it moves their
    elements, or casts them to a float dtype that holds them all."""
    name = eqn.primitive.name
    if name in _KEEPS_FINITE or widening_cast(eqn):
        return True
    if name != "convert_element_type":
        return False
    source, target = getattr(eqn.invars[0].aval, "dtype", None), eqn.params["new_dtype"]
    if source is None:
        return False
    if not jnp.issubdtype(target, jnp.floating):
        return False
    if source == jnp.bool_:
        return True
    return bool(
        jnp.issubdtype(source, jnp.integer) and jnp.iinfo(source).max <= jnp.finfo(target).max
    )


_FINITE: weakref.WeakKeyDictionary[Jaxpr, dict[Any, frozenset[Any]]] = weakref.WeakKeyDictionary()


def finite_atom(atom: Any, finite: set[Any] | frozenset[Any]) -> bool:
    """Whether `atom` is a literal that is not a NaN/Inf, or a variable in `finite`."""
    if not _is_literal(atom):
        return atom in finite
    value = np.asarray(atom.val)  # pyright: ignore[reportAttributeAccessIssue]
    return not np.issubdtype(value.dtype, np.inexact) or bool(np.isfinite(value).all())


def _finite_constants(frame: _Frame) -> frozenset[Any]:
    """The constants of `frame`'s jaxpr known to be finite while tracing: its
    inputs given finite, and what only moves their elements or those of finite
    literals (`jnp.where(m, x, 0.0)` broadcasts its `0.0` to an array)."""
    jaxpr, constant_inputs = frame.jaxpr, frame.constant_inputs
    by_inputs = _FINITE.setdefault(jaxpr, {})
    key = (constant_inputs, frame.finite_inputs)
    if key in by_inputs:
        return by_inputs[key]
    equations, _ = _constant_equations(jaxpr, constant_inputs)
    finite: set[Any] = {v for v, f in zip(jaxpr.invars, frame.finite_inputs, strict=False) if f}
    for eqn in jaxpr.eqns:
        if (
            keeps_finite(eqn)
            and id(eqn) in equations
            and all(finite_atom(v, finite) for v in eqn.invars)
        ):
            finite.update(eqn.outvars)
    result = by_inputs[key] = frozenset(finite)
    return result


def known_finite(frame: _Frame | None, atom: Any) -> bool:
    """Whether `atom`, of the jaxpr being run, is a finite literal or a constant
    known to be finite (see `_finite_constants`)."""
    if _is_literal(atom) or frame is None:
        return finite_atom(atom, frozenset())
    return atom in _finite_constants(frame)


def _is_constant(frame: _Frame | None, eqn: JaxprEqn) -> bool:
    """Whether every input of `eqn` is a constant: a literal, or (inside a call
    being interpreted) a constant of the call's body."""
    if all(_is_literal(v) for v in eqn.invars):
        return True
    if frame is None:
        return False
    equations, _ = _constant_equations(frame.jaxpr, frame.constant_inputs)
    return id(eqn) in equations


def _call_bodies(eqn: JaxprEqn) -> tuple[tuple[Jaxpr, ...], list[Any]]:
    """The bodies of a call-like equation and the inputs they take one to one: a
    call's sub-jaxpr that takes all the equation's inputs, or a `cond`'s
    branches, which take its operands. `()` for neither."""
    if eqn.primitive.name == "cond":
        return tuple(sub_jaxprs(eqn)), list(eqn.invars[1:])
    for jaxpr in sub_jaxprs(eqn):
        if len(jaxpr.invars) == len(eqn.invars):
            return (jaxpr,), list(eqn.invars)
    return (), []


# Primitives whose bodies take the equation's inputs (a `cond`: its operands) one
# to one.
_CALLS = CALL_PRIMITIVES | {"cond"}


def _in_frame(handler: Handler) -> Handler:
    """`handler` for a call (`jit`, `checkpoint`, ...) or a `cond`: the body (the
    branches) and which of its inputs are constants become the frame that
    `_FramingInterpreter` picks up when the handler interprets it."""

    def framed(interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]) -> Any:
        bodies, inputs = _call_bodies(eqn)
        outer = state.scope
        if not bodies or outer.frame is None:
            return handler(interpreter, state, eqn, invals)
        _, constant_vars = _constant_equations(outer.frame.jaxpr, outer.frame.constant_inputs)
        constant_inputs = tuple(_is_literal(v) or v in constant_vars for v in inputs)
        finite_inputs = tuple(known_finite(outer.frame, v) for v in inputs)
        first, *others = bodies
        frame = _Frame(first, constant_inputs, bodies if others else (), finite_inputs)
        inner = dataclasses.replace(outer, frame=frame)
        result = handler(interpreter, state._replace(scope=inner), eqn, invals)
        return HandlerResult(result.ctx._replace(scope=outer), result.outvals)

    return framed


class _FramingInterpreter(Interpreter):
    """An interpreter that makes every jaxpr it runs the current frame: the frame a
    call handler prepared for it (see `_in_frame`), or one whose inputs are not
    constants (a loop or branch body, the program itself)."""

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Any, ctx: Any, args: Any
    ) -> tuple[list[Any], Any]:
        if not isinstance(getattr(ctx, "scope", None), _Scope):
            return super().interpret_jaxpr(jaxpr, consts, ctx, args)
        outer = ctx.scope
        frame = outer.frame
        if frame is not None and frame.jaxpr is not jaxpr and _is_in(jaxpr, frame.branches):
            frame = _Frame(jaxpr, frame.constant_inputs, (), frame.finite_inputs)
        elif frame is None or frame.jaxpr is not jaxpr:
            frame = _Frame(jaxpr, (False,) * len(jaxpr.invars))
        inner = dataclasses.replace(outer, frame=frame)
        outs, ctx = super().interpret_jaxpr(jaxpr, consts, ctx._replace(scope=inner), args)
        return outs, ctx._replace(scope=outer)


def _is_in(jaxpr: Jaxpr, jaxprs: tuple[Jaxpr, ...]) -> bool:
    return any(jaxpr is other for other in jaxprs)
