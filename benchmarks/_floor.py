"""The trace-time floor: re-tracing a jaxpr, sub-programs included, with no context.

`jax.core.eval_jaxpr` re-binds a `scan` or `cond` equation with the same body
jaxpr, so it never walks the body's equations: on control flow it is not the
floor of an interpreter, which must walk (and so re-trace) every body. `retrace`
below is the smallest interpreter that does walk them: `eval_jaxpr`'s loop, plus
one re-trace per sub-jaxpr (`jit`, `scan`, `while`, `cond`, `checkpoint`), with
nothing threaded through. On a straight-line program it is `eval_jaxpr`.

It traces with kups' own adapter of JAX's internals (`kups.effects._compat`,
the same tracing kups uses); it is a measuring stick for the benchmarks, not
library code.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from kups.effects import _compat


def _trace(jaxpr: Jaxpr, consts: Sequence[Any], in_avals: Sequence[Any]) -> ClosedJaxpr:
    fn = functools.partial(retrace, jaxpr, consts)
    new, _, new_consts = _compat.trace_to_jaxpr(fn, in_avals, "floor")
    return ClosedJaxpr(new, new_consts)


def _closed(closed: ClosedJaxpr) -> ClosedJaxpr:
    return _trace(closed.jaxpr, closed.consts, closed.in_avals)


def _open(jaxpr: Jaxpr) -> Jaxpr:
    new = _trace(jaxpr, (), [v.aval for v in jaxpr.invars])
    assert not new.consts, "a const-free body re-traced into one with consts"
    return new.jaxpr


def _retraced_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    if name in ("jit", "scan"):
        return dict(params, jaxpr=_closed(params["jaxpr"]))
    if name == "while":
        return dict(
            params,
            cond_jaxpr=_closed(params["cond_jaxpr"]),
            body_jaxpr=_closed(params["body_jaxpr"]),
        )
    if name == "cond":
        return dict(params, branches=tuple(_closed(b) for b in params["branches"]))
    if name in ("checkpoint", "remat2"):
        return dict(params, jaxpr=_open(params["jaxpr"]))
    return params


def retrace(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """`jax.core.eval_jaxpr`, re-tracing the sub-programs of control flow."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    last_used = _last_used(jaxpr)

    def read(v: Any) -> Any:
        return v.val if type(v) is Literal else env[v]

    for eqn in jaxpr.eqns:
        params = _retraced_params(eqn.primitive.name, eqn.params)
        bind_params = eqn.primitive.get_bind_params(params)
        name_stack = _compat.current_name_stack() + eqn.source_info.name_stack
        with (
            _compat.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        ):
            ans = eqn.primitive.bind(*map(read, eqn.invars), **bind_params)
        if eqn.primitive.multiple_results:
            env.update(zip(eqn.outvars, ans, strict=True))
        else:
            env[eqn.outvars[0]] = ans
        for v in eqn.invars:
            if type(v) is not Literal and last_used.get(v) is eqn:
                del env[v]
    return [read(v) for v in jaxpr.outvars]


def _last_used(jaxpr: Jaxpr) -> dict[Any, Any]:
    """For each variable, the equation that reads it last (`None`: an output)."""
    last: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if type(v) is not Literal:
                last[v] = eqn
    for v in jaxpr.outvars:
        if type(v) is not Literal:
            last[v] = None
    return last
