"""Library primitives: their Python implementation interpreted, their derivative kept.

Equinox filter primitives (lineax's `linear_solve`, which optimistix's Newton
and Levenberg-Marquardt steps and diffrax's implicit solvers run) hold their
operator as a jaxpr or a Python function in their params and run it from a
Python implementation. That implementation is traceable: traced on the
equation's input types, it is the program the primitive runs, and kups walks it
with the context like any sub-program. Its derivatives stay the primitive's
own (see `_library_jvp`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import JaxprEqn

from .. import _compat, _policy
from .._body import trace_interpreted
from .._context import split
from .._effect import EFFECT_NAMES
from .._library_impl import implementation, interprets_implementation
from .._matching import is_control_flow
from .._registry import default_handler_for
from .._types import HandlerResult
from ._library_jvp import rule_tangents

_SymbolicZero = _compat.symbolic_zero_type()


@default_handler_for("linear_solve", "vprim")
@interprets_implementation
def default_library_primitive_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Goes inside a library primitive whose implementation is a traceable Python
    function (an equinox filter primitive such as lineax's `linear_solve`).

    The implementation, traced on the equation's input types, is interpreted with
    the context, so effects and counts reach what the primitive runs; it runs
    once (an ordered callback inside runs once, as in plain JAX). Derivatives are
    the primitive's own: a `custom_jvp` whose rule is the primitive's JVP rule,
    with the primitive's re-bind of its primal replaced by the outputs computed
    here, so `jax.jvp`, `jax.grad` and higher orders of the interpreted program
    are plain JAX's (lineax's implicit derivatives, its transposed solves). The
    context carries zero tangents. Under `jax.vmap` the implementation is
    vmapped, as equinox batches a `vprim`.

    A primitive whose implementation cannot be traced (equinox's `noinline`
    looks its function up from a traced index) is left to the interpreter as if
    it had no handler: by its policy, with the reason.

    **Example:**

    ```python
    from kups.effects import default_dispatcher, default_library_primitive_handler

    dispatcher = default_dispatcher().register_handler(
        "linear_solve", default_library_primitive_handler
    )
    ```
    """
    impl_jaxpr, reason = implementation(eqn)
    if impl_jaxpr is None:
        return _opaque(interpreter, ctx, eqn, invals, reason)
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, impl_jaxpr, spec, name=eqn.primitive.name)

    def primal(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, args)

    def primal_jvp(primals: Any, tangents: Any) -> Any:
        ctx_values, args = primals
        _, arg_tangents = tangents
        ctx_out, outs = wrapped(ctx_values, args)
        out_tangents = rule_tangents(eqn, args, arg_tangents, outs)
        ctx_tangents = [_SymbolicZero(jax.typeof(c).to_tangent_aval()) for c in ctx_out]
        return (ctx_out, outs), (ctx_tangents, out_tangents)

    wrapped = jax.custom_jvp(primal)
    wrapped.defjvp(primal_jvp, symbolic_zeros=True)
    ctx_out, outs = wrapped(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))


def _opaque(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any], reason: str
) -> HandlerResult:
    """What the interpreter does with a library primitive that has no handler,
    with the reason kups cannot go inside it in its error."""
    if is_control_flow(eqn):
        try:
            outvals = _policy.unhandled(
                interpreter.policy,
                interpreter.label,
                interpreter.policy_hint,
                interpreter._handled,
                eqn,
                invals,
            )
        except NotImplementedError as err:
            raise NotImplementedError(f"{err} (kups does not go inside it: {reason})") from None
        return HandlerResult(ctx, outvals)
    fallback = interpreter.dispatcher.fallback_handler
    if fallback is not None:
        ctx, outvals = interpreter._call(fallback, ctx, eqn, invals)
        return HandlerResult(ctx, outvals)
    watch_effects = not EFFECT_NAMES.isdisjoint(interpreter.dispatcher.handlers)
    outvals = interpreter._bind_unchanged(eqn, invals, watch_effects)
    if watch_effects and _compat.is_staging():
        interpreter._probe(eqn)
    return HandlerResult(ctx, outvals)
