"""`jit`: the body is re-jitted with the context as an extra input and output."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._types import HandlerResult
from ._loop import forwarded_inputs, unused_dropped


def default_jit_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets a `jit` body and jits it again, with the context threaded through.

    The user's in/out shardings and layouts, donation (of the user's arguments,
    never of the context), `keep_unused`, `inline`, compiler options and name are
    kept; the context enters and leaves unsharded and undonated.
    """
    params = eqn.params
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, params["jaxpr"], spec, name=f"jit {params['name']}")
    inputs = [*body.consts, *ctx_values, *invals]
    # Context values the body returns unchanged are taken from outside, not made
    # outputs of the jit: a jit whose outputs nobody uses then stays dead code, as
    # in the original program (a live one can change how XLA shards around it).
    num_ctx_out = body.num_ctx_out
    forwarded = forwarded_inputs(body.jaxpr)[:num_ctx_out]
    outvars = body.jaxpr.outvars
    kept = [v for v, f in zip(outvars[:num_ctx_out], forwarded, strict=True) if f is None]
    jaxpr = _compat.replace_jaxpr(body.jaxpr, outvars=[*kept, *outvars[num_ctx_out:]])
    num_extra = body.num_consts + spec.num_values
    jaxpr, read = unused_dropped(jaxpr, num_extra)
    args = [*(x for x, r in zip(inputs[:num_extra], read, strict=True) if r), *invals]
    num_extra_in = sum(read)
    num_extra_out = len(kept)
    new_params = dict(
        params,
        jaxpr=_compat.new_closed_jaxpr(jaxpr, ()),
        in_shardings=(_compat.UNSPECIFIED,) * num_extra_in + tuple(params["in_shardings"]),
        out_shardings=(_compat.UNSPECIFIED,) * num_extra_out + tuple(params["out_shardings"]),
        in_layouts=(None,) * num_extra_in + tuple(params["in_layouts"]),
        out_layouts=(None,) * num_extra_out + tuple(params["out_layouts"]),
        donated_invars=(False,) * num_extra_in + tuple(params["donated_invars"]),
    )
    out = _compat.bind_equation(eqn.primitive, new_params, args)
    computed = iter(out[:num_extra_out])
    ctx_out = [next(computed) if f is None else inputs[f] for f in forwarded]
    return HandlerResult(body.ctx_out.unflatten(ctx_out), out[num_extra_out:])
