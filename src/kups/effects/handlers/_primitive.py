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
    """
    del interpreter
    return HandlerResult(ctx, _compat.bind_equation(eqn.primitive, eqn.params, invals))
