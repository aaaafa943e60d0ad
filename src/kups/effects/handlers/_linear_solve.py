"""`custom_linear_solve`: the solve is interpreted once, the derivatives are JAX's
implicit ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._types import HandlerResult
from ._custom_derivatives import _zero_tangent

_SymbolicZero = _compat.symbolic_zero_type()


def default_custom_linear_solve_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the `solve` sub-program of `lax.custom_linear_solve` with the
    context; the solution is the interpreted solve's, and its derivatives are JAX's.

    Handlers see every equation of the primal solve (which calls `matvec`), and
    what they change there reaches the solution. The solve runs once, so an
    ordered effect inside it runs once, as in plain JAX. Differentiating gives
    JAX's implicit derivative, evaluated at that solution: the tangent solves
    `A dx = db - dA x` with the original primitive (so reverse mode goes through
    `transpose_solve`), never through the solver's own iterations. The context
    carries no tangent (its tangents are zero), as through `custom_jvp`.
    """
    _compat.check_params(eqn)
    lengths = eqn.params["const_lengths"]
    start = lengths.matvec + lengths.vecmat
    num_params = sum(lengths)
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, eqn.params["jaxprs"].solve, spec, name="linear_solve")

    def solve(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, [*args[start : start + lengths.solve], *args[num_params:]])

    def solve_jvp(primals: Any, tangents: Any) -> Any:
        ctx_values, args = primals
        _, arg_tangents = tangents
        ctx_out, outs = solve(ctx_values, args)
        ctx_tangents = [_zero_tangent(a) for a in body.ctx_out.avals]
        return (ctx_out, outs), (ctx_tangents, _implicit_tangents(eqn, args, arg_tangents, outs))

    wrapped = jax.custom_jvp(solve)
    wrapped.defjvp(solve_jvp, symbolic_zeros=True)
    ctx_out, outs = wrapped(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))


def _implicit_tangents(
    eqn: JaxprEqn, args: Sequence[Any], tangents: Sequence[Any], outs: Sequence[Any]
) -> list[Any]:
    """The tangents of the solution `outs` (then the solve's aux outputs, which get
    zeros), as JAX's rule for `custom_linear_solve` gives them: `dx` solves
    `A dx = db - dA x`, where `dA x` differentiates `matvec` in its perturbed
    constants only."""
    lengths = eqn.params["const_lengths"]
    num_params = sum(lengths)
    params, b_tangents = list(args[:num_params]), list(tangents[num_params:])
    num_x = len(b_tangents)
    x = list(outs[:num_x])
    aux_tangents = [_zero_tangent(_compat.aval_of(v)) for v in outs[num_x:]]
    matvec = list(params[: lengths.matvec])
    perturbed = [
        i for i, t in enumerate(tangents[: lengths.matvec]) if not isinstance(t, _SymbolicZero)
    ]
    if not perturbed and all(isinstance(t, _SymbolicZero) for t in b_tangents):
        return [*(_zero_tangent(_compat.aval_of(v)) for v in x), *aux_tangents]
    rhs = [
        _zero_tangent(_compat.aval_of(v)) if isinstance(t, _SymbolicZero) else t
        for t, v in zip(b_tangents, x, strict=True)
    ]
    if perturbed:
        matvec_jaxpr, matvec_consts = _compat.open_jaxpr(eqn.params["jaxprs"].matvec)

        def apply(*chosen: Any) -> list[Any]:
            consts = list(matvec)
            for i, value in zip(perturbed, chosen, strict=True):
                consts[i] = value
            return _compat.eval_jaxpr(matvec_jaxpr, [*consts, *x], matvec_consts)

        _, dax = jax.jvp(
            apply,
            tuple(matvec[i] for i in perturbed),
            tuple(tangents[i] for i in perturbed),
        )
        rhs = [
            jax.lax.neg(d) if isinstance(t, _SymbolicZero) else jax.lax.add(t, jax.lax.neg(d))
            for t, d in zip(b_tangents, dax, strict=True)
        ]
    dx = _compat.bind_equation(eqn.primitive, eqn.params, [*params, *rhs])
    return [*dx[:num_x], *aux_tangents]
