"""`remat_opt`: the forward pass of a `custom_vjp` declared with
`optimize_remat=True`, as differentiating it stages it (`jax.grad`, `jax.vjp`
or `jax.linearize` inside the interpreted function).

The equation runs the user's `fwd` rule, giving the residuals and the outputs;
when partial evaluation finds the residuals unused (under `jax.checkpoint`),
JAX replaces it by the user's primal function. Both are interpreted with the
context: the re-bound equation's `fwd` gives `[*residuals, *ctx_out, *outs]`
and its primal function `[*ctx_out, *outs]`, so whichever JAX runs threads the
context. The user's `bwd` rule is outside the equation and is not touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params


def _primal_thunk(jaxpr: Jaxpr, leading: list[Any]) -> Callable[[], tuple[Jaxpr, list[Any]]]:
    """A `fun_jaxpr_thunk`: `(jaxpr, consts)` for `jaxpr` closed over its first
    inputs (bound to `leading`); its inputs are the context and the primal
    inputs."""
    closed, consts = _compat.close_over(jaxpr, [True] * len(leading), leading)
    return lambda: (closed, consts)


@default_handler_for("remat_opt")
def default_remat_opt_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the forward rule of a `custom_vjp` with `optimize_remat=True`
    (and its primal function, which JAX runs instead when the residuals are
    unused) with the context.

    When the primal function leaves a context of another structure than the
    forward rule's (an effect in one and not the other), the forward rule with
    the residuals dropped stands in for it, so the context is the same whichever
    runs (only the rematerialisation saving is lost).
    """
    check_params(eqn)
    params = eqn.params
    num_consts, num_res = params["num_consts"], params["num_res"]
    consts, args = invals[:num_consts], invals[num_consts:]
    spec, ctx_values = split(ctx)
    fwd = trace_interpreted(interpreter, params["fwd_jaxpr"], spec, name="remat_opt fwd")
    num_ctx = fwd.num_ctx_out

    # `fwd.jaxpr`: [*fwd consts, *ctx, *consts, *args] -> [*ctx_out, *res, *outs].
    # Re-bound: [*fwd consts, *consts] are the equation's consts, the context leads
    # the primal inputs, and the residuals lead the outputs.
    fwd_in = fwd.jaxpr.invars
    num_fwd_consts = fwd.num_consts
    ctx_in = fwd_in[num_fwd_consts : num_fwd_consts + len(ctx_values)]
    own_consts = fwd_in[
        num_fwd_consts + len(ctx_values) : num_fwd_consts + len(ctx_values) + num_consts
    ]
    fwd_out = fwd.jaxpr.outvars
    ctx_out, res, outs = (
        fwd_out[:num_ctx],
        fwd_out[num_ctx : num_ctx + num_res],
        fwd_out[num_ctx + num_res :],
    )
    new_fwd = _compat.replace_jaxpr(
        fwd.jaxpr,
        invars=[
            *fwd_in[:num_fwd_consts],
            *own_consts,
            *ctx_in,
            *fwd_in[num_fwd_consts + len(ctx_values) + num_consts :],
        ],
        outvars=[*res, *ctx_out, *outs],
    )

    fun_jaxpr, fun_consts = params["fun_jaxpr_thunk"]()
    fun = _compat.new_closed_jaxpr(fun_jaxpr, fun_consts)
    primal = trace_interpreted(interpreter, fun, spec, name="remat_opt")
    if primal.ctx_out.same_as(fwd.ctx_out):
        thunk = _primal_thunk(primal.jaxpr, list(primal.consts))
    else:
        without_res = _compat.replace_jaxpr(new_fwd, outvars=[*ctx_out, *outs])
        thunk = _primal_thunk(without_res, [*fwd.consts, *consts])

    new_params = dict(
        params,
        num_consts=num_fwd_consts + num_consts,
        fwd_jaxpr=_compat.jaxpr_like(params["fwd_jaxpr"], new_fwd),
        fun_jaxpr_thunk=thunk,
    )
    out = _compat.bind_equation(
        eqn.primitive, new_params, [*fwd.consts, *consts, *ctx_values, *args]
    )
    new_ctx = out[num_res : num_res + num_ctx]
    return HandlerResult(
        fwd.ctx_out.unflatten(new_ctx), [*out[:num_res], *out[num_res + num_ctx :]]
    )
