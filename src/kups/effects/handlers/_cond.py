"""`cond` and `switch`: every branch interpreted, the taken one's context kept."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import TracedBody, interpret_fn, trace_body, trace_interpreted
from .._context import CtxSpec, diff, split
from .._registry import default_handler_for
from .._source import where
from .._types import HandlerResult
from .._validation import check_params
from ._loop import forwarded_inputs


@default_handler_for("cond")
def default_cond_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets every branch of a `cond` or `switch` (any number of branches) with
    the context; the taken branch's outputs and context come out.

    Every branch must return the same context structure, shapes and dtypes; a
    `ValueError` names the branches and the differing context paths otherwise.
    """
    check_params(eqn)
    branches = eqn.params["branches"]
    index, operands = invals[0], invals[1:]
    spec, ctx_values = split(ctx)
    traced = [
        trace_interpreted(interpreter, branch, spec, name=f"cond branch {i}")
        for i, branch in enumerate(branches)
    ]
    first = traced[0]
    for i, other in enumerate(traced[1:], start=1):
        if not other.ctx_out.same_as(first.ctx_out):
            raise ValueError(
                f"The branches of the cond/switch ({where(eqn)}) return different "
                f"contexts (branch 0 vs branch {i}):\n"
                + "\n".join(diff(first.ctx_out, other.ctx_out))
                + "\nEvery branch must leave the context with the same structure, shapes "
                "and dtypes: give the other branches the same leaves (for example with "
                "zeros), or have the handler add them before the cond."
            )
    traced = _join_varying_ctx(interpreter, branches, spec, traced)
    first = traced[0]
    num_ctx = first.num_ctx_out
    # A context leaf that every branch returns unchanged bypasses the cond, as
    # `lax.cond` forwards such outputs itself: under `vmap` with a batched
    # predicate, it would otherwise come out batched.
    forwarded = _forwarded_ctx(traced, num_ctx, spec.num_values)
    # Every branch takes the consts of all branches, then the context and operands.
    all_consts = [c for body in traced for c in body.consts]
    const_avals = [v.aval for body in traced for v in body.jaxpr.invars[: body.num_consts]]
    new_branches = []
    offset = 0
    for body in traced:
        own = body.jaxpr.invars[: body.num_consts]
        padding_before = [_compat.new_var(a) for a in const_avals[:offset]]
        padding_after = [_compat.new_var(a) for a in const_avals[offset + body.num_consts :]]
        invars = [*padding_before, *own, *padding_after, *body.jaxpr.invars[body.num_consts :]]
        outvars = [v for v, f in zip(body.jaxpr.outvars, forwarded, strict=False) if f is None]
        outvars += body.jaxpr.outvars[num_ctx:]
        new_branches.append(
            _compat.new_closed_jaxpr(
                _compat.replace_jaxpr(body.jaxpr, invars=invars, outvars=outvars), ()
            )
        )
        offset += body.num_consts
    # Context values no branch reads stay out of the cond, as the scan, jit and
    # shard_map handlers leave them out of their calls.
    new_branches, ctx_read = _unread_ctx_dropped(new_branches, len(all_consts), len(ctx_values))
    read_values = [v for v, r in zip(ctx_values, ctx_read, strict=True) if r]
    new_params = _compat.cond_params(eqn.params, branches=tuple(new_branches))
    out = _compat.bind_equation(
        eqn.primitive, new_params, [index, *all_consts, *read_values, *operands]
    )
    num_passed = forwarded.count(None)
    passed = iter(out[:num_passed])
    ctx_out = [next(passed) if f is None else ctx_values[f] for f in forwarded]
    return HandlerResult(first.ctx_out.unflatten(ctx_out), out[num_passed:])


def _unread_ctx_dropped(
    branches: list[Any], num_consts: int, num_ctx: int
) -> tuple[list[Any], list[bool]]:
    """The branches without the context inputs (after `num_consts` consts) that no
    branch reads, and which context inputs stay."""
    opened = [_compat.open_jaxpr(branch)[0] for branch in branches]
    read = [False] * num_ctx
    for jaxpr in opened:
        used = {v for e in jaxpr.eqns for v in e.invars if _compat.is_var(v)}
        used.update(v for v in jaxpr.outvars if _compat.is_var(v))
        for i, var in enumerate(jaxpr.invars[num_consts : num_consts + num_ctx]):
            read[i] = read[i] or var in used
    if all(read) or _compat.has_input_effects_any(opened):
        return branches, [True] * num_ctx
    new = []
    for jaxpr in opened:
        ctx_vars = jaxpr.invars[num_consts : num_consts + num_ctx]
        invars = [
            *jaxpr.invars[:num_consts],
            *(v for v, r in zip(ctx_vars, read, strict=True) if r),
            *jaxpr.invars[num_consts + num_ctx :],
        ]
        new.append(_compat.new_closed_jaxpr(_compat.replace_jaxpr(jaxpr, invars=invars), ()))
    return new, read


def _forwarded_ctx(traced: list[TracedBody], num_ctx: int, num_ctx_in: int) -> list[int | None]:
    """For each context output, the index of the context input that every branch
    returns unchanged, or `None`."""
    forwarded: list[int | None] = []
    per_branch = [forwarded_inputs(body.jaxpr)[:num_ctx] for body in traced]
    for i in range(num_ctx):
        sources = {
            None if (source := fwd[i]) is None else source - body.num_consts
            for fwd, body in zip(per_branch, traced, strict=True)
        }
        source = sources.pop() if len(sources) == 1 else None
        forwarded.append(source if source is not None and 0 <= source < num_ctx_in else None)
    return forwarded


def _join_varying_ctx(
    interpreter: Any, branches: Sequence[Any], spec: CtxSpec, traced: list[TracedBody]
) -> list[TracedBody]:
    """Inside `shard_map`, JAX 0.10 needs every branch of a cond to return values
    that vary over the same manual axes. When one branch makes a context leaf
    per-shard and another leaves it replicated, the branches are traced again with
    each context leaf cast on the way out to vary over the union of their axes."""
    out_axes = [[_compat.varying_axes(a) for a in body.ctx_out.avals] for body in traced]
    joined = [frozenset().union(*axes) for axes in zip(*out_axes, strict=True)]
    if all(axes == joined for axes in out_axes):
        return traced

    def cast_out(branch: Any) -> Any:
        interpret = interpret_fn(interpreter, branch)

        def fn(ctx: Any, *args: Any) -> tuple[list[Any], Any]:
            outs, new_ctx = interpret(ctx, *args)
            out_spec, values = split(new_ctx)
            cast = []
            for value, want in zip(values, joined, strict=True):
                missing = want - _compat.varying_axes(_compat.aval_of(value))
                if missing:
                    value = jax.lax.pcast(value, tuple(sorted(missing, key=str)), to="varying")
                cast.append(value)
            return outs, out_spec.unflatten(cast)

        return fn

    return [
        trace_body(interpreter, cast_out(branch), spec, branch.in_avals, name=f"cond branch {i}")
        for i, branch in enumerate(branches)
    ]
