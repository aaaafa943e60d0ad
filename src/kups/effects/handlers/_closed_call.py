"""`closed_call` (and `core.call`): the body is interpreted inline."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .._types import HandlerResult


def default_closed_call_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the body of a `closed_call` (or `call`) inline with the context.

    The call boundary is not kept: it has no effect on the compiled program.
    """
    outs, ctx = interpreter(eqn.params["call_jaxpr"], ctx, *invals)
    return HandlerResult(ctx, outs)
