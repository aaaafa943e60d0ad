"""What a library primitive runs: its Python implementation, traced to a jaxpr.

Equinox filter primitives (lineax's `linear_solve`, which optimistix's Newton
and Levenberg-Marquardt steps and diffrax's implicit solvers run) hold their
operator as a jaxpr or a Python function in their params and run it from a
Python implementation. That implementation is traceable: traced on the
equation's input types, it is the program the primitive runs.

This module sits below `_matching` (and below the handlers), so that
`sub_jaxprs` and `is_library_primitive` know which primitives the default
dispatcher goes inside, reading `_registry.DEFAULT_HANDLERS`, without importing
the handler that does it (`handlers._library`).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from jax.extend.core import ClosedJaxpr, JaxprEqn

from . import _compat
from ._effect import seen
from ._registry import DEFAULT_HANDLERS

_H = TypeVar("_H", bound=Callable[..., Any])

# The handlers that interpret the implementation of the primitive they take.
_IMPLEMENTATION_HANDLERS: set[Any] = set()


def interprets_implementation(handler: _H) -> _H:
    """Marks `handler` as one that goes inside the implementation of the library
    primitive it takes: where it is a primitive's default handler, `sub_jaxprs`
    gives that implementation and `is_library_primitive` is false."""
    _IMPLEMENTATION_HANDLERS.add(handler)
    return handler


def _impl_function(primitive: Any) -> Any:
    """The primitive's Python implementation. For an equinox `vprim` it is the one
    its batching rule vmaps (lineax registers its solve's impl twice: the
    batchable one there, and one that refuses transformed inputs as `impl`)."""
    if primitive.name == "call_hi_primitive":
        # JAX's own (from 0.12: `lax.custom_root`, `jnp.searchsorted`, ...): the
        # object in its params expands into the primitives it stands for.
        return primitive.to_lojax
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
        # Tracing binds the effects inside the implementation into the traced
        # jaxpr, where the interpreter then sees them: an outer interpreter
        # binding an equation unchanged must not be told of them (`seen`). The
        # equations are the library's lines, not the line of the equation that
        # binds the primitive (the interpreter's current traceback).
        with seen(), _compat.without_traceback():
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


def entered_implementation(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The traced implementation of `eqn` when the default dispatcher goes inside
    it (its default handler interprets the implementation, and the
    implementation traces); `None` otherwise."""
    if DEFAULT_HANDLERS.get(eqn.primitive.name) not in _IMPLEMENTATION_HANDLERS:
        return None
    return implementation(eqn)[0]


def enters(eqn: JaxprEqn) -> bool:
    """Whether the default dispatcher goes inside `eqn`."""
    return entered_implementation(eqn) is not None
