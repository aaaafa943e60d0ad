"""`custom_jvp` and `custom_vjp`: the primal body is interpreted, the user's
derivative rules still give the derivatives.

The context is threaded through a `jax.custom_jvp` / `jax.custom_vjp` of kups'
own, which knows which inputs are perturbed: the user's rules are differentiated
with respect to those only, and so see `.perturbed` (and symbolic zero tangents)
as plain JAX would give them. The `custom_jvp` is declared with
`symbolic_zeros=True`; the `custom_vjp` only when the user's rules are (an eager
`shard_map` cannot run one declared so), otherwise every floating input counts
as perturbed, which a rule without symbolic zeros cannot tell apart anyway.
The re-staged equation keeps the names (and source lines) of the user's
function and rules.

Differentiated, plain JAX runs the user's rule and not the function: a
`jax.debug.callback` in the function runs only as often as the rule calls the
function. kups still runs the interpreted body then, for the context, so its
debug callbacks are dropped there (`_quiet`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn, jaxpr_as_fun

from .. import _compat
from .._body import TracedBody, passed_through, trace_interpreted
from .._context import split
from .._defaults import default_dispatcher
from .._effect import is_effect, seen
from .._interpreter import Interpreter
from .._matching import equations_in, is_control_flow
from .._policy import BackwardPass
from .._registry import default_handler_for
from .._source import where
from .._types import HandlerResult, InterpreterPolicy
from .._untouched import touched_inside
from .._validation import check_params
from ._context_reads import ctx_read_by_outputs

_SymbolicZero = _compat.symbolic_zero_type()


def _zero_tangent(aval: Any) -> Any:
    """A zero tangent (or cotangent) for a value of type `aval`."""
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        zero = jnp.zeros(aval.shape, aval.dtype)
        varying = _compat.varying_axes(aval)
        if varying:
            zero = jax.lax.pcast(zero, tuple(varying), to="varying")
        return zero
    return np.zeros(aval.shape, jax.dtypes.float0)


def _original(eqn: JaxprEqn, params: dict[str, Any] | None = None) -> Callable[..., list[Any]]:
    params = eqn.params if params is None else params

    def call(*args: Any) -> list[Any]:
        return _compat.bind_equation(eqn.primitive, params, args)

    return call


# What `jax.debug.callback` and `jax.debug.print` bind: effects with no outputs.
_DEBUG_PRIMITIVES = frozenset({"debug_callback", "debug_print"})


def _has_debug_callback(jaxpr: Any) -> bool:
    jaxpr, _ = _compat.open_jaxpr(jaxpr)
    return any(
        eqn.primitive.name in _DEBUG_PRIMITIVES
        or (is_control_flow(eqn) and bool(touched_inside(eqn, _DEBUG_PRIMITIVES)))
        for eqn in jaxpr.eqns
    )


def _drop(interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]) -> HandlerResult:
    del interpreter, eqn, invals
    return HandlerResult(ctx, [])


def _quiet(body: TracedBody) -> Callable[[list[Any], list[Any]], tuple[list[Any], list[Any]]]:
    """`body.call` without the body's `jax.debug.callback`s and `jax.debug.print`s,
    at any depth: how the body runs beside the user's rule, where plain JAX runs
    only the rule."""
    if not _has_debug_callback(body.jaxpr):
        return body.call
    dispatcher = default_dispatcher()
    for name in sorted(_DEBUG_PRIMITIVES):
        dispatcher = dispatcher.register_handler(name, _drop)
    muting = Interpreter(dispatcher, policy=InterpreterPolicy.IGNORE)
    closed = body.closed()

    def call(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        out, _ = muting(closed, (), *body.consts, *ctx_values, *args)
        return out[: body.num_ctx_out], out[body.num_ctx_out :]

    return call


@jax.custom_jvp
def _valued_as(value: list[Any], rule_value: list[Any]) -> list[Any]:
    """`value` (the interpreted body's outputs, with any change a handler made),
    differentiated as `rule_value` (the same outputs from the user's rule).

    Inside a derivative rule, a second derivative must differentiate the outputs
    by the user's rule, as JAX does, and not by the body's own operations; and
    the rule's own derivative already runs that rule, so nothing else does.
    """
    del rule_value
    return value


@_valued_as.defjvp
def _valued_as_jvp(primals: Any, tangents: Any) -> Any:
    return primals[0], tangents[1]


_Needed = Callable[[Any, JaxprEqn], bool] | bool


def _interpreted(
    interpreter: Any,
    ctx: Any,
    tracing: Callable[[Any], AbstractContextManager[Any]] | None,
    needed: _Needed,
    fn: Callable[..., Any],
    *args: Any,
) -> Any:
    """`fn(*args)` traced (inside `tracing(ctx)`), and run under `interpreter` from
    `ctx` (whose changes are dropped): a derivative rule that JAX runs for the
    function, interpreted if it binds an effect the interpreter acts on (and that
    `needed(ctx, eqn)` accepts, when `needed` is a function)."""
    # Effects bound while tracing are the interpreter's to see.
    with seen(), contextlib.nullcontext() if tracing is None else tracing(ctx):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    leaves = jax.tree.leaves(args)
    if acts_inside(interpreter, closed, ctx, needed):
        outs, _ = interpreter(closed, ctx, *leaves)
    else:
        # Nothing in the rule for the interpreter: JAX's own rule, as it is (an
        # interpreted rule is a jaxpr of it, which JAX differentiates again); the
        # effects it binds are ones the interpreter would leave as they are.
        with seen():
            outs = jaxpr_as_fun(closed)(*leaves)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)


def acts_inside(interpreter: Any, closed: Any, ctx: Any, needed: _Needed) -> bool:
    """Whether `closed` binds, at any depth, an effect that `interpreter` acts on
    (and that `needed` accepts)."""
    acts_on = interpreter.acts_on
    return any(
        is_effect(eqn.primitive)
        and interpreter.dispatcher.is_registered(eqn.primitive)
        and (acts_on is None or acts_on(eqn.primitive, eqn.params))
        and (needed is True or (callable(needed) and needed(ctx, eqn)))
        for eqn, _ in equations_in(closed)
    )


def _interpreted_pullback(
    interpreter: Any,
    tracing: Callable[[Any], AbstractContextManager[Any]] | None,
    needed: _Needed,
    ctx_in: Any,
    perturbed: tuple[bool, ...],
    rule: Callable[[list[Any]], tuple[list[Any], list[Any]]],
    ctx_values: list[Any],
    args: list[Any],
    cotangents: list[Any],
) -> list[Any]:
    """The user's `fwd` and `bwd` rules, interpreted from the function's inputs
    (its residuals here) to the cotangents of the perturbed ones."""

    def vjp(args: list[Any], cotangents: list[Any]) -> list[Any]:
        diff_args, merge = _split_perturbed(args, perturbed)
        _, pullback, _ = jax.vjp(lambda *d: rule(merge(d)), *diff_args, has_aux=True)
        return list(pullback(cotangents))

    ctx = ctx_in.unflatten(ctx_values)
    return _interpreted(interpreter, ctx, tracing, needed, vjp, args, cotangents)


def _traced(interpreter: Any, ctx: Any, eqn: JaxprEqn, name: str) -> tuple[TracedBody, list[Any]]:
    spec, ctx_values = split(ctx)
    call_jaxpr = eqn.params["call_jaxpr"]
    if interpreter._only_rebinds(_compat.open_jaxpr(call_jaxpr)[0]):
        # Nothing inside for the interpreter (a handler there is for the rules):
        # the body as it is, passing the context through, traced no more.
        return passed_through(call_jaxpr, spec), ctx_values
    return trace_interpreted(interpreter, call_jaxpr, spec, name=name), ctx_values


def _debug_info(eqn: JaxprEqn, param: str) -> Any:
    """The `DebugInfo` of the user's function (`call_jaxpr`) or of one of its rules
    (`jvp_jaxpr_fun`, `fwd_jaxpr_thunk`, `bwd`), or `None`."""
    value = eqn.params.get(param)
    if value is None:
        return None
    if param == "call_jaxpr":  # a ClosedJaxpr before JAX 0.11, an open Jaxpr from 0.11
        value, _ = _compat.open_jaxpr(value)
    return getattr(value, "debug_info", None)


def _named_like(fn: Callable[..., Any], debug_info: Any) -> Callable[..., Any]:
    """`fn`, named (and located) as the user's function that `debug_info` describes."""
    name = getattr(debug_info, "func_name", None)
    if isinstance(name, str) and name:
        fn.__name__ = fn.__qualname__ = name
        _compat.adopt_debug_info(fn, debug_info)
    return fn


def _split_perturbed(
    values: Sequence[Any], perturbed: Sequence[bool]
) -> tuple[list[Any], Callable[[Sequence[Any]], list[Any]]]:
    """The perturbed `values`, and how to put new perturbed values back among the
    others."""
    chosen = [v for v, p in zip(values, perturbed, strict=True) if p]

    def merge(new: Sequence[Any]) -> list[Any]:
        new_iter = iter(new)
        return [next(new_iter) if p else v for v, p in zip(values, perturbed, strict=True)]

    return chosen, merge


def refuse_differentiated_ctx(eqn: JaxprEqn, what: str, fix: str) -> NoReturn:
    """Raises the error for a derivative with respect to a context value that
    `eqn`'s derivative rule cannot give: `what` names the call, `fix` says what
    the user can do instead."""
    raise ValueError(
        f"JAX is differentiating {what} ({where(eqn)}) with respect to a value that "
        f"the interpreter's context gives it (a value `plant` gives a sow inside it, "
        f"say), not one of its arguments. Its derivative rule only says how its "
        f"outputs change with its arguments, so the derivative with respect to that "
        f"value is unknown. {fix}, or wrap the value in jax.lax.stop_gradient if its "
        f"derivative is not wanted."
    )


def _refuse_for_custom(eqn: JaxprEqn, kind: str) -> NoReturn:
    refuse_differentiated_ctx(
        eqn,
        f"a {kind} function",
        f"Plain JAX refuses a differentiated value closed over by a {kind} function the "
        f"same way. Pass the value to the function as an argument (and to its rules)",
    )


@default_handler_for("custom_jvp_call")
def default_custom_jvp_handler(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    interpret_rule: bool | Callable[[Any, JaxprEqn], bool] = False,
    tracing_rule: Callable[[Any], AbstractContextManager[Any]] | None = None,
) -> HandlerResult:
    """Interprets the primal body of a `jax.custom_jvp` function with the context.

    Derivatives still come from the user's custom JVP rule, applied to the
    original function and to the perturbed inputs only (a rule declared with
    `symbolic_zeros=True` sees the others' tangents as symbolic zeros, as in plain
    JAX); the context carries no tangent (its tangents are zero).

    With `interpret_rule=True`, the rule runs under `interpreter` too, whenever
    JAX differentiates the function (also long after this handler returned, for a
    function staged under `jit`), with the context the function was called with,
    if it binds an effect the interpreter acts on; what the rule does to the
    context is dropped, as the derivative carries no context. That is for an
    interpreter that substitutes values, which must reach an effect the rule
    binds as well (`plant` of a value sown in a rule), and not for one that
    gathers from the context. A function `interpret_rule(ctx, eqn) -> bool` in
    place of `True` says which effect equations of the rule need the
    interpreter; a rule with none runs as JAX's. The rule is traced (by `jax.jvp` of
    the function) inside `tracing_rule(ctx)` if given: where such an interpreter
    says how JAX differentiates the effects it will substitute (a planted value
    has a zero tangent).
    """
    check_params(eqn)
    body, ctx_values = _traced(interpreter, ctx, eqn, "custom_jvp")
    # A rule traced inside `tracing_rule` differs from JAX's: not from, nor into,
    # the memo of the equation's traced rule.
    original = _original(
        eqn, None if tracing_rule is None else _compat.unmemoized_rules(eqn.params)
    )

    def primal(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, args)

    read = ctx_read_by_outputs(body)

    def primal_jvp(primals: Any, tangents: Any) -> Any:
        ctx_values, args = primals
        in_ctx_tangents, arg_tangents = tangents
        if any(r and not isinstance(t, _SymbolicZero) for r, t in zip(read, in_ctx_tangents)):
            _refuse_for_custom(eqn, "custom_jvp")
        ctx_out, outs = _quiet(body)(ctx_values, args)
        perturbed = tuple(not isinstance(t, _SymbolicZero) for t in arg_tangents)
        diff_tangents, _ = _split_perturbed(arg_tangents, perturbed)

        def jvp(args: list[Any], diff_tangents: list[Any]) -> Any:
            diff_args, merge = _split_perturbed(args, perturbed)

            def of_perturbed(*diff_args: Any) -> list[Any]:
                return original(*merge(diff_args))

            return jax.jvp(of_perturbed, tuple(diff_args), tuple(diff_tangents))

        if interpret_rule:
            # The context carries no tangent, here too.
            rule_ctx = body.ctx_in.unflatten(ctx_values)
            rule_outs, out_tangents = _interpreted(
                interpreter, rule_ctx, tracing_rule, interpret_rule, jvp, list(args), diff_tangents
            )
        else:
            rule_outs, out_tangents = jvp(args, diff_tangents)
        # Symbolic zeros, typed like the context's values (varying over the
        # manual axes of a shard_map body where they vary, integers too).
        ctx_tangents = [_SymbolicZero(jax.typeof(c).to_tangent_aval()) for c in ctx_out]
        outs = _valued_as(list(outs), list(rule_outs))
        return (ctx_out, outs), (ctx_tangents, list(out_tangents))

    primal = _named_like(primal, _debug_info(eqn, "call_jaxpr"))
    primal_jvp = _named_like(primal_jvp, _debug_info(eqn, "jvp_jaxpr_fun"))
    wrapped = jax.custom_jvp(primal)
    wrapped.defjvp(primal_jvp, symbolic_zeros=True)
    ctx_out, outs = wrapped(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))


def _pull(
    perturbed: tuple[bool, ...], out_avals: tuple[Any, ...], pullback: Any, cotangents: Any
) -> list[Any]:
    """Cotangents of the inputs of a custom_vjp function: the user's `bwd` (through
    `pullback`, which takes the cotangents of the floating outputs) for the
    perturbed inputs, `None` (zero) for the others."""
    cotangents = [
        _zero_tangent(aval) if isinstance(ct, _SymbolicZero) else _as_cotangent(ct, aval)
        for ct, aval in zip(cotangents, out_avals, strict=True)
        if _is_inexact(aval)
    ]
    diff_cotangents = iter(pullback(cotangents))
    return [next(diff_cotangents) if p else None for p in perturbed]


def _is_inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _as_cotangent(ct: Any, aval: Any) -> Any:
    """`ct` as a cotangent of an output of type `aval`.

    A user's `bwd` rule may return a cotangent of another floating dtype than its
    input's (JAX accepts an f32 cotangent for a bf16 input), which then reaches
    the pullback of the function that produced that input; `jax.vjp`'s pullbacks
    accept only their output's dtype, so it is cast to it.
    """
    dtype = getattr(ct, "dtype", None)
    if (
        dtype is not None
        and dtype != aval.dtype
        and jnp.issubdtype(dtype, jnp.inexact)
        and jnp.issubdtype(aval.dtype, jnp.inexact)
    ):
        return ct.astype(aval.dtype)
    return ct


@default_handler_for("custom_vjp_call")
def default_custom_vjp_handler(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    interpret_rule: bool | Callable[[Any, JaxprEqn], bool] = False,
    tracing_rule: Callable[[Any], AbstractContextManager[Any]] | None = None,
) -> HandlerResult:
    """Interprets the primal body of a `jax.custom_vjp` function with the context.

    Reverse-mode derivatives still come from the user's `fwd`/`bwd` rules, applied
    to the original function and differentiated with respect to the perturbed
    inputs only: a rule declared with `symbolic_zeros=True` sees `.perturbed`
    false for constants, as in plain JAX. The context gets zero cotangents.

    With `interpret_rule=True`, the rules run under `interpreter` too, with the
    context the function was called with (as for `default_custom_jvp_handler`):
    the forward pass keeps the function's inputs, and the backward pass runs
    `fwd` then `bwd` on them, interpreted. `fwd` then runs once more, in the
    backward pass, than in plain JAX. The rules are traced (by `jax.vjp` of the
    function) inside `tracing_rule(ctx)` if given.
    """
    check_params(eqn)
    body, ctx_values = _traced(interpreter, ctx, eqn, "custom_vjp")
    # As for custom_jvp: a `fwd` traced inside `tracing_rule` (one that
    # differentiates the function, with `jax.vjp`) is not JAX's.
    original = _original(
        eqn, None if tracing_rule is None else _compat.unmemoized_rules(eqn.params)
    )
    out_avals = tuple(v.aval for v in eqn.outvars)
    num_ctx = len(ctx_values)

    def primal(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, args)

    # Symbolic zeros where the user's rules take them (plain JAX runs them), and
    # where the outputs read a context value: they tell whether it is perturbed.
    # Not in an eager `shard_map`, which runs no custom_vjp declared with them:
    # there a derivative with respect to such a value is left zero.
    user_symbolic = bool(eqn.params.get("symbolic_zeros", False))
    num_consts = eqn.params.get("num_consts", 0)
    read = ctx_read_by_outputs(body)
    symbolic = user_symbolic or (any(read) and not _compat.in_eager_shard_map())
    if not symbolic:
        read = (False,) * len(read)

    def of_args(args: list[Any]) -> tuple[list[Any], list[Any]]:
        # Integer outputs go out as aux: their cotangents would be float0 zeros,
        # which inside a shard_map body must be typed as varying.
        rule_outs = original(*args)
        floats = [o for o, a in zip(rule_outs, out_avals, strict=True) if _is_inexact(a)]
        return floats, rule_outs

    def primal_fwd(ctx_values: list[Any], args: list[Any]) -> Any:
        if symbolic:
            if any(r and c.perturbed for r, c in zip(read, ctx_values)):
                _refuse_for_custom(eqn, "custom_vjp")
            ctx_values = [c.value for c in ctx_values]
        if user_symbolic:
            perturbed = tuple(bool(a.perturbed) for a in args)
        else:
            # Without symbolic zeros a rule cannot tell which inputs are
            # perturbed: its floating arguments all are, as in plain JAX. The
            # values the function closes over (its first `num_consts` inputs) are
            # not: JAX refuses to differentiate them, and one that could be
            # perturbed here is a tracer of the finished trace of the function,
            # which its rules cannot read (JAX raises an UnexpectedTracerError).
            perturbed = tuple(
                _is_inexact(v.aval) and i >= num_consts for i, v in enumerate(eqn.invars)
            )
        if symbolic:
            args = [a.value for a in args]
        ctx_out, outs = _quiet(body)(list(ctx_values), args)
        if interpret_rule:
            rules = functools.partial(
                _interpreted_pullback,
                interpreter,
                tracing_rule,
                interpret_rule,
                body.ctx_in,
                perturbed,
                of_args,
            )
            pullback = jax.tree_util.Partial(rules, list(ctx_values), list(args))
            residual = jax.tree_util.Partial(
                functools.partial(_pull, perturbed, out_avals), pullback
            )
            return (ctx_out, outs), residual
        diff_args, merge = _split_perturbed(args, perturbed)

        _, pullback, rule_outs = jax.vjp(lambda *d: of_args(merge(d)), *diff_args, has_aux=True)
        outs = _valued_as(list(outs), list(rule_outs))
        # The pattern of perturbed inputs is static: it lives in the residual's
        # tree structure (a Partial's function), not in traced leaves.
        residual = jax.tree_util.Partial(functools.partial(_pull, perturbed, out_avals), pullback)
        return (ctx_out, outs), residual

    def primal_bwd(residual: Any, cotangents: Any) -> Any:
        _, out_cotangents = cotangents
        # The user's rule runs now, when JAX differentiates: an effect it binds
        # is one no interpreter sees any more.
        with BackwardPass(interpreter, eqn).watching():
            return [None] * num_ctx, residual(list(out_cotangents))

    primal = _named_like(primal, _debug_info(eqn, "call_jaxpr"))
    primal_fwd = _named_like(primal_fwd, _debug_info(eqn, "fwd_jaxpr_thunk"))
    primal_bwd = _named_like(primal_bwd, _debug_info(eqn, "bwd"))
    wrapped = jax.custom_vjp(primal)
    wrapped.defvjp(primal_fwd, primal_bwd, symbolic_zeros=symbolic)
    ctx_out, outs = wrapped(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))
