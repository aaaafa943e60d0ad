"""`custom_vmap`: the function is interpreted, the user's vmap rule still batches it.

The context is threaded through a `jax.custom_batching.custom_vmap` of kups'
own. Its primal is the interpreted function; its vmap rule takes the outputs
from the original equation batched by JAX, which applies the user's rule, and
the context from the interpreted function batched as any function is. A
`jax.vmap` applied after interpretation so still gives the user's rule's
values, and the effects of every batch element are in the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import TracedBody, trace_interpreted
from .._context import split
from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params
from ._custom_derivatives import _named_like


def _axes(batched: Sequence[bool]) -> list[int | None]:
    return [0 if b else None for b in batched]


def _run(body: TracedBody, consts: Sequence[Any], ctx_values: Sequence[Any], args: Sequence[Any]):
    """The interpreted body on explicit consts (no tracer is closed over, so the
    rule never meets a batched const)."""
    out = _compat.eval_jaxpr(body.jaxpr, [*consts, *ctx_values, *args])
    return out[: body.num_ctx_out], out[body.num_ctx_out :]


@default_handler_for("custom_vmap_call")
def default_custom_vmap_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the function of a `jax.custom_batching.custom_vmap` with the
    context.

    Under a `jax.vmap` applied afterwards, the outputs still come from the user's
    vmap rule (applied to the original function), and the context from the
    interpreted function run on every batch element (it comes back batched).
    """
    check_params(eqn)
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, eqn.params["call"], spec, name="custom_vmap")

    def primal(consts: list[Any], ctx_values: list[Any], args: list[Any]) -> Any:
        return _run(body, consts, ctx_values, args)

    def rule(axis_size: int, in_batched: Any, consts: Any, ctx_values: Any, args: Any) -> Any:
        consts_batched, ctx_batched, args_batched = in_batched
        ctx_out: list[Any] = []
        if body.num_ctx_out:
            ctx_out, _ = jax.vmap(
                primal,
                in_axes=(_axes(consts_batched), _axes(ctx_batched), _axes(args_batched)),
                axis_size=axis_size,
            )(consts, ctx_values, args)

        def original(*args: Any) -> list[Any]:
            return _compat.bind_equation(eqn.primitive, eqn.params, args)

        outs = jax.vmap(original, in_axes=_axes(args_batched), axis_size=axis_size)(*args)
        out = (list(ctx_out), list(outs))
        return out, ([True] * len(ctx_out), [True] * len(outs))

    call, _ = _compat.open_jaxpr(eqn.params["call"])
    named = _named_like(primal, getattr(call, "debug_info", None))
    wrapped = jax.custom_batching.custom_vmap(named)
    wrapped.def_vmap(rule)
    ctx_out, outs = wrapped(list(body.consts), ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))
