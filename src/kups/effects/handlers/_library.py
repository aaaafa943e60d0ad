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

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
from jax.extend.core import JaxprEqn

from .. import _compat, _policy
from .._body import trace_interpreted
from .._context import split
from .._effect import EFFECT_NAMES
from .._library_impl import implementation, interprets_implementation
from .._matching import is_control_flow, subjaxprs
from .._registry import default_handler_for
from .._types import HandlerResult
from ._context_reads import ctx_read_by_outputs
from ._custom_derivatives import acts_inside, refuse_differentiated_ctx
from ._library_jvp import Interpreted, rule_tangents

_SymbolicZero = _compat.symbolic_zero_type()


@default_handler_for("linear_solve", "vprim", "call_hi_primitive")
@interprets_implementation
def default_library_primitive_handler(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    interpret_rule: bool | Callable[[Any, JaxprEqn], bool] = False,
    tracing_rule: Callable[[Any], AbstractContextManager[Any]] | None = None,
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
    context carries zero tangents; a derivative with respect to a context value
    that the outputs read is refused with a `ValueError`. Under `jax.vmap` the
    implementation is vmapped, as equinox batches a `vprim`.

    The rule runs the primitive's sub-programs again (lineax's tangent solves
    apply the operator). With `interpret_rule` and `tracing_rule`, as for
    `default_custom_jvp_handler`, the rule is traced inside `tracing_rule(ctx)`
    and runs under `interpreter` from the context of the call when it binds an
    effect the interpreter acts on (and that `interpret_rule(ctx, eqn)`
    accepts): `plant` plants the sows of the operator there too. Those
    tangents come through the implementation, not the primitive, so they are
    forward-mode only: transposing them (`jax.grad`) raises a
    `NotImplementedError`. A derivative with respect to a context value is
    then refused also where only the programs the primitive holds bind such
    an effect (the rule reads the value there).

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

    read = ctx_read_by_outputs(body)

    def primal_jvp(primals: Any, tangents: Any) -> Any:
        ctx_values, args = primals
        ctx_tangents_in, arg_tangents = tangents
        perturbed_ctx = [not isinstance(t, _SymbolicZero) for t in ctx_tangents_in]
        if any(r and p for r, p in zip(read, perturbed_ctx)) or (
            interpret_rule
            and any(perturbed_ctx)
            and _acts_in_params(interpreter, eqn, body.ctx_in.unflatten(ctx_values), interpret_rule)
        ):
            # Read by the outputs, or by the rule: the function a lineax operator
            # holds (which the rule applies to tangents) binds an effect the
            # interpreter acts on.
            refuse_differentiated_ctx(
                eqn,
                f"the library primitive {eqn.primitive.name!r}",
                "Compute the value outside the library call and pass it in (as "
                "part of the operator, say)",
            )
        ctx_out, outs = wrapped(ctx_values, args)
        if all(isinstance(t, _SymbolicZero) for t in arg_tangents):
            # Nothing perturbed (the context's tangents are refused or unread):
            # JAX never runs a rule so, and library rules do not expect it.
            out_tangents = [_SymbolicZero(jax.typeof(o).to_tangent_aval()) for o in outs]
        else:
            interpreted = None
            if interpret_rule:
                rule_ctx = body.ctx_in.unflatten(ctx_values)
                interpreted = Interpreted(interpreter, rule_ctx, tracing_rule, interpret_rule)
            out_tangents = rule_tangents(eqn, args, arg_tangents, outs, interpreted)
        ctx_tangents = [_SymbolicZero(jax.typeof(c).to_tangent_aval()) for c in ctx_out]
        return (ctx_out, outs), (ctx_tangents, out_tangents)

    wrapped = jax.custom_jvp(primal)
    wrapped.defjvp(primal_jvp, symbolic_zeros=True)
    ctx_out, outs = wrapped(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))


def _acts_in_params(
    interpreter: Any, eqn: JaxprEqn, ctx: Any, needed: Callable[[Any, JaxprEqn], bool] | bool
) -> bool:
    """Whether a program the equation holds in its params (a lineax operator's
    function) binds an effect `interpreter` acts on (and `needed` accepts)."""
    return any(acts_inside(interpreter, jaxpr, ctx, needed) for jaxpr in subjaxprs(eqn.params))


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
