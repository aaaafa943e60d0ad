"""`checkpoint` / `remat`: the body is interpreted inside the same remat boundary."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params


@default_handler_for("remat2")
def default_checkpoint_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets a `jax.checkpoint` body inside a checkpoint with the original
    `policy` and `prevent_cse`, so the rematerialisation boundary stays."""
    check_params(eqn)
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, eqn.params["jaxpr"], spec, name="checkpoint")
    new_params = dict(eqn.params, jaxpr=body.jaxpr)
    prevent_cse = eqn.params["prevent_cse"]
    if isinstance(prevent_cse, tuple):
        # One flag per input (`jax.checkpoint(..., prevent_cse=(False, True))`): the
        # body's consts and the context come first, with CSE prevented as by default.
        extra = len(body.jaxpr.invars) - len(prevent_cse)
        new_params["prevent_cse"] = (True,) * extra + prevent_cse
    out = _compat.bind_equation(eqn.primitive, new_params, [*body.consts, *ctx_values, *invals])
    return HandlerResult(body.ctx_out.unflatten(out[: body.num_ctx_out]), out[body.num_ctx_out :])
