"""Library primitives: their Python implementation interpreted, their derivative kept.

Equinox filter primitives (lineax's `linear_solve`, which optimistix's Newton
and Levenberg-Marquardt steps and diffrax's implicit solvers run) hold their
operator as a jaxpr or a Python function in their params and run it from a
Python implementation. That implementation is traceable: traced on the
equation's input types, it is the program the primitive runs, and kups walks it
with the context like any sub-program. Its derivatives stay the primitive's
own (see `_library_jvp`).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import jax
from jax._src import source_info_util as _source_info_util
from jax.extend.core import ClosedJaxpr, JaxprEqn

from .. import _compat
from .._body import trace_interpreted
from .._context import split
from .._effect import EFFECT_NAMES
from .._matching import is_control_flow
from .._types import HandlerResult
from ._library_jvp import rule_tangents

_SymbolicZero = _compat.symbolic_zero_type()


def _impl_function(primitive: Any) -> Any:
    """The primitive's Python implementation. For an equinox `vprim` it is the one
    its batching rule vmaps (lineax registers its solve's impl twice: the
    batchable one there, and one that refuses transformed inputs as `impl`)."""
    equinox_primitives = sys.modules.get("equinox.internal._primitive")
    registry = getattr(equinox_primitives, "_vprim_impl_registry", {})
    return registry.get(primitive, primitive.impl)


# Traced implementations, by equation; an equation is not weakly referable, so
# the most recent ones are kept with it (a program's equations are few).
_TRACED: collections.OrderedDict[int, tuple[JaxprEqn, ClosedJaxpr | None, str]] = (
    collections.OrderedDict()
)
_TRACED_SIZE = 256


def implementation(eqn: JaxprEqn) -> tuple[ClosedJaxpr | None, str]:
    """`eqn`'s implementation traced on its input types, as a closed jaxpr; or
    `None` and why it cannot be (no implementation, or one that needs concrete
    values)."""
    hit = _TRACED.get(id(eqn))
    if hit is not None and hit[0] is eqn:
        _TRACED.move_to_end(id(eqn))
        return hit[1], hit[2]
    primitive = eqn.primitive
    impl = _impl_function(primitive)
    avals = [v.aval for v in eqn.invars]

    def run(*args: Any) -> list[Any]:
        outs = impl(*args, **eqn.params)
        return list(outs) if primitive.multiple_results else [outs]

    traced: ClosedJaxpr | None = None
    try:
        with _no_effect_watch(), _live_traceback():
            jaxpr, out_avals, consts = _compat.trace_to_jaxpr(run, avals, primitive.name)
    except Exception as err:  # noqa: BLE001 - any failure to trace is the reason to report
        reason = (
            f"its implementation cannot be traced on abstract values "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        )
    else:
        expected = [v.aval for v in eqn.outvars]
        if all(map(_compat.typematch, out_avals, expected)):
            traced = _compat.new_closed_jaxpr(jaxpr, consts)
            reason = ""
        else:
            reason = f"its implementation returns {out_avals}, not its outputs' types {expected}"
    _TRACED[id(eqn)] = (eqn, traced, reason)
    if len(_TRACED) > _TRACED_SIZE:
        _TRACED.popitem(last=False)
    return traced, reason


class _live_traceback:
    """The equations of an implementation are the library's lines, not the line
    of the equation that binds the primitive (which the interpreter made the
    current traceback): `user_context(None)` keeps the traceback it replaces,
    so the context is set without one."""

    def __enter__(self) -> None:
        self.previous = _source_info_util._source_info_context.context
        _source_info_util._source_info_context.context = _source_info_util.SourceInfo(
            None, self.previous.name_stack
        )

    def __exit__(self, *exc: Any) -> None:
        _source_info_util._source_info_context.context = self.previous


class _no_effect_watch:
    """Tracing an implementation binds the effects inside it into the traced
    jaxpr, where the interpreter then sees them: nothing is lost, so an outer
    interpreter binding an equation unchanged must not be told of them."""

    def __enter__(self) -> None:
        from .._effect import UNSEEN

        self.previous, UNSEEN.top = UNSEEN.top, None

    def __exit__(self, *exc: Any) -> None:
        from .._effect import UNSEEN

        UNSEEN.top = self.previous


def entered_implementation(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The traced implementation of `eqn` when the default dispatcher goes inside
    it (a library primitive kups enters by default, whose implementation
    traces); `None` otherwise."""
    from .._defaults import DEFAULT_HANDLERS  # which imports this module

    if DEFAULT_HANDLERS.get(eqn.primitive.name) is not default_library_primitive_handler:
        return None
    return implementation(eqn)[0]


def enters(eqn: JaxprEqn) -> bool:
    """Whether the default dispatcher goes inside `eqn`."""
    return entered_implementation(eqn) is not None


def default_library_primitive_handler(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """Goes inside a library primitive whose implementation is a traceable Python
    function (an equinox filter primitive such as lineax's `linear_solve`).

    The implementation, traced on the equation's input types, is interpreted with
    the context, so effects and counts reach what the primitive runs; it runs
    once (an ordered callback inside runs once, as in plain JAX). Derivatives are
    the primitive's own: a `custom_jvp` whose rule is the primitive's JVP rule,
    with the primitive's re-bind of its primal replaced by the outputs computed
    here, so `jax.jvp`, `jax.grad` and higher orders of the interpreted program
    are plain JAX's (lineax's implicit derivatives, its transposed solves). The
    context carries zero tangents. Under `jax.vmap` the implementation is
    vmapped, as equinox batches a `vprim`.

    A primitive whose implementation cannot be traced (equinox's `noinline`
    looks its function up from a traced index) is left to the interpreter as if
    it had no handler: by its policy, with the reason.

    **Example:**

    ```python
    from kups.effects import default_dispatcher, default_library_primitive_handler

    dispatcher = default_dispatcher().register_handler(
        "linear_solve", default_library_primitive_handler
    )
    ```
    """
    impl_jaxpr, reason = implementation(eqn)
    if impl_jaxpr is None:
        return _opaque(interpreter, ctx, eqn, invals, reason)
    spec, ctx_values = split(ctx)
    body = trace_interpreted(interpreter, impl_jaxpr, spec, name=eqn.primitive.name)

    def primal(ctx_values: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
        return body.call(ctx_values, args)

    def primal_jvp(primals: Any, tangents: Any) -> Any:
        ctx_values, args = primals
        _, arg_tangents = tangents
        ctx_out, outs = wrapped(ctx_values, args)
        out_tangents = rule_tangents(eqn, args, arg_tangents, outs)
        ctx_tangents = [_SymbolicZero(jax.typeof(c).to_tangent_aval()) for c in ctx_out]
        return (ctx_out, outs), (ctx_tangents, out_tangents)

    wrapped = jax.custom_jvp(primal)
    wrapped.defjvp(primal_jvp, symbolic_zeros=True)
    ctx_out, outs = wrapped(ctx_values, list(invals))
    return HandlerResult(body.ctx_out.unflatten(ctx_out), list(outs))


def _opaque(
    interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any], reason: str
) -> HandlerResult:
    """What the interpreter does with a library primitive that has no handler,
    with the reason kups cannot go inside it in its error."""
    if is_control_flow(eqn):
        try:
            return HandlerResult(ctx, interpreter._unhandled(eqn, invals))
        except NotImplementedError as err:
            raise NotImplementedError(f"{err} (kups does not go inside it: {reason})") from None
    fallback = interpreter.dispatcher.fallback_handler
    if fallback is not None:
        ctx, outvals = interpreter._dispatch(fallback, ctx, eqn, invals)
        return HandlerResult(ctx, outvals)
    watch_effects = not EFFECT_NAMES.isdisjoint(interpreter.dispatcher.handlers)
    outvals = interpreter._bind_unchanged(eqn, invals, watch_effects)
    if watch_effects and _compat.is_staging():
        interpreter._probe(eqn)
    return HandlerResult(ctx, outvals)
