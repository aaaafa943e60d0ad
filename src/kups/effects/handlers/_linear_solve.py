"""`custom_linear_solve`: effects of the solve are seen, the solution is JAX's."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._types import HandlerResult


def default_custom_linear_solve_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the `solve` sub-program of `lax.custom_linear_solve` for its
    context, and takes the solution from the original primitive.

    The solution keeps JAX's implicit derivatives (through `matvec` and the
    transposed solve), which differentiating the solver's own iterations would
    not give, and which are all that make reverse mode through an iterative solver
    work. Handlers see every equation of the primal solve (which calls `matvec`),
    and the context they build comes out; values a handler changes inside the
    solve do not reach the solution. Under `jit` the interpreted copy of the solve
    is dead code apart from what the context needs.
    """
    _compat.check_params(eqn)
    params = eqn.params
    lengths = params["const_lengths"]
    solve = params["jaxprs"].solve
    before_solve = lengths.matvec + lengths.vecmat
    solve_consts = invals[before_solve : before_solve + lengths.solve]
    b = invals[sum(lengths) :]
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, solve, spec, name="custom_linear_solve")
    ctx_out, _ = body.call(ctx_values, [*solve_consts, *b])
    outs = _compat.bind_equation(eqn.primitive, params, invals)
    return HandlerResult(body.ctx_out.unflatten(ctx_out), outs)
