"""`custom_linear_solve`: the primitive is bound again with its solves interpreted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params


@default_handler_for("custom_linear_solve")
def default_custom_linear_solve_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Binds `lax.custom_linear_solve` again with its `solve` and
    `transpose_solve` sub-programs interpreted with the context.

    The context goes into the interpreted solve as extra constants and comes out
    as extra auxiliary outputs of the primitive. So the solve runs once (an
    ordered effect inside it runs once, as in plain JAX), what handlers change
    there reaches the solution, and everything else is JAX's own rule for the
    primitive: the implicit derivatives (the tangent solves `A dx = db - dA x`
    with the interpreted solve, or in reverse mode with the interpreted
    `transpose_solve`), their higher orders, batching, and transposition when the
    solve is part of a linear function. `matvec`, which those rules differentiate
    and batch, is JAX's. The context carries zero tangents, as every auxiliary
    output of a solve does; the context the transposed solve makes is dropped, as
    JAX drops its auxiliary outputs.
    """
    check_params(eqn)
    params = eqn.params
    lengths = params["const_lengths"]
    jaxprs = params["jaxprs"]
    before_solve = lengths.matvec + lengths.vecmat
    after_solve = before_solve + lengths.solve
    num_params = sum(lengths)
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, jaxprs.solve, spec, name="custom_linear_solve")

    # `body.jaxpr` takes [*consts, *ctx, *solve_consts, *b] and returns
    # [*ctx_out, *x, *aux]: everything before `b` becomes the solve's constants, and
    # the context's outputs move behind the solve's own (after its aux outputs).
    num_ctx_out = body.num_ctx_out
    outvars = body.jaxpr.outvars
    solve = _compat.new_closed_jaxpr(
        _compat.replace_jaxpr(body.jaxpr, outvars=[*outvars[num_ctx_out:], *outvars[:num_ctx_out]]),
        (),
    )
    new_consts = [*body.consts, *ctx_values]
    transpose_solve, new_transpose_consts = _interpreted_transpose(
        interpreter,
        jaxprs.transpose_solve,
        spec,
        ctx_values,
        [v.aval for v in outvars[:num_ctx_out]],
    )
    new_params = dict(
        params,
        const_lengths=lengths._replace(
            solve=len(new_consts) + lengths.solve,
            transpose_solve=len(new_transpose_consts) + lengths.transpose_solve,
        ),
        jaxprs=jaxprs._replace(solve=solve, transpose_solve=transpose_solve),
    )
    outs = _compat.bind_equation(
        eqn.primitive,
        new_params,
        [
            *invals[:before_solve],
            *new_consts,
            *invals[before_solve:after_solve],
            *new_transpose_consts,
            *invals[after_solve:num_params],
            *invals[num_params:],
        ],
    )
    num_outs = len(outs) - num_ctx_out
    return HandlerResult(body.ctx_out.unflatten(outs[num_outs:]), outs[:num_outs])


def _interpreted_transpose(
    interpreter: Any,
    transpose_solve: ClosedJaxpr | None,
    spec: Any,
    ctx_values: Sequence[Any],
    aux_avals: Sequence[Any],
) -> tuple[ClosedJaxpr | None, list[Any]]:
    """`transpose_solve` interpreted with the context, and its new constants.

    The transposed solve runs only in reverse mode, where JAX drops the auxiliary
    outputs of a solve, so the context it makes is dropped too; JAX wants a solve
    and its transpose to have the same auxiliary outputs, so zeros of `aux_avals`
    (the solve's context outputs) stand in for it.
    """
    if transpose_solve is None:
        return None, []
    body = trace_interpreted(interpreter, transpose_solve, spec, name="transpose_solve")
    num_ctx = len(ctx_values)

    def with_zeros(*args: Any) -> list[Any]:
        _, outs = body.call(args[:num_ctx], args[num_ctx:])
        return [*outs, *(jnp.zeros(aval.shape, aval.dtype) for aval in aux_avals)]

    in_avals = [*map(_compat.aval_of, ctx_values), *transpose_solve.in_avals]
    jaxpr, _, consts = _compat.trace_to_jaxpr(with_zeros, in_avals, "transpose_solve")
    return _compat.new_closed_jaxpr(_compat.hoist_consts(jaxpr), ()), [*consts, *ctx_values]
