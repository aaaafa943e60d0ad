"""The machinery `count_primitives` and `count_flops` share: how many times each
kind of equation ran, through every control flow.

The context is a `Tally`: a `dict` from a key to an `int32` count, and another
from primitive name to the count of opaque calls. An effect says what the key of
an equation is (`key_of(eqn)`: its primitive's name for `count_primitives`; its
name and static cost for `count_flops`). A fallback handler re-binds every
equation that is not control flow and adds one to its key. Loops carry the
counts (keys first seen in a body start at zero, through the loop handlers'
`initializer`); every key a `cond` branch can count enters the `cond` first, so
that all branches return the same context; a `shard_map` body starts from no
counts, which are summed over the shards and added to the outer ones.

A control-flow primitive that kups has no handler for (a library's own, such as
lineax's `linear_solve`) is opaque: its sub-program cannot be walked. A fallback
handler never sees control flow, so before each program runs, the interpreter
registers a handler of its own for every such primitive in it (recursively): by
the interpreter's policy, it raises, or re-binds the equation whole and adds one
to the opaque count of its name. The opaque counts follow the counting rules of
every other count (a scan body's `length` times, ...).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    Uninitialized,
    contains_subjaxprs,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    equations_in,
    is_library_primitive,
    reduce_shards,
    reinterpret,
    shard_map_axes,
)

from ._table import is_traced

KeyOf = Callable[[JaxprEqn], Hashable]
Counts = dict[Any, Any]


class Tally(NamedTuple):
    """The context: executions by key, and opaque calls by primitive name."""

    counts: Counts
    opaque: Counts


def _add(counts: Counts, other: Counts) -> Counts:
    """The sum of two count dicts, by key."""
    out = dict(counts)
    for key, count in other.items():
        out[key] = out[key] + count if key in out else count
    return out


def _add_tallies(tally: Tally, other: Tally) -> Tally:
    return Tally(_add(tally.counts, other.counts), _add(tally.opaque, other.opaque))


def _count_equation(interpreter: Any, ctx: Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The fallback handler: re-binds the equation and counts it once."""
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    counts = _add(ctx.counts, {interpreter.key_of(eqn): np.int32(1)})
    return HandlerResult(Tally(counts, ctx.opaque), result.outvals)


def _count_opaque(interpreter: Any, ctx: Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The handler of a control-flow primitive kups cannot see inside: by the
    interpreter's policy, raises, or re-binds it whole and counts the call."""
    interpreter.cannot_enter(
        eqn,
        "count",
        f"it runs a sub-program or Python functions of its own (a library's primitive, "
        f"or a key type of your own), so what it runs would be missing from the counts; "
        f"run unchanged, the report's .opaque says how many times "
        f"{eqn.primitive.name!r} ran, its inside not counted",
    )
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    opaque = _add(ctx.opaque, {eqn.primitive.name: np.int32(1)})
    return HandlerResult(Tally(ctx.counts, opaque), result.outvals)


def _zero_new_keys(ctx_before: Tally, sentinel: Tally) -> Tally:
    """The loop initializer: keys the body adds start at zero."""
    del ctx_before
    return jax.tree.map(
        lambda count: jnp.zeros((), jnp.int32) if isinstance(count, Uninitialized) else count,
        sentinel,
        is_leaf=lambda leaf: isinstance(leaf, Uninitialized),
    )


@functools.cache
def _interpreted() -> frozenset[str]:
    """The control-flow primitives the counting interpreter has a handler for:
    JAX's own."""
    return frozenset(_dispatcher().handlers)


class _Keys(NamedTuple):
    """What a program can count: the keys of the equations the fallback handler
    counts, and the opaque control-flow primitives, by name."""

    counted: frozenset[Hashable]
    opaque: Mapping[str, Primitive]


_KEYS_IN: weakref.WeakKeyDictionary[Jaxpr, dict[KeyOf, _Keys]] = weakref.WeakKeyDictionary()


def _keys_in(program: Jaxpr | ClosedJaxpr, key_of: KeyOf) -> _Keys:
    """The keys `program` and its sub-programs can count (an opaque primitive's
    sub-program is not walked: it runs unchanged). Cached per program."""
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    by_key_of = _KEYS_IN.setdefault(jaxpr, {})
    keys = by_key_of.get(key_of)
    if keys is None:
        counted: set[Hashable] = set()
        opaque: dict[str, Primitive] = {}
        for eqn, _ in equations_in(jaxpr, enter=_entered):
            if is_library_primitive(eqn) or contains_subjaxprs(None, eqn, []):
                # A library primitive running Python functions kups cannot see,
                # or control flow no default handler takes: it runs unchanged.
                opaque[eqn.primitive.name] = eqn.primitive
            else:
                counted.add(key_of(eqn))
        keys = by_key_of[key_of] = _Keys(frozenset(counted), opaque)
    return keys


def _entered(eqn: JaxprEqn) -> bool:
    """JAX's control flow, and the library primitives kups goes inside (lineax's
    `linear_solve`, even one with no jaxpr in its params): what they run is
    counted, not the equation itself."""
    return not is_library_primitive(eqn) and eqn.primitive.name in _interpreted()


def _count_cond(interpreter: Any, ctx: Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Every key any branch can count enters the cond, at zero if new, so that
    all branches return the same context."""
    counts, opaque = dict(ctx.counts), dict(ctx.opaque)
    for branch in eqn.params["branches"]:
        keys = _keys_in(branch, interpreter.key_of)
        for key in keys.counted - counts.keys():
            counts[key] = jnp.zeros((), jnp.int32)
        for name in keys.opaque.keys() - opaque.keys():
            opaque[name] = jnp.zeros((), jnp.int32)
    return default_cond_handler(interpreter, Tally(counts, opaque), eqn, invals)


@functools.lru_cache(maxsize=64)
def _psum_over(manual_axes: tuple[Any, ...]) -> Callable[[Tally], Tally]:
    """`reduce_ctx` summing each count over the shards of `manual_axes` (cached so
    that the framework's body cache recognises it)."""

    def reduce_ctx(tally: Tally) -> Tally:
        return jax.tree.map(lambda count: reduce_shards(count, manual_axes), tally)

    return reduce_ctx


def _count_shard_map(interpreter: Any, ctx: Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The body starts from zero counts; the counts of all shards are summed and
    added to the outer ones."""
    _, manual_axes = shard_map_axes(eqn)
    inner, outvals = default_shard_map_handler(
        interpreter, Tally({}, {}), eqn, invals, reduce_ctx=_psum_over(manual_axes)
    )
    return HandlerResult(_add_tallies(ctx, inner), outvals)


def _dispatcher() -> Dispatcher:
    return (
        default_dispatcher()
        .register_handler(
            "scan", functools.partial(default_scan_handler, initializer=_zero_new_keys)
        )
        .register_handler(
            "while",
            functools.partial(
                default_while_handler, initializer=_zero_new_keys, thread_condition=True
            ),
        )
        .register_handler("cond", _count_cond)
        .register_handler("shard_map", _count_shard_map)
        .register_fallback_handler(_count_equation)
    )


class CountingInterpreter(Interpreter):
    """The interpreter that counts executions by `key_of(eqn)`.

    A fallback handler takes no control flow, and the interpreter sends a
    control-flow equation without a handler to its policy, which cannot count it.
    So before running a program, this interpreter registers `_count_opaque` for
    every opaque primitive in it (the top-level program holds every sub-program
    that runs, so later calls find nothing new).
    """

    def __init__(self, key_of: KeyOf, *, policy: InterpreterPolicy, label: str):
        super().__init__(_dispatcher(), policy, label, policy_hint=f"{label}(fn, policy=...)")
        self.key_of = key_of

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Any, ctx: Any, args: Any
    ) -> tuple[list[Any], Any]:
        for primitive in _keys_in(jaxpr, self.key_of).opaque.values():
            if not self.dispatcher.is_registered(primitive):
                self.dispatcher.register_handler(primitive, _count_opaque)
        return super().interpret_jaxpr(jaxpr, consts, ctx, args)


def count_executions(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    key_of: KeyOf,
    policy: InterpreterPolicy,
    label: str,
) -> tuple[Any, Tally]:
    """Runs `fn(*args, **kwargs)` and counts its executions by `key_of(eqn)`.

    **Returns:**

    `(out, tally)`: the counts are Python `int`s when nothing was traced, `int32`
    arrays otherwise (under `jax.jit`, `jax.vmap`, ...).
    """
    interpreter = CountingInterpreter(key_of, policy=policy, label=label)
    out, tally = reinterpret(fn, interpreter)(Tally({}, {}), *args, **kwargs)
    if is_traced((args, kwargs, tally)):
        tally = jax.tree.map(lambda count: jnp.asarray(count, jnp.int32), tally)
    else:
        tally = jax.tree.map(int, tally)
    return out, tally
