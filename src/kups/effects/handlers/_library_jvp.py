"""The tangents of a library primitive by its own JVP rule, its primal not run again.

A primitive's JVP rule returns the primal outputs with the tangents, and the
rules of equinox filter primitives (lineax's `linear_solve`) compute them by
binding the primitive again on the same inputs. kups has already run the
primitive (its implementation, interpreted), so the rule is traced to a jaxpr,
and the equation that re-binds the primitive on the primal inputs with the same
parameters is replaced by the outputs kups computed: the implementation runs
once, and every other equation of the rule (the tangent solves, their operator
applications) is bound as the rule wrote it.

An effect that substitutes values (`plant`) must reach those tangent solves too:
the rule then runs under the interpreter (see `Interpreted`), and its tangents,
which come through the primitive's implementation rather than the primitive,
are forward-mode only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import JaxprEqn, Primitive
from jax.interpreters import ad, batching, mlir

from .. import _compat
from .._effect import seen
from .._source import where
from ._custom_derivatives import acts_inside

_SymbolicZero = _compat.symbolic_zero_type()
_PLAIN_TYPES = (bool, int, float, complex, str, bytes, type(None), np.generic)


def jvp_rule(eqn: JaxprEqn) -> Any:
    """The JVP rule JAX has for `eqn`'s primitive, or `None`."""
    return ad.primitive_jvps.get(eqn.primitive)


def _is_output_collector(value: Any) -> bool:
    """Equinox's `Flatten`: a parameter that records the structure of the outputs
    when the primitive is bound, a new object at every bind."""
    return callable(getattr(value, "called", None)) and callable(getattr(value, "get", None))


def same_params(a: Any, b: Any, depth: int = 8) -> bool:
    """Whether two parameter values are the same: the same object, equal plain
    values or trees (tuples, dicts) of them, or two output collectors (see
    `_is_output_collector`). Anything else (functions, jaxprs) only when it is
    the same object."""
    if a is b:
        return True
    if type(a) is not type(b) or depth == 0:
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_params(x, y, depth - 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_params(a[k], b[k], depth - 1) for k in a)
    if _is_output_collector(a):
        return True
    if isinstance(a, (*_PLAIN_TYPES, jax.tree_util.PyTreeDef)):
        return bool(a == b)
    # Objects that define their own equality (equinox modules, shape structs); a
    # comparison that does not give a Python bool (an array) is not sameness.
    if type(a).__eq__ is object.__eq__:
        return False
    result = a == b
    return isinstance(result, (bool, np.bool_)) and bool(result)


def _is_primal_rebind(inner: JaxprEqn, eqn: JaxprEqn, primal_vars: Sequence[Any]) -> bool:
    return (
        inner.primitive is eqn.primitive
        and len(inner.invars) == len(primal_vars)
        and all(a is b for a, b in zip(inner.invars, primal_vars))
        and inner.params.keys() == eqn.params.keys()
        and all(same_params(inner.params[k], eqn.params[k]) for k in eqn.params)
    )


class Interpreted(NamedTuple):
    """How a rule runs under an interpreter: from `ctx`, traced inside
    `tracing(ctx)` when given, interpreted when it binds an effect the
    interpreter acts on and `needed` accepts (see `default_custom_jvp_handler`)."""

    interpreter: Any
    ctx: Any
    tracing: Callable[[Any], AbstractContextManager[Any]] | None
    needed: Callable[[Any, JaxprEqn], bool] | bool


def rule_tangents(
    eqn: JaxprEqn,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    outs: Sequence[Any],
    interpreted: Interpreted | None = None,
) -> list[Any]:
    """The output tangents of `eqn`'s primitive at `primals` (whose outputs are
    `outs`) along `tangents` (symbolic zeros where not perturbed), by the
    primitive's JVP rule; zero outputs as symbolic zeros. With `interpreted`,
    the rule runs under its interpreter when it binds an effect that one acts
    on (a planted sow in the operator of lineax's tangent solves)."""
    primitive = eqn.primitive
    rule = jvp_rule(eqn)
    if rule is None:
        raise NotImplementedError(f"Differentiation rule for '{primitive.name}' not implemented")
    perturbed = [not isinstance(t, _SymbolicZero) for t in tangents]
    avals = [_compat.aval_of(p) for p in primals]
    tangent_avals = [a.to_tangent_aval() for a, p in zip(avals, perturbed) if p]
    num_primals = len(primals)
    zero_outs: list[bool] = []

    def traced_rule(*args: Any) -> list[Any]:
        given = iter(args[num_primals:])
        rule_tangents = [
            next(given) if p else ad.Zero(a.to_tangent_aval()) for a, p in zip(avals, perturbed)
        ]
        # Tuples, as JAX passes them (equinox's `vprim` rule vmaps over them with
        # its params' batch axes, a tuple).
        _, out_tangents = rule(tuple(args[:num_primals]), tuple(rule_tangents), **eqn.params)
        if not primitive.multiple_results:
            out_tangents = [out_tangents]
        zero_outs.extend(type(t) is ad.Zero for t in out_tangents)
        return [t for t in out_tangents if type(t) is not ad.Zero]

    with contextlib.ExitStack() as tracing:
        if interpreted is not None:
            # Effects bound while tracing are the interpreter's to see.
            tracing.enter_context(seen())
            if interpreted.tracing is not None:
                tracing.enter_context(interpreted.tracing(interpreted.ctx))
        jaxpr, _, consts = _compat.trace_to_jaxpr(
            traced_rule, [*avals, *tangent_avals], f"{primitive.name} jvp"
        )
    inputs = [*primals, *(t for t, p in zip(tangents, perturbed) if p)]
    if interpreted is not None and acts_inside(
        interpreted.interpreter,
        _compat.new_closed_jaxpr(jaxpr, consts),
        interpreted.ctx,
        interpreted.needed,
    ):
        results = _run_interpreted(interpreted, eqn, jaxpr, consts, inputs, outs)
        # Linear in the tangents, but through the primitive's implementation
        # (the interpreter goes inside its tangent solves), which JAX cannot
        # transpose: `jax.grad` gets a clear error instead of JAX's.
        if results:
            results = _forward_only_p.bind(*results, where=where(eqn))
    else:
        results = _run(eqn, jaxpr, consts, inputs, outs)
    given = iter(results)
    out_avals = [_compat.aval_of(o) for o in outs]
    return [
        _SymbolicZero(a.to_tangent_aval()) if zero else next(given)
        for a, zero in zip(out_avals, zero_outs, strict=True)
    ]


def _primal_rebind(eqn: JaxprEqn, jaxpr: Any, num_primals: int) -> int | None:
    """The index of the rule's equation that binds `eqn`'s primitive again on its
    primal inputs, if it has one."""
    primal_vars = jaxpr.invars[:num_primals]
    for i, inner in enumerate(jaxpr.eqns):
        if _is_primal_rebind(inner, eqn, primal_vars):
            return i
    return None


def _run(
    eqn: JaxprEqn, jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any], outs: Sequence[Any]
) -> list[Any]:
    """The rule's jaxpr evaluated, its primal re-bind replaced by `outs`."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, inputs, strict=True))
    rebind = _primal_rebind(eqn, jaxpr, len(eqn.invars))
    for i, inner in enumerate(jaxpr.eqns):
        if i == rebind:
            outvals = list(outs)
        else:
            invals = [v.val if _compat.is_literal(v) else env[v] for v in inner.invars]  # pyright: ignore[reportAttributeAccessIssue]
            with inner.ctx.manager:
                outvals = _compat.bind_equation(inner.primitive, inner.params, invals)
        env.update(zip(inner.outvars, outvals, strict=True))
    return [v.val if _compat.is_literal(v) else env[v] for v in jaxpr.outvars]  # pyright: ignore[reportAttributeAccessIssue]


def _run_interpreted(
    interpreted: Interpreted,
    eqn: JaxprEqn,
    jaxpr: Any,
    consts: Sequence[Any],
    inputs: Sequence[Any],
    outs: Sequence[Any],
) -> list[Any]:
    """The rule's jaxpr run under the interpreter (whose changes to the context
    are dropped), its primal re-bind replaced by `outs`: that re-bind's outputs
    become inputs of the jaxpr."""
    eqns = list(jaxpr.eqns)
    rebind = _primal_rebind(eqn, jaxpr, len(eqn.invars))
    given: list[Any] = []
    extra: list[Any] = []
    if rebind is not None:
        for var, out in zip(eqns.pop(rebind).outvars, outs, strict=True):
            if not isinstance(var, _compat.DropVar):
                extra.append(var)
                given.append(out)
    opened = _compat.replace_jaxpr(
        jaxpr, constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars, *extra], eqns=eqns
    )
    results, _ = interpreted.interpreter(
        _compat.new_closed_jaxpr(opened, ()), interpreted.ctx, *consts, *inputs, *given
    )
    return list(results)


# An identity on the tangents of an interpreted rule whose transposition is
# refused: see `rule_tangents`.
_forward_only_p = Primitive("kups_forward_only")
_forward_only_p.multiple_results = True
_forward_only_p.def_impl(lambda *args, where: list(args))
_forward_only_p.def_abstract_eval(lambda *avals, where: list(avals))
batching.primitive_batchers[_forward_only_p] = lambda args, dims, where: (
    _forward_only_p.bind(*args, where=where),
    list(dims),
)
ad.primitive_jvps[_forward_only_p] = lambda primals, tangents, where: (
    _forward_only_p.bind(*primals, where=where),
    list(tangents),
)
mlir.register_lowering(_forward_only_p, lambda ctx, *args, where: list(args))


def _refuse_transpose(cotangents: Any, *args: Any, where: str) -> list[Any]:
    raise NotImplementedError(
        f"Reverse-mode differentiation (jax.grad, jax.vjp) of the library "
        f"{where} is not supported when the interpreter acts on an effect inside it (a "
        f"sow that `plant` plants in a lineax operator's function, say). Its tangents "
        f"come from the library's derivative rule run under the interpreter, through "
        f"the primitive's implementation, which JAX cannot transpose; the library's "
        f"own transpose would use the function without the interpreter's change. "
        f"Forward mode (jax.jvp, jax.jacfwd) works. For reverse mode, move the effect "
        f"out of the library call: sow the value outside the function and pass it in "
        f"(as part of the operator, say)."
    )


ad.primitive_transposes[_forward_only_p] = _refuse_transpose
