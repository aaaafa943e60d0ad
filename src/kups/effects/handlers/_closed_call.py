"""`closed_call`, `eval_jaxpr` (JAX 0.11+), `core.call` and `lax.composite`: the
body is interpreted inline."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params


# `eval_jaxpr`: a call of a jaxpr, from JAX 0.11.
@default_handler_for("eval_jaxpr", "closed_call", "call", "composite")
def default_closed_call_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets the body of a `closed_call` (or `eval_jaxpr`, `call`) inline with
    the context.

    The call boundary is not kept: it has no effect on the compiled program. A
    `lax.composite` is such a call of its decomposition: interpreted, it is inlined
    (a composite no handler acts in is re-bound whole, with its name).
    """
    check_params(eqn)
    # A composite's is `jaxpr` up to JAX 0.10, `call_jaxpr` from 0.11.
    body = eqn.params["call_jaxpr" if "call_jaxpr" in eqn.params else "jaxpr"]
    outs, ctx = interpreter(body, ctx, *invals)
    return HandlerResult(ctx, outs)
