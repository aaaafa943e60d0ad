"""A control-flow primitive that kups has no handler for, as libraries define them.

`library_call(fn, *args)` runs `fn(*args)` through the primitive
`library_call`, which holds `fn`'s jaxpr inside a tuple parameter (as lineax's
`linear_solve` and other equinox filter primitives do). kups recognises it as
control flow, but has no handler that walks its sub-program: it is opaque.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.core
from jax.extend.core import Primitive
from jax.interpreters import mlir

library_call_p = Primitive("library_call")
library_call_p.multiple_results = True


def _impl(*args: Any, program: tuple[Any, ...]) -> list[Any]:
    (closed,) = program
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _abstract_eval(*avals: Any, program: tuple[Any, ...]) -> list[Any]:
    del avals
    (closed,) = program
    return [var.aval for var in closed.jaxpr.outvars]


library_call_p.def_impl(_impl)
library_call_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(library_call_p, mlir.lower_fun(_impl, multiple_results=True))


def library_call(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(*args)` (a list of its outputs) through the opaque primitive. `fn` must
    not close over traced values."""
    closed = jax.make_jaxpr(fn)(*args)
    return library_call_p.bind(*args, program=(closed,))


# A primitive that holds a Python function rather than a jaxpr (as lineax's
# `linear_solve` does with an operator function that closes over nothing):
# it traces the function for its output types and runs it for its values, so
# kups finds no sub-program in its params.
library_fn_call_p = Primitive("library_fn_call")
library_fn_call_p.multiple_results = True


def _fn_impl(*args: Any, fn: Callable[..., Any]) -> list[Any]:
    return list(fn(*args))


def _fn_abstract_eval(*avals: Any, fn: Callable[..., Any]) -> list[Any]:
    shapes = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in shapes]


library_fn_call_p.def_impl(_fn_impl)
library_fn_call_p.def_abstract_eval(_fn_abstract_eval)
mlir.register_lowering(library_fn_call_p, mlir.lower_fun(_fn_impl, multiple_results=True))


def library_fn_call(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(*args)` (a list of its outputs) through a primitive that holds `fn`
    itself: `fn` returns a tuple of arrays and must not close over traced values."""
    return library_fn_call_p.bind(*args, fn=fn)
