"""Which equations hold sub-programs that run as part of the program."""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax.extend.random
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from . import _compat
from ._library_impl import entered_implementation, enters

# Primitives whose jaxpr parameters are combiners (how to add two elements, how to
# compare them), not sub-programs of the user's: they are re-bound as they are.
COMBINER_PRIMITIVES: frozenset[str] = frozenset(
    {
        "scatter",
        "scatter-add",
        "scatter_add",
        "scatter-mul",
        "scatter_mul",
        "scatter-min",
        "scatter_min",
        "scatter-max",
        "scatter_max",
        "scatter-sub",
        "scatter_sub",
        "scatter-apply",
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "select_and_scatter_add",
        "select_and_gather_add",
        "sort",
        "argsort",
    }
)

_JAXPR_TYPES = (Jaxpr, ClosedJaxpr)
_SCALAR_TYPES = (str, bytes, int, float, bool)
# Types of param values that hold no jaxpr and no function, compared by exact type
# first: the params of most equations are only these, and every equation is checked.
_PLAIN_TYPES = frozenset({str, bytes, int, float, bool, type(None), np.dtype})


def _jaxprs_in(value: Any, depth: int) -> Iterator[Jaxpr | ClosedJaxpr]:
    if isinstance(value, _JAXPR_TYPES):
        yield value
    elif depth == 0 or isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return
    elif isinstance(value, (tuple, list)):  # namedtuples too (custom_linear_solve)
        for item in value:
            yield from _jaxprs_in(item, depth - 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _jaxprs_in(item, depth - 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Equinox modules (the params of equinox filter primitives, such as
        # lineax's `linear_solve`) and other dataclasses.
        for field in dataclasses.fields(value):
            yield from _jaxprs_in(getattr(value, field.name, None), depth - 1)


def subjaxprs(params: dict[str, Any]) -> Iterator[Jaxpr | ClosedJaxpr]:
    """Every jaxpr in an equation's params, wherever it sits: directly, or inside
    tuples, lists, dicts, namedtuples and dataclasses (equinox modules), a few
    levels deep."""
    for value in params.values():
        yield from _jaxprs_in(value, _MAX_DEPTH)


# How deep params are searched for jaxprs: JAX's own primitives hold them at
# depth 1 or 2; library primitives a little deeper.
_MAX_DEPTH = 6


def has_jaxpr_params(params: dict[str, Any]) -> bool:
    # Called on every equation a walk meets: most params are None or scalars, so
    # those are passed over without building a generator.
    for value in params.values():
        kind = type(value)
        if kind in _PLAIN_TYPES or isinstance(value, _SCALAR_TYPES):
            continue
        if kind is tuple and all(type(item) in _PLAIN_TYPES for item in value):
            continue  # shapes, axes, dimensions
        if next(_jaxprs_in(value, _MAX_DEPTH), None) is not None:
            return True
    return False


def is_control_flow(eqn: JaxprEqn) -> bool:
    """Whether `eqn` runs sub-programs of the user's (not only combiners)."""
    name = eqn.primitive.name
    # Every scatter holds its combiner as `update_jaxpr` (the list above names the
    # others; a scatter JAX adds later is one too).
    if name in COMBINER_PRIMITIVES or name.startswith("scatter"):
        return False
    return has_jaxpr_params(eqn.params)


def contains_subjaxprs(ctx: Any, eqn: JaxprEqn, invals: list[Any]) -> bool:
    """The stock matching rule: true for control-flow equations.

    True when `eqn`'s parameters hold sub-programs that run as part of the program
    (`jit`, `scan`, `while`, `cond`, `shard_map`, ...); false for equations with no
    jaxpr and for those whose only jaxprs are combiners (`scatter-add`'s
    `update_jaxpr`, generic `reduce`, `reduce_window`, `sort`).

    **Arguments:**

    - `ctx`: the current context (unused).
    - `eqn`: the equation.
    - `invals`: its input values (unused).

    **Returns:**

    Whether `eqn` is a control-flow equation.
    """
    del ctx, invals
    return is_control_flow(eqn)


def sub_jaxprs(eqn: JaxprEqn) -> tuple[Jaxpr, ...]:
    """The sub-programs a control-flow equation runs, as open jaxprs.

    Every jaxpr in the equation's params, wherever it sits (inside tuples, dicts
    or equinox modules of a library primitive too); for a library primitive the
    default dispatcher goes inside (lineax's `linear_solve`), its traced
    implementation, which is what kups interprets; none for an equation whose
    only jaxprs are combiners (`scatter-add`'s `update_jaxpr`, `reduce`, `sort`).
    Effects use it to walk a program ahead of running it: which primitives it
    reaches, how deep its loops nest.

    **Example:**

    ```python
    import jax
    from jax import lax
    from kups.effects import sub_jaxprs

    closed = jax.make_jaxpr(lambda x: lax.fori_loop(0, 3, lambda i, c: c * 2.0, x))(1.0)
    (loop,) = [e for e in closed.jaxpr.eqns if sub_jaxprs(e)]
    assert any(e.primitive.name == "mul" for s in sub_jaxprs(loop) for e in s.eqns)
    ```
    """
    implementation = entered_implementation(eqn)
    if implementation is not None:  # what a library primitive kups enters runs
        return (implementation.jaxpr,)
    if not is_control_flow(eqn):
        return ()
    return tuple(
        sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub for sub in subjaxprs(eqn.params)
    )


# The primitives that run one sub-program on their inputs, one for one, and give
# its outputs as theirs.
CALL_PRIMITIVES: frozenset[str] = frozenset(
    {
        "jit",
        "closed_call",
        "call",
        "eval_jaxpr",  # what `closed_call` and `call` became in JAX 0.11
        "remat2",  # `jax.checkpoint`'s (printed `checkpoint`)
        "custom_jvp_call",
        "custom_vjp_call",
        "composite",
    }
)
"""Names of the primitives that call one sub-program on their inputs, one for
one, and give its outputs as theirs: `jax.jit`'s, `closed_call` and `call`
(`eval_jaxpr` from JAX 0.11), `jax.checkpoint`'s (named `remat2`, printed
`checkpoint`), the custom-derivative calls (`custom_jvp_call`,
`custom_vjp_call`: their primal function) and `lax.composite` (its
decomposition). `call_body` gives the sub-program;
the names are for registering a handler, or a wrapper of one, for each."""


def call_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The sub-program of a call (see `CALL_PRIMITIVES`), as an open jaxpr whose
    inputs are the equation's inputs and whose outputs are its outputs, one for
    one; `None` for any other equation. What an output of the call holds is what
    the same output of the body holds.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.effects import CALL_PRIMITIVES, call_body

    closed = jax.make_jaxpr(lambda x: jax.checkpoint(jnp.sin)(x) + 1.0)(1.0)
    call, add = closed.jaxpr.eqns
    assert call.primitive.name == "remat2" and call.primitive.name in CALL_PRIMITIVES
    assert [e.primitive.name for e in call_body(call).eqns] == ["sin"]
    assert call_body(add) is None
    ```
    """
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    subs = sub_jaxprs(eqn)
    if (
        len(subs) == 1
        and len(subs[0].invars) == len(eqn.invars)
        and len(subs[0].outvars) == len(eqn.outvars)
    ):
        return subs[0]
    return None


Nested = tuple[tuple[JaxprEqn, tuple[JaxprEqn, ...]], ...]
_EQUATIONS: weakref.WeakKeyDictionary[Jaxpr, dict[Any, Nested]] = weakref.WeakKeyDictionary()


def equations_in(
    program: Jaxpr | ClosedJaxpr, *, enter: Callable[[JaxprEqn], bool] | None = None
) -> Nested:
    """Every equation a program runs, through its sub-programs, with the
    control-flow equations around it: a query to ask once, before running it
    (which effects it binds, how many sites it has), cached per jaxpr.

    Each control-flow equation is replaced by the equations of its sub-programs
    (`sub_jaxprs`), recursively; an equation with none is listed itself.

    **Arguments:**

    - `program`: a `Jaxpr` or `ClosedJaxpr`.
    - `enter`: `enter(eqn) -> bool`, whether to go inside a control-flow
      equation (one it refuses is listed itself); `None` goes inside all. Pass
      the same function object each time (a module-level function): the cache
      is kept per `enter`.

    **Returns:**

    A tuple of `(eqn, around)` in program order, where `around` holds the
    control-flow equations that enclose `eqn`, outermost first.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from jax import lax
    from kups.effects import equations_in


    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: lax.cond(c > 0, jnp.sin, jnp.cos, c), x)


    names = [
        (eqn.primitive.name, [e.primitive.name for e in around])
        for eqn, around in equations_in(jax.make_jaxpr(f)(1.0))
    ]
    assert ("sin", ["scan", "cond"]) in names and ("cos", ["scan", "cond"]) in names
    ```
    """
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    per_enter = _EQUATIONS.setdefault(jaxpr, {})
    found = per_enter.get(enter)
    if found is None:
        items: list[tuple[JaxprEqn, tuple[JaxprEqn, ...]]] = []
        for eqn in jaxpr.eqns:
            subs = sub_jaxprs(eqn) if enter is None or enter(eqn) else ()
            if not subs:
                items.append((eqn, ()))
            for sub in subs:
                items.extend(
                    (inner, (eqn, *around)) for inner, around in equations_in(sub, enter=enter)
                )
        found = per_enter[enter] = tuple(items)
    return found


_FUNCTION_TYPES = (types.FunctionType, types.MethodType, functools.partial)


# The type of a PRNG implementation (`impl`, a param of `random_seed` and
# `random_wrap`): a tuple holding the functions JAX lowers those primitives with.
_PRNG_IMPL_TYPE = type(jax.extend.random.threefry_prng_impl)


def _is_jax_prng_impl(value: Any) -> bool:
    """Whether `value` is one of JAX's own key types (threefry, rbg, ...): its
    functions are JAX's, not the user's, so nothing of the program is hidden in
    them. A key type defined with `jax.extend.random.define_prng_impl` runs the
    user's functions, so it is not."""
    return isinstance(value, _PRNG_IMPL_TYPE) and all(
        getattr(item, "__module__", "").startswith("jax.")
        for item in value
        if isinstance(item, _FUNCTION_TYPES)
    )


def _holds_function(value: Any, depth: int) -> bool:
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return False
    if kind is tuple and depth > 0 and all(type(item) in _PLAIN_TYPES for item in value):
        return False  # shapes, axes, dimensions
    if isinstance(value, _FUNCTION_TYPES):
        return True
    if _is_jax_prng_impl(value):
        return False
    if depth == 0 or isinstance(value, (str, bytes, int, float, bool, np.dtype, *_JAXPR_TYPES)):
        return False
    if isinstance(value, (tuple, list)):
        return any(_holds_function(item, depth - 1) for item in value)
    if isinstance(value, dict):
        return any(_holds_function(item, depth - 1) for item in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(
            _holds_function(getattr(value, field.name, None), depth - 1)
            for field in dataclasses.fields(value)
        )
    return False


def is_library_primitive(eqn: JaxprEqn) -> bool:
    """Whether `eqn` binds a library's own primitive that holds Python functions
    in its params (lineax's `linear_solve` holding its operator, an equinox filter
    primitive), rather than a JAX primitive or a host callback.

    Such a primitive runs code kups cannot see before it runs: an effect bound
    inside it is out of the interpreter's sight. Effects that must enter every
    sub-program (counting, checking) treat it as opaque. False for the library
    primitives the default dispatcher goes inside (lineax's `linear_solve`):
    `sub_jaxprs` gives what they run.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.effects import is_library_primitive

    closed = jax.make_jaxpr(jnp.sin)(1.0)
    assert not any(is_library_primitive(eqn) for eqn in closed.jaxpr.eqns)
    ```
    """
    return holds_functions(eqn, _compat.KNOWN_PARAMS) and not enters(eqn)


def holds_functions(eqn: JaxprEqn, known: frozenset[str] | set[str] | dict[str, Any]) -> bool:
    """Whether `eqn` is a library's primitive (not one of the `known` JAX
    primitives, nor a host callback) that holds Python functions in its params,
    which it may run when bound or compiled (lineax's `linear_solve` holding an
    operator function): code kups cannot see before it runs."""
    name = eqn.primitive.name
    if name in known or name.endswith("callback"):
        return False
    for value in eqn.params.values():
        if value is None or isinstance(value, _SCALAR_TYPES):
            continue
        if _holds_function(value, 6):
            return True
    return False
