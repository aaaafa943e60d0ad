"""`scan`: the context as a loop carry, or stacked like the scan's outputs."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn
from jax.tree_util import keystr

from .. import _compat
from .._body import TracedBody, trace_interpreted
from .._context import CtxSpec, same_type, split
from .._registry import default_handler_for
from .._source import where
from .._types import HandlerResult, ScanSemantics
from .._validation import check_params
from ._loop import (
    Initializer,
    Updater,
    arg_avals_of,
    consts_first,
    forwarded_inputs,
    invariant_ctx_first,
    resolve_carry,
    unused_dropped,
    with_updater,
)


@default_handler_for("scan")
def default_scan_handler(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    threading: ScanSemantics = ScanSemantics.CARRY,
    initializer: Initializer | None = None,
    updater: Updater | None = None,
) -> HandlerResult:
    """Interprets a `scan` body once and scans it with the context threaded through.

    **Arguments:**

    - `threading`: `ScanSemantics.CARRY` (the context is a loop carry) or
      `ScanSemantics.RESULT` (leaves that existed before the scan are carried;
      leaves the body adds come back stacked along a new leading axis of size
      `length`, entry `i` belonging to `xs[i]`, also for `reverse=True`).
    - `initializer`: with `CARRY`, needed when the body adds context leaves:
      `initializer(ctx_before, sentinel)` returns the context the loop starts
      with, where `sentinel` is the body's output context whose new leaves are
      `Uninitialized`.
    - `updater`: with `CARRY`, `updater(carried, new)` merges the body's output
      context into the carried one after each iteration (default: `new`).

    Register it with options through `functools.partial`:

    ```python
    import functools

    from kups.effects import ScanSemantics, default_dispatcher, default_scan_handler

    dispatcher = default_dispatcher().register_handler(
        "scan", functools.partial(default_scan_handler, threading=ScanSemantics.RESULT)
    )
    ```
    """
    check_params(eqn)
    if not isinstance(threading, ScanSemantics):
        raise TypeError(f"threading must be a ScanSemantics, got {threading!r}.")
    params = eqn.params
    num_consts, num_carry = _compat.scan_layout(params)
    body_jaxpr = params["jaxpr"]
    arg_avals = arg_avals_of(body_jaxpr)
    consts = invals[:num_consts]
    carry = invals[num_consts : num_consts + num_carry]
    xs = invals[num_consts + num_carry :]

    def trace(spec: CtxSpec) -> TracedBody:
        return trace_interpreted(interpreter, body_jaxpr, spec, name="scan")

    if threading is ScanSemantics.RESULT:
        if initializer is not None or updater is not None:
            raise ValueError(
                f"default_scan_handler for {where(eqn)}: initializer and updater apply to "
                f"ScanSemantics.CARRY; with RESULT, new context leaves are stacked and "
                f"existing ones are carried as they are."
            )
        return _scan_result(eqn, ctx, trace, consts, carry, xs)

    body, spec, ctx_values = resolve_carry(eqn, "scan", trace, ctx, initializer)
    body = with_updater(interpreter, eqn, "scan", body, arg_avals, updater)
    num_ctx = spec.num_values
    jaxpr = consts_first(body, num_ctx, num_consts)
    # Context leaves the body returns unchanged are consts, not carries, as
    # `lax.scan` does for its own carries: XLA compiles a loop-invariant carry into
    # a different (larger) program.
    body_fwd = forwarded_inputs(body.jaxpr)[:num_ctx]
    invariant = [f == body.num_consts + i for i, f in enumerate(body_fwd)]
    num_invariant = sum(invariant)
    if num_invariant:
        jaxpr = invariant_ctx_first(jaxpr, body.num_consts + num_consts, invariant, is_body=True)
    invariant_values = [v for v, inv in zip(ctx_values, invariant, strict=True) if inv]
    carried_values = [v for v, inv in zip(ctx_values, invariant, strict=True) if not inv]
    extra_consts = [*invariant_values, *body.consts]
    jaxpr, read = unused_dropped(jaxpr, len(extra_consts))
    extra_consts = [v for v, r in zip(extra_consts, read, strict=True) if r]
    new_params = _compat.scan_params(
        params,
        jaxpr=_compat.new_closed_jaxpr(jaxpr, ()),
        num_consts=len(extra_consts) + num_consts,
        num_carry=len(carried_values) + num_carry,
    )
    out = _compat.bind_equation(
        eqn.primitive,
        new_params,
        [*extra_consts, *consts, *carried_values, *carry, *xs],
    )
    carried_out = iter(out[: len(carried_values)])
    ctx_out = [
        v if inv else next(carried_out) for v, inv in zip(ctx_values, invariant, strict=True)
    ]
    return HandlerResult(body.ctx_out.unflatten(ctx_out), out[len(carried_values) :])


def _scan_result(
    eqn: JaxprEqn,
    ctx: Any,
    trace: Any,
    consts: list[Any],
    carry: list[Any],
    xs: list[Any],
) -> HandlerResult:
    spec, ctx_values = split(ctx)
    body = trace(spec)
    out_spec = body.ctx_out
    in_paths = [p for p, m in zip(spec.paths, spec.value_mask, strict=True) if m]
    out_paths = [p for p, m in zip(out_spec.paths, out_spec.value_mask, strict=True) if m]
    out_index = {p: j for j, p in enumerate(out_paths)}
    carried_pos = []
    for i, path in enumerate(in_paths):
        j = out_index.get(path)
        if j is None or not same_type(spec.avals[i], out_spec.avals[j]):
            now = "removes it" if j is None else f"makes it {out_spec.avals[j].str_short()}"
            raise ValueError(
                f"The scan body ({where(eqn)}) {now}, but context leaf "
                f"ctx{keystr(path)} ({spec.avals[i].str_short()}) existed before the "
                f"scan: with ScanSemantics.RESULT, existing leaves are carried and must "
                f"keep their shape and dtype. Leave it as it is, or use "
                f"ScanSemantics.CARRY with an initializer."
            )
        carried_pos.append(j)
    carried = set(carried_pos)
    new_pos = [j for j in range(len(out_paths)) if j not in carried]

    num_ctx_in, num_ctx_out = spec.num_values, out_spec.num_values
    outvars = body.jaxpr.outvars
    ctx_outvars, rest = outvars[:num_ctx_out], outvars[num_ctx_out:]
    jaxpr = consts_first(
        body,
        num_ctx_in,
        len(consts),
        outvars=[
            *(ctx_outvars[j] for j in carried_pos),
            *rest,
            *(ctx_outvars[j] for j in new_pos),
        ],
    )
    new_params = _compat.scan_params(
        eqn.params,
        jaxpr=_compat.new_closed_jaxpr(jaxpr, ()),
        num_consts=body.num_consts + len(consts),
        num_carry=num_ctx_in + len(carry),
    )
    out = _compat.bind_equation(
        eqn.primitive, new_params, [*body.consts, *consts, *ctx_values, *carry, *xs]
    )
    carried_out, out = out[:num_ctx_in], out[num_ctx_in:]
    num_outs = len(out) - len(new_pos)
    outs, stacked = out[:num_outs], out[num_outs:]
    values: list[Any] = [None] * num_ctx_out
    for j, value in zip(carried_pos, carried_out, strict=True):
        values[j] = value
    for j, value in zip(new_pos, stacked, strict=True):
        values[j] = value
    return HandlerResult(out_spec.unflatten(values), outs)
