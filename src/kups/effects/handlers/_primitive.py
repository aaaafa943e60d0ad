"""The handler that re-binds an equation unchanged."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .. import _compat
from .._types import HandlerResult


def default_primitive_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Re-binds the equation's primitive on `invals`; the context is unchanged.

    Use it from a handler that only observes an equation:

    ```python
    def log_sin(interpreter, ctx, eqn, invals):
        result = default_primitive_handler(interpreter, ctx, eqn, invals)
        return HandlerResult(ctx + 1, result.outvals)
    ```

    On a control-flow equation (`jit`, `scan`, `while`, ...) it re-binds the
    sub-programs as they are, not interpreted: the handlers of the equations
    inside do not run. To observe one and still interpret its body, call its
    default handler with your interpreter, which threads the context through:

    ```python
    import jax
    import jax.numpy as jnp
    from kups.effects import (
        HandlerResult,
        Interpreter,
        default_dispatcher,
        default_primitive_handler,
        reinterpret,
    )


    def count(interpreter, ctx, eqn, invals):
        result = default_primitive_handler(interpreter, ctx, eqn, invals)
        return HandlerResult({**ctx, "sin": ctx["sin"] + 1}, result.outvals)


    def count_jit(interpreter, ctx, eqn, invals):
        inner = default_dispatcher().handler_for(eqn.primitive)
        ctx, outvals = inner(interpreter, {**ctx, "jit": ctx["jit"] + 1}, eqn, invals)
        return HandlerResult(ctx, outvals)


    dispatcher = default_dispatcher().register_handler("sin", count)
    dispatcher.register_handler("jit", count_jit)
    _, ctx = reinterpret(jax.jit(jnp.sin), Interpreter(dispatcher))({"sin": 0, "jit": 0}, 1.0)
    assert ctx == {"sin": 1, "jit": 1}
    ```
    """
    del interpreter
    return HandlerResult(ctx, _compat.bind_equation(eqn.primitive, eqn.params, invals))
