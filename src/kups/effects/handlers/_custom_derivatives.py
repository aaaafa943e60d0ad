"""`custom_jvp` and `custom_vjp`: the primal body is interpreted, the user's
derivative rules still give the derivatives."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import TracedBody, trace_interpreted
from .._context import split
from .._types import HandlerResult


def _zero_tangent(aval: Any) -> Any:
    """A zero tangent (or cotangent) for a value of type `aval`."""
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        zero = jnp.zeros(aval.shape, aval.dtype)
        varying = _compat.varying_axes(aval)
        if varying:
            zero = jax.lax.pcast(zero, tuple(varying), to="varying")
        return zero
    return np.zeros(aval.shape, jax.dtypes.float0)


def _original(eqn: JaxprEqn) -> Any:
    def call(*args: Any) -> list[Any]:
        return _compat.bind_equation(eqn.primitive, eqn.params, args)

    return call


def _traced(interpreter: Any, ctx: Any, eqn: JaxprEqn, name: str) -> tuple[TracedBody, list[Any]]:
    spec, ctx_values = split(ctx)
    return trace_interpreted(interpreter, eqn.params["call_jaxpr"], spec, name=name), ctx_values


def default_custom_jvp_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the primal body of a `jax.custom_jvp` function with the context.

    Derivatives still come from the user's custom JVP rule, applied to the
    original function; the context carries no tangent (its tangents are zero).
    """
    body, ctx_values = _traced(interpreter, ctx, eqn, "custom_jvp")
    original = _original(eqn)

    @jax.custom_jvp
    def primal(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, args)

    @primal.defjvp
    def primal_jvp(primals: Any, tangents: Any) -> Any:
        ctx_values, args = primals
        _, arg_tangents = tangents
        ctx_out, outs = body.call(ctx_values, args)
        _, out_tangents = jax.jvp(original, tuple(args), tuple(arg_tangents))
        ctx_tangents = [_zero_tangent(a) for a in body.ctx_out.avals]
        return (ctx_out, outs), (ctx_tangents, list(out_tangents))

    ctx_out, outs = primal(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))


def default_custom_vjp_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the primal body of a `jax.custom_vjp` function with the context.

    Reverse-mode derivatives still come from the user's `fwd`/`bwd` rules, applied
    to the original function; the context gets zero cotangents.
    """
    body, ctx_values = _traced(interpreter, ctx, eqn, "custom_vjp")
    original = _original(eqn)
    ctx_in_avals = body.ctx_in.avals

    @jax.custom_vjp
    def primal(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, args)

    def primal_fwd(ctx_values: list[Any], args: list[Any]) -> Any:
        ctx_out, outs = body.call(ctx_values, args)
        _, pullback = jax.vjp(original, *args)
        return (ctx_out, outs), pullback

    def primal_bwd(pullback: Any, cotangents: Any) -> Any:
        _, out_cotangents = cotangents
        arg_cotangents = pullback(list(out_cotangents))
        return [_zero_tangent(a) for a in ctx_in_avals], list(arg_cotangents)

    primal.defvjp(primal_fwd, primal_bwd)
    ctx_out, outs = primal(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))
