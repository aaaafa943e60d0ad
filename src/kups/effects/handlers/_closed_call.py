"""`closed_call`, `eval_jaxpr` (JAX 0.11+) and `core.call`: the body is interpreted
inline."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params


# `eval_jaxpr`: a call of a jaxpr, from JAX 0.11.
@default_handler_for("eval_jaxpr", "closed_call", "call")
def default_closed_call_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the body of a `closed_call` (or `eval_jaxpr`, `call`) inline with
    the context.

    The call boundary is not kept: it has no effect on the compiled program.
    """
    check_params(eqn)
    outs, ctx = interpreter(eqn.params["call_jaxpr"], ctx, *invals)
    return HandlerResult(ctx, outs)
