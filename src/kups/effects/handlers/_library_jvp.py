"""The tangents of a library primitive by its own JVP rule, its primal not run again.

A primitive's JVP rule returns the primal outputs with the tangents, and the
rules of equinox filter primitives (lineax's `linear_solve`) compute them by
binding the primitive again on the same inputs. kups has already run the
primitive (its implementation, interpreted), so the rule is traced to a jaxpr,
and the equation that re-binds the primitive on the primal inputs with the same
parameters is replaced by the outputs kups computed: the implementation runs
once, and every other equation of the rule (the tangent solves, their operator
applications) is bound as the rule wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import JaxprEqn
from jax.interpreters import ad

from .. import _compat

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


def rule_tangents(
    eqn: JaxprEqn, primals: Sequence[Any], tangents: Sequence[Any], outs: Sequence[Any]
) -> list[Any]:
    """The output tangents of `eqn`'s primitive at `primals` (whose outputs are
    `outs`) along `tangents` (symbolic zeros where not perturbed), by the
    primitive's JVP rule; zero outputs as symbolic zeros."""
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

    jaxpr, _, consts = _compat.trace_to_jaxpr(
        traced_rule, [*avals, *tangent_avals], f"{primitive.name} jvp"
    )
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, [*primals, *(t for t, p in zip(tangents, perturbed) if p)]))
    primal_vars = jaxpr.invars[:num_primals]
    substituted = False
    for inner in jaxpr.eqns:
        if not substituted and _is_primal_rebind(inner, eqn, primal_vars):
            outvals = list(outs)
            substituted = True
        else:
            invals = [v.val if _compat.is_literal(v) else env[v] for v in inner.invars]  # pyright: ignore[reportAttributeAccessIssue]
            with inner.ctx.manager:
                outvals = _compat.bind_equation(inner.primitive, inner.params, invals)
        env.update(zip(inner.outvars, outvals, strict=True))
    given = iter(v.val if _compat.is_literal(v) else env[v] for v in jaxpr.outvars)  # pyright: ignore[reportAttributeAccessIssue]
    out_avals = [_compat.aval_of(o) for o in outs]
    return [
        _SymbolicZero(a.to_tangent_aval()) if zero else next(given)
        for a, zero in zip(out_avals, zero_outs, strict=True)
    ]
