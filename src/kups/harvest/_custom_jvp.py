"""`reap` of a `custom_jvp` function whose JVP rule sows.

JAX runs the rule only under a `jvp` or `grad`; when that derivative is taken
outside `reap`, JAX runs it while `reap` binds the function, out of the
interpreter's sight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from kups.effects import (
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    default_custom_jvp_handler,
    reinterpret,
    source_line,
)

from ._names import SowPath
from ._reaped import Reaped
from ._selection import Selection
from ._sow import watching


def reap_custom_jvp(
    reaper: Any, interpreter: Interpreter, ctx: Reaped, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """A `custom_jvp` function, whose JVP rule may sow. Under a `jvp` (or `grad`)
    applied outside `reap`, JAX runs the rule while this handler binds the
    function, out of the interpreter's sight; the sows it binds there are seen
    by `watching`, and their values are reaped from the rule run once more
    under a `reap` of those names, at the primal inputs, with zero tangents
    (the tangent of a value reaped from a rule is zero, as in Oryx)."""
    in_rule: set[SowPath] = set()

    def watch(params: dict[str, Any]) -> None:
        path = (*params["scope"], params["name"])
        if params["tag"] == reaper.tag and reaper.selection.takes(path):
            in_rule.add(path)

    with watching(watch):
        result = default_custom_jvp_handler(interpreter, ctx, eqn, invals)
    if not in_rule:
        return result
    inner = type(reaper)(Selection(reaper.tag, frozenset(in_rule), frozenset(), False))
    rule_interpreter = inner.interpreter("reap", InterpreterPolicy.IGNORE)
    primals = [jax.lax.stop_gradient(x) for x in invals]
    _, sown = reinterpret(_rule_of(eqn), rule_interpreter)(Reaped(reaper.tag, {}, {}), primals)
    out: Reaped = result.ctx
    where = f"the custom_jvp rule of the function called at {source_line(eqn)}"
    for path, value in sorted(sown.values.items()):
        mode = sown.modes[path]
        if path in out.modes and path not in ctx.modes:
            # Also sown by the function itself (which the rule may call): the
            # function's sow stands for both, as when no jvp runs the rule.
            continue
        if path in out.modes:
            reaper.check_again(out, path, mode, where)
        else:
            reaper.first_sown.setdefault(path, where)
        out = out.sown(path, value, mode)
    return HandlerResult(out, result.outvals)


def _rule_of(eqn: JaxprEqn) -> Callable[[list[Any]], Any]:
    """The JVP rule of a `custom_jvp_call` equation, run at `primals` with zero
    tangents (how `jax.jvp` runs it)."""

    def rule(primals: list[Any]) -> Any:
        def function(*args: Any) -> Any:
            # The staged params as `bind` takes them (a dict holding `subfuns`
            # since JAX 0.9.2, below kups' floor).
            return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))

        tangents = [_zero_tangent(x) for x in primals]
        return jax.jvp(function, tuple(primals), tuple(tangents))

    return rule


def _zero_tangent(x: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)
