"""`while`: the context as a loop carry."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import TracedBody, trace_body, trace_interpreted
from .._context import CtxSpec, diff
from .._interpreter import where
from .._types import HandlerResult
from ._loop import Initializer, Updater, arg_avals_of, resolve_carry, with_updater


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
    params = eqn.params
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = invals[:cond_nconsts]
    body_consts = invals[cond_nconsts : cond_nconsts + body_nconsts]
    init = invals[cond_nconsts + body_nconsts :]
    body_avals = arg_avals_of(body_jaxpr)
    carry_avals = body_avals[body_nconsts:]
    cond_avals = arg_avals_of(cond_jaxpr)

    def trace_cond(spec: CtxSpec) -> TracedBody:
        return trace_interpreted(interpreter, cond_jaxpr, spec, name="while_loop condition")

    if thread_condition:
        return _while_threading_condition(
            interpreter, eqn, ctx, initializer, updater, cond_consts, body_consts, init
        )

    def trace(spec: CtxSpec) -> TracedBody:
        return trace_interpreted(interpreter, body_jaxpr, spec, name="while_loop body")

    body, spec, ctx_values = resolve_carry(eqn, "while_loop", trace, ctx, initializer)
    body = with_updater(interpreter, eqn, "while_loop", body, body_avals, updater)
    cond = trace_cond(spec)
    _check_condition_keeps_ctx(eqn, spec, cond)
    num_ctx = spec.num_values

    # The condition returns the predicate only; its context outputs are its inputs.
    kc = cond.num_consts
    cond_order = [*range(kc), *range(kc + num_ctx, kc + num_ctx + cond_nconsts)]
    cond_order += [
        *range(kc, kc + num_ctx),
        *range(kc + num_ctx + cond_nconsts, len(cond_avals) + kc + num_ctx),
    ]
    cond_invars = [cond.jaxpr.invars[i] for i in cond_order]
    new_cond = _compat.replace_jaxpr(
        cond.jaxpr, invars=cond_invars, outvars=cond.jaxpr.outvars[num_ctx:]
    )

    kb = body.num_consts
    body_order = [*range(kb), *range(kb + num_ctx, kb + num_ctx + body_nconsts)]
    body_order += [
        *range(kb, kb + num_ctx),
        *range(kb + num_ctx + body_nconsts, kb + num_ctx + len(body_avals)),
    ]
    new_body = _compat.replace_jaxpr(body.jaxpr, invars=[body.jaxpr.invars[i] for i in body_order])

    new_params = dict(
        params,
        cond_jaxpr=_compat.new_closed_jaxpr(new_cond, ()),
        cond_nconsts=kc + cond_nconsts,
        body_jaxpr=_compat.new_closed_jaxpr(new_body, ()),
        body_nconsts=kb + body_nconsts,
    )
    del carry_avals
    out = _compat.bind_equation(
        eqn.primitive,
        new_params,
        [*cond.consts, *cond_consts, *body.consts, *body_consts, *ctx_values, *init],
    )
    return HandlerResult(body.ctx_out.unflatten(out[:num_ctx]), out[num_ctx:])


def _check_condition_keeps_ctx(eqn: JaxprEqn, spec: CtxSpec, cond: TracedBody) -> None:
    num_ctx = spec.num_values
    ctx_in = cond.jaxpr.invars[cond.num_consts : cond.num_consts + num_ctx]
    ctx_out = cond.jaxpr.outvars[:num_ctx]
    same_values = all(a is b for a, b in zip(ctx_in, ctx_out, strict=True))
    if cond.ctx_out.same_as(spec) and same_values:
        return
    changed = diff(spec, cond.ctx_out) or [
        f"  {p}" for p, a, b in _changed_paths(spec, ctx_in, ctx_out)
    ]
    raise ValueError(
        f"The condition of the while_loop at {where(eqn)} changes the context:\n"
        + "\n".join(changed)
        + "\nA while condition runs once more than the body, so default_while_handler "
        "does not let it change the context. Register "
        "functools.partial(default_while_handler, thread_condition=True) to thread "
        "the context through the condition too, or move the effect into the body."
    )


def _changed_paths(
    spec: CtxSpec, ctx_in: list[Any], ctx_out: list[Any]
) -> list[tuple[str, Any, Any]]:
    from jax.tree_util import keystr

    value_paths = [p for p, m in zip(spec.paths, spec.value_mask, strict=True) if m]
    return [
        (f"ctx{keystr(p)} is given a new value", a, b)
        for p, a, b in zip(value_paths, ctx_in, ctx_out, strict=True)
        if a is not b
    ]


def _while_threading_condition(
    interpreter: Any,
    eqn: JaxprEqn,
    ctx: Any,
    initializer: Initializer | None,
    updater: Updater | None,
    cond_consts: list[Any],
    body_consts: list[Any],
    init: list[Any],
) -> HandlerResult:
    """A while loop whose condition may change the context.

    The loop is run as `pred, ctx = cond(ctx, x); while pred: x, ctx = body(ctx, x);
    pred, ctx = cond(ctx, x)`, with the predicate carried.
    """
    import jax

    params = eqn.params
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    num_cond_consts, num_body_consts = len(cond_consts), len(body_consts)

    def step(ctx: Any, *args: Any) -> tuple[list[Any], Any]:
        c_consts = args[:num_cond_consts]
        b_consts = args[num_cond_consts : num_cond_consts + num_body_consts]
        carry = args[num_cond_consts + num_body_consts :]
        new_carry, new_ctx = interpreter(body_jaxpr, ctx, *b_consts, *carry)
        (pred,), new_ctx = interpreter(cond_jaxpr, new_ctx, *c_consts, *new_carry)
        return [pred, *new_carry], new_ctx

    arg_avals = [
        *(_compat.aval_of(c) for c in (*cond_consts, *body_consts)),
        *arg_avals_of(body_jaxpr)[params["body_nconsts"] :],
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
            f"The condition of the while_loop at {where(eqn)} returns a context unlike "
            f"the one the loop carries:\n" + "\n".join(diff(spec, cond.ctx_out))
        )
    consts = [*cond_consts, *body_consts]
    first_ctx, (pred,) = cond.call(ctx_values, [*cond_consts, *init])

    def loop_cond(state: tuple[Any, list[Any], list[Any]]) -> Any:
        return state[0]

    def loop_body(state: tuple[Any, list[Any], list[Any]]) -> tuple[Any, list[Any], list[Any]]:
        _, ctx_vals, carry = state
        new_ctx, outs = body.call(ctx_vals, [*consts, *carry])
        return outs[0], new_ctx, outs[1:]

    _, final_ctx, final = jax.lax.while_loop(loop_cond, loop_body, (pred, first_ctx, list(init)))
    return HandlerResult(body.ctx_out.unflatten(final_ctx), list(final))
