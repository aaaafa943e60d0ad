"""`while`: the context as a loop carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import JaxprEqn
from jax.tree_util import keystr

from .. import _compat
from .._body import TracedBody, passed_through, trace_body, trace_interpreted
from .._context import CtxSpec, diff
from .._registry import default_handler_for
from .._source import where
from .._types import HandlerResult
from .._validation import check_params
from ._loop import (
    Initializer,
    Updater,
    arg_avals_of,
    consts_first,
    forwarded_inputs,
    invariant_ctx_first,
    resolve_carry,
    with_updater,
)


@default_handler_for("while")
def default_while_handler(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    initializer: Initializer | None = None,
    updater: Updater | None = None,
    thread_condition: bool = False,
) -> HandlerResult:
    """Interprets a `while_loop` once and runs it with the context as a carry.

    **Arguments:**

    - `initializer`, `updater`: as for `default_scan_handler` with
      `ScanSemantics.CARRY`. A loop that runs zero times returns the initializer's
      context.
    - `thread_condition`: by default the condition must not change the context (a
      `ValueError` says so if it does). With `True`, the condition's context
      changes are kept: it runs once before the loop and once after every
      iteration, threading the context, so effects in the condition count
      `trips + 1` times.
    """
    check_params(eqn)
    if thread_condition:
        return _while_threading_condition(interpreter, ctx, eqn, invals, initializer, updater)
    params = eqn.params
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = invals[:cond_nconsts]
    body_consts = invals[cond_nconsts : cond_nconsts + body_nconsts]
    init = invals[cond_nconsts + body_nconsts :]

    def trace(spec: CtxSpec) -> TracedBody:
        return trace_interpreted(interpreter, body_jaxpr, spec, name="while_loop body")

    body, spec, ctx_values = resolve_carry(eqn, "while_loop", trace, ctx, initializer)
    body = with_updater(interpreter, eqn, "while_loop", body, arg_avals_of(body_jaxpr), updater)
    cond = _condition(interpreter, cond_jaxpr, spec)
    _check_condition_keeps_ctx(eqn, spec, cond)
    num_ctx = spec.num_values
    # The condition's context outputs are its inputs (checked above): keep only
    # the predicate.
    new_cond = consts_first(cond, num_ctx, cond_nconsts, outvars=cond.jaxpr.outvars[num_ctx:])
    new_body = consts_first(body, num_ctx, body_nconsts)
    # Context leaves the body returns unchanged are consts, not carries, as
    # `lax.while_loop` does for its own carries: under `vmap` with a batched
    # predicate, every carry comes out batched.
    body_fwd = forwarded_inputs(body.jaxpr)[:num_ctx]
    invariant = [f == body.num_consts + i for i, f in enumerate(body_fwd)]
    num_invariant = sum(invariant)
    if num_invariant:
        num_cond_consts = cond.num_consts + cond_nconsts
        new_cond = invariant_ctx_first(new_cond, num_cond_consts, invariant, is_body=False)
        num_body_consts = body.num_consts + body_nconsts
        new_body = invariant_ctx_first(new_body, num_body_consts, invariant, is_body=True)
    invariant_values = [v for v, inv in zip(ctx_values, invariant, strict=True) if inv]
    carried_values = [v for v, inv in zip(ctx_values, invariant, strict=True) if not inv]
    if carried_values and _batched_predicate(eqn):
        # Under `vmap`, JAX's `while` with a batched predicate needs every carry
        # batched; the context is not. Carry the predicate instead (the condition
        # leaves the context as it is, as checked above).
        return _while_threading_condition(interpreter, ctx, eqn, invals, initializer, updater)
    new_params = dict(
        params,
        cond_jaxpr=_compat.new_closed_jaxpr(new_cond, ()),
        cond_nconsts=num_invariant + cond.num_consts + cond_nconsts,
        body_jaxpr=_compat.new_closed_jaxpr(new_body, ()),
        body_nconsts=num_invariant + body.num_consts + body_nconsts,
    )
    out = _compat.bind_equation(
        eqn.primitive,
        new_params,
        [
            *invariant_values,
            *cond.consts,
            *cond_consts,
            *invariant_values,
            *body.consts,
            *body_consts,
            *carried_values,
            *init,
        ],
    )
    num_carried = len(carried_values)
    carried_out = iter(out[:num_carried])
    ctx_out = [
        v if inv else next(carried_out) for v, inv in zip(ctx_values, invariant, strict=True)
    ]
    return HandlerResult(body.ctx_out.unflatten(ctx_out), out[num_carried:])


def _condition(interpreter: Any, cond_jaxpr: Any, spec: CtxSpec) -> TracedBody:
    """The condition, taking the context and returning it unchanged: traced with
    the interpreter, or, when the interpreter would only re-bind it, its own
    jaxpr with the context passed through (not traced again)."""
    open_cond, _ = _compat.open_jaxpr(cond_jaxpr)
    if not _compat.has_input_effects(open_cond) and interpreter._only_rebinds(open_cond):
        return passed_through(cond_jaxpr, spec)
    return trace_interpreted(interpreter, cond_jaxpr, spec, name="while_loop condition")


def _batched_predicate(eqn: JaxprEqn) -> bool:
    """Whether the loop's condition returns a batched predicate (see
    `while_with_predicate`)."""
    return bool(eqn.params["cond_jaxpr"].out_avals[0].shape)


def _check_condition_keeps_ctx(eqn: JaxprEqn, spec: CtxSpec, cond: TracedBody) -> None:
    """The condition's traced context outputs must be its context inputs, unchanged."""
    num_ctx = spec.num_values
    # Control flow in the condition (a `jit`, a `cond`) threads the context through
    # its own outputs: follow values through it rather than comparing variables.
    forwarded = forwarded_inputs(cond.jaxpr)
    unchanged = [forwarded[j] == cond.num_consts + j for j in range(num_ctx)]
    if cond.ctx_out.same_as(spec) and all(unchanged):
        return
    changes = diff(spec, cond.ctx_out)
    if not changes:
        value_paths = [p for p, m in zip(spec.paths, spec.value_mask, strict=True) if m]
        changes = [
            f"  ctx{keystr(p)} is given a new value"
            for p, same in zip(value_paths, unchanged, strict=True)
            if not same
        ]
    raise ValueError(
        f"The condition of the while_loop ({where(eqn)}) changes the context:\n"
        + "\n".join(changes)
        + "\nA while condition runs once more than the body, so default_while_handler "
        "does not let it change the context. Register "
        "functools.partial(default_while_handler, thread_condition=True) to thread "
        "the context through the condition too, or move the effect into the body."
    )


def _while_threading_condition(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    initializer: Initializer | None,
    updater: Updater | None,
) -> HandlerResult:
    """A while loop whose condition may change the context.

    It runs as `pred, ctx = cond(ctx, x); while pred: x, ctx = body(ctx, x);
    pred, ctx = cond(ctx, x)`, with the predicate carried.
    """
    params = eqn.params
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    num_cond_consts = params["cond_nconsts"]
    num_consts = num_cond_consts + params["body_nconsts"]
    consts, init = invals[:num_consts], invals[num_consts:]

    def step(ctx: Any, *args: Any) -> tuple[list[Any], Any]:
        cond_consts, body_consts = args[:num_cond_consts], args[num_cond_consts:num_consts]
        carry, ctx = interpreter(body_jaxpr, ctx, *body_consts, *args[num_consts:])
        (pred,), ctx = interpreter(cond_jaxpr, ctx, *cond_consts, *carry)
        return [pred, *carry], ctx

    arg_avals = [
        *arg_avals_of(cond_jaxpr)[:num_cond_consts],
        *arg_avals_of(body_jaxpr),
    ]

    def trace(spec: CtxSpec) -> TracedBody:
        return trace_body(
            interpreter, step, spec, arg_avals, key=(body_jaxpr, cond_jaxpr), name="while_loop"
        )

    body, spec, ctx_values = resolve_carry(eqn, "while_loop", trace, ctx, initializer)
    body = with_updater(interpreter, eqn, "while_loop", body, arg_avals, updater)
    cond = trace_interpreted(interpreter, cond_jaxpr, spec, name="while_loop condition")
    if not cond.ctx_out.same_as(spec):
        raise ValueError(
            f"The condition of the while_loop ({where(eqn)}) returns a context unlike "
            f"the one the loop carries:\n"
            + "\n".join(diff(spec, cond.ctx_out))
            + "\nMake the loop's initializer build the context the condition returns."
        )
    ctx_values, (pred,) = cond.call(ctx_values, [*consts[:num_cond_consts], *init])

    def iterate(ctx_values: Any, carry: list[Any]) -> tuple[Any, Any, list[Any]]:
        ctx_values, (pred, *carry) = body.call(ctx_values, [*consts, *carry])
        return pred, ctx_values, carry

    ctx_values, out = while_with_predicate(pred, ctx_values, list(init), iterate)
    return HandlerResult(body.ctx_out.unflatten(ctx_values), out)


Step = Callable[[Any, list[Any]], tuple[Any, Any, list[Any]]]


def while_with_predicate(
    pred: Any, ctx: Any, carry: list[Any], step: Step
) -> tuple[Any, list[Any]]:
    """Runs `pred, ctx, carry = step(ctx, carry)` while `pred` holds, the predicate
    carried: `(ctx, carry)` at the end.

    A `while` equation's condition may return a batched predicate (an array of
    booleans over leading batch dimensions of every carry, as `vmap` of a loop
    with a data-dependent condition stages it). Then, as in JAX, the loop runs
    while any element's predicate holds, and an element whose predicate is false
    keeps its carry; the context goes through every iteration the loop runs.
    """
    if jax.numpy.ndim(pred) == 0:

        def body(state: tuple[Any, Any, list[Any]]) -> tuple[Any, Any, list[Any]]:
            _, ctx, carry = state
            return step(ctx, carry)

        _, ctx, out = jax.lax.while_loop(lambda state: state[0], body, (pred, ctx, carry))
        return ctx, list(out)

    def batched_body(state: tuple[Any, Any, list[Any]]) -> tuple[Any, Any, list[Any]]:
        running, ctx, carry = state
        pred, ctx, new = step(ctx, carry)
        new = [_where_running(running, n, c) for n, c in zip(new, carry, strict=True)]
        return jax.lax.bitwise_and(running, pred), ctx, new

    def any_running(state: tuple[Any, Any, list[Any]]) -> Any:
        running = state[0]
        return jax.lax.reduce_or(running, tuple(range(running.ndim)))

    _, ctx, out = jax.lax.while_loop(any_running, batched_body, (pred, ctx, carry))
    return ctx, list(out)


def _where_running(running: Any, new: Any, old: Any) -> Any:
    """`new` where the batch element is still running, else `old`."""
    mask = jax.lax.broadcast_in_dim(running, jax.numpy.shape(new), tuple(range(running.ndim)))
    return jax.lax.select(mask, new, old)
