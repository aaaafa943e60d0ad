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
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

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


# A library primitive with every rule, as an equinox filter primitive has them:
# `library_solve(a, b)` solves `a @ x = b` by `solve_fn` (a Python function in its
# params) from a Python implementation, which also reports each run through a
# host callback to `on_run`. Its JVP rule binds the primitive again for the
# primal and for the tangent solve (as lineax's does), its transpose rule (in
# `b`) solves with `a.T`, and its batching rule vmaps the implementation.
library_solve_p = Primitive("library_solve")
library_solve_p.multiple_results = True


def _solve_impl(a: Any, b: Any, *, solve_fn: Callable[..., Any], on_run: Any) -> list[Any]:
    if on_run is not None:
        jax.debug.callback(on_run, b)
    return [solve_fn(a, b)]


def _solve_abstract_eval(a: Any, b: Any, **params: Any) -> list[Any]:
    del a, params
    return [jax.core.ShapedArray(b.shape, b.dtype)]


def _solve_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[list[Any], list[Any]]:
    a, b = primals
    a_dot, b_dot = tangents
    (x,) = library_solve_p.bind(a, b, **params)
    rhs = ad.instantiate_zeros(b_dot)
    if type(a_dot) is not ad.Zero:
        rhs = rhs - a_dot @ x
    (x_dot,) = library_solve_p.bind(a, rhs, **params)
    return [x], [x_dot]


def _solve_transpose(cts: Any, a: Any, b: Any, **params: Any) -> list[Any]:
    assert not ad.is_undefined_primal(a) and ad.is_undefined_primal(b)
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, ad.Zero(b.aval)]
    (ct_b,) = library_solve_p.bind(a.T, ct, **params)
    return [None, ct_b]


def _solve_batch(args: Any, dims: Any, **params: Any) -> tuple[list[Any], list[int]]:
    a, b = (jnp.moveaxis(x, d, 0) if d is not None else x for x, d in zip(args, dims))
    in_axes = tuple(None if d is None else 0 for d in dims)
    return jax.vmap(lambda a, b: _solve_impl(a, b, **params), in_axes=in_axes)(a, b), [0]


library_solve_p.def_impl(_solve_impl)
library_solve_p.def_abstract_eval(_solve_abstract_eval)
ad.primitive_jvps[library_solve_p] = _solve_jvp
ad.primitive_transposes[library_solve_p] = _solve_transpose
batching.primitive_batchers[library_solve_p] = _solve_batch
mlir.register_lowering(library_solve_p, mlir.lower_fun(_solve_impl, multiple_results=True))


def library_solve(a: Any, b: Any, on_run: Any = None) -> Any:
    """`jnp.linalg.solve(a, b)` through the library primitive; `on_run(b)` is
    called (a host callback) each time its implementation runs."""
    (x,) = library_solve_p.bind(a, b, solve_fn=jnp.linalg.solve, on_run=on_run)
    return x
