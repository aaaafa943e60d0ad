"""`jit`: the body is re-jitted with the context as an extra input and output."""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._registry import default_handler_for
from .._types import HandlerResult
from .._validation import check_params
from ._loop import trim_call


# `pjit`: the name of `jit` before JAX 0.7.
@default_handler_for("jit")
def default_jit_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Interprets a `jit` body and jits it again, with the context threaded through.

    The user's in/out shardings and layouts, donation (of the user's arguments,
    never of the context), `keep_unused`, `inline`, compiler options and name are
    kept; the context enters and leaves unsharded and undonated.
    """
    check_params(eqn)
    params = eqn.params
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, params["jaxpr"], spec, name=f"jit {params['name']}")
    inputs = [*body.consts, *ctx_values, *invals]
    call = trim_call(body.jaxpr, body.num_consts + spec.num_values, body.num_ctx_out)
    args = call.inputs(inputs)
    # Concrete constants the body closes over stay constants of the jitted body, as
    # in the user's program, so that XLA folds what it folded there (passed as
    # arguments instead, `x * jnp.exp(c)` differs in the last bits); traced ones
    # (values of an enclosing trace) must be arguments.
    num_kept_consts = sum(call.kept_in[: body.num_consts])
    closed_over = [not isinstance(c, _compat.Tracer) for c in args[:num_kept_consts]]
    jaxpr, constants = _compat.close_over(call.jaxpr, closed_over, args[:num_kept_consts])
    args = [*(a for a, c in zip(args, closed_over) if not c), *args[num_kept_consts:]]
    num_extra_in = sum(call.kept_in) - len(constants)
    num_extra_out = len(call.kept_out)
    new_params = dict(
        params,
        jaxpr=_compat.new_closed_jaxpr(jaxpr, constants),
        in_shardings=(_compat.UNSPECIFIED,) * num_extra_in + tuple(params["in_shardings"]),
        out_shardings=(_compat.UNSPECIFIED,) * num_extra_out + tuple(params["out_shardings"]),
        in_layouts=(None,) * num_extra_in + tuple(params["in_layouts"]),
        out_layouts=(None,) * num_extra_out + tuple(params["out_layouts"]),
        donated_invars=(False,) * num_extra_in + tuple(params["donated_invars"]),
    )
    out = _compat.bind_equation(eqn.primitive, new_params, args)
    ctx_out, outs = call.outputs(inputs, out)
    return HandlerResult(body.ctx_out.unflatten(ctx_out), outs)
