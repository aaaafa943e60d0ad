"""`count_primitives`: how many times each primitive of a program ran.

The context is a `dict` from primitive name to an `int32` count. A fallback
handler re-binds every equation that is not control flow and adds one to its
name. Loops carry the counts (names first seen in a body start at zero, through
the loop handlers' `initializer`); every name a `cond` branch can count enters
the `cond` first, so that all branches return the same context; a `shard_map`
body starts from no counts, which are summed over the shards and added to the
outer ones.
"""

from __future__ import annotations

import functools
import html
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    Uninitialized,
    contains_subjaxprs,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reinterpret,
    shard_map_axes,
)

__all__ = ["PrimitiveCounts", "count_primitives"]

Counts = dict[str, Any]


class PrimitiveCounts(dict[str, Any]):
    """How many times each primitive ran: a `dict` from primitive name to count.

    It is a plain `dict` (equal to a `dict` of the same items) that prints as a
    table, sorted by count, in a terminal (`repr`) and in a notebook
    (`_repr_html_`). It is also a pytree, so it can be returned from `jax.jit`.

    The counts are Python `int`s when `count_primitives` ran eagerly, and `int32`
    arrays when it ran under a transformation such as `jax.jit`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.instrument import count_primitives


    def f(x):
        return jnp.sin(x) * jnp.sin(x) + 1.0


    _, counts = jax.jit(count_primitives(f))(jnp.ones(3))
    print(counts)
    # PrimitiveCounts(
    #   primitive  count
    #   ---------  -----
    #   sin            2
    #   add            1
    #   mul            1
    # )
    assert counts == {"add": 1, "mul": 1, "sin": 2}
    ```
    """

    def _rows(self) -> list[tuple[str, str]]:
        def key(item: tuple[str, Any]) -> tuple[int, str]:
            count = _as_int(item[1])
            return (-count if count is not None else 0, item[0])

        return [(name, _format_count(count)) for name, count in sorted(self.items(), key=key)]

    def total(self) -> Any:
        """The number of primitives that ran, over all names."""
        return sum(self.values(), start=0)

    def __repr__(self) -> str:
        if not self:
            return "PrimitiveCounts({})"
        rows = self._rows()
        name_width = max(len("primitive"), *(len(name) for name, _ in rows))
        count_width = max(len("count"), *(len(count) for _, count in rows))
        lines = [f"{'primitive':<{name_width}}  {'count':>{count_width}}"]
        lines.append(f"{'-' * name_width}  {'-' * count_width}")
        lines += [f"{name:<{name_width}}  {count:>{count_width}}" for name, count in rows]
        return "PrimitiveCounts(\n" + "\n".join("  " + line for line in lines) + "\n)"

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td><code>{html.escape(name)}</code></td>"
            f"<td style='text-align:right'>{html.escape(count)}</td></tr>"
            for name, count in self._rows()
        )
        return (
            "<table><thead><tr><th style='text-align:left'>primitive</th>"
            f"<th style='text-align:right'>count</th></tr></thead><tbody>{body}</tbody></table>"
        )


def _is_traced(tree: Any) -> bool:
    return any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(tree))


def _as_int(count: Any) -> int | None:
    if isinstance(count, Tracer) or np.ndim(count) != 0:
        return None
    return int(count)


def _format_count(count: Any) -> str:
    value = _as_int(count)
    if value is not None:
        return str(value)
    if isinstance(count, Tracer):
        return f"traced {jax.typeof(count).str_short()}"
    # One count per element, as `jax.vmap` of a counted function returns them.
    return np.array2string(np.asarray(count))


def _flatten_counts(counts: PrimitiveCounts) -> tuple[Iterable[tuple[Any, Any]], tuple[str, ...]]:
    names = tuple(sorted(counts))
    return [(jax.tree_util.DictKey(name), counts[name]) for name in names], names


def _unflatten_counts(names: tuple[str, ...], values: Iterable[Any]) -> PrimitiveCounts:
    return PrimitiveCounts(zip(names, values, strict=True))


jax.tree_util.register_pytree_with_keys(
    PrimitiveCounts,
    _flatten_counts,
    _unflatten_counts,
    lambda counts: (tuple(counts[name] for name in sorted(counts)), tuple(sorted(counts))),
)


# ---------------------------------------------------------------------------
# Handlers. The context is a dict from primitive name to an int32 count.
# ---------------------------------------------------------------------------


def _add(counts: Counts, other: Counts) -> Counts:
    """The sum of two count dicts, by name."""
    out = dict(counts)
    for name, count in other.items():
        out[name] = out[name] + count if name in out else count
    return out


def _count_equation(interpreter: Any, ctx: Counts, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The fallback handler: re-binds the equation and counts it once."""
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    name = eqn.primitive.name
    return HandlerResult(_add(ctx, {name: np.int32(1)}), result.outvals)


def _zero_new_names(ctx_before: Counts, sentinel: Counts) -> Counts:
    """The loop initializer: names the body adds start at zero."""
    del ctx_before
    return {
        name: jnp.zeros((), jnp.int32) if isinstance(count, Uninitialized) else count
        for name, count in sentinel.items()
    }


def _subjaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    for sub in jaxprs_in_params(eqn.params):
        yield sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


_NAMES_IN: weakref.WeakKeyDictionary[Jaxpr, frozenset[str]] = weakref.WeakKeyDictionary()


def _names_in(jaxpr: Jaxpr) -> frozenset[str]:
    """The names the fallback handler counts in `jaxpr` and its sub-programs."""
    names = _NAMES_IN.get(jaxpr)
    if names is None:
        found: set[str] = set()
        for eqn in jaxpr.eqns:
            if contains_subjaxprs(None, eqn, []):
                for sub in _subjaxprs(eqn):
                    found |= _names_in(sub)
            else:
                found.add(eqn.primitive.name)
        names = _NAMES_IN[jaxpr] = frozenset(found)
    return names


def _count_cond(interpreter: Any, ctx: Counts, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Every name any branch can count enters the cond, at zero if new, so that
    all branches return the same context."""
    names = frozenset().union(*(_names_in(branch.jaxpr) for branch in eqn.params["branches"]))
    zeros = {name: jnp.zeros((), jnp.int32) for name in names if name not in ctx}
    return default_cond_handler(interpreter, {**ctx, **zeros}, eqn, invals)


@functools.lru_cache(maxsize=64)
def _psum_over(manual_axes: tuple[Any, ...]) -> Callable[[Counts], Counts]:
    """`reduce_ctx` summing each count over the shards of `manual_axes` (cached so
    that the framework's body cache recognises it)."""

    def reduce_ctx(counts: Counts) -> Counts:
        return {name: _psum(count, manual_axes) for name, count in counts.items()}

    return reduce_ctx


def _psum(count: Any, manual_axes: tuple[Any, ...]) -> Any:
    # One axis at a time: `psum` rejects an axis tuple over which the value is
    # varying along some axes and invariant along others (JAX 0.10), and over an
    # invariant axis it multiplies by the axis size, which is the sum over shards.
    for axis in manual_axes:
        count = jax.lax.psum(count, axis)
    return count


def _count_shard_map(interpreter: Any, ctx: Counts, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The body starts from zero counts; the counts of all shards are summed and
    added to the outer ones."""
    _, manual_axes = shard_map_axes(eqn)
    inner, outvals = default_shard_map_handler(
        interpreter, {}, eqn, invals, reduce_ctx=_psum_over(manual_axes)
    )
    return HandlerResult(_add(ctx, inner), outvals)


def _dispatcher() -> Dispatcher:
    return (
        default_dispatcher()
        .register_handler(
            "scan", functools.partial(default_scan_handler, initializer=_zero_new_names)
        )
        .register_handler(
            "while",
            functools.partial(
                default_while_handler, initializer=_zero_new_names, thread_condition=True
            ),
        )
        .register_handler("cond", _count_cond)
        .register_handler("shard_map", _count_shard_map)
        .register_fallback_handler(_count_equation)
    )


def count_primitives(fn: Callable[..., Any]) -> Callable[..., tuple[Any, PrimitiveCounts]]:
    """Wraps `fn` so that it also returns how many times each primitive ran.

    Only what runs is counted, as often as it runs: a `scan` body counts `length`
    times, a `while_loop` body its trip count and its condition one time more,
    a `cond`/`switch` only its taken branch, a `shard_map` body once per shard of
    its manual mesh axes (summed over the shards). Control-flow primitives (`jit`,
    `scan`, `while`, `cond`, `shard_map`, `checkpoint`, `custom_jvp_call`, ...)
    are not counted themselves, only what they run.

    A primitive that could have run but did not (in a branch not taken, a loop
    that ran zero times) is listed with count 0. Counts are `int32`: a primitive
    that runs more than `2**31 - 1` times overflows.

    **Arguments:**

    - `fn`: the function to count. Its arguments are pytrees; leaves that are not
      arrays are static.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, counts)`, where `out` is `fn(*args,
    **kwargs)` and `counts` a `PrimitiveCounts`, a `dict` from primitive name to
    count, in name order. Called eagerly the counts are Python `int`s; under
    `jax.jit` (or another transformation) of `wrapped` they are `int32` arrays.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.instrument import count_primitives


    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.sin(x), x)


    out, counts = count_primitives(f)(jnp.array(1.0))
    assert counts == {"add": 3, "sin": 3}  # the loop index is incremented each time
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"count_primitives(fn) needs a callable fn, got {type(fn).__name__}. Pass the "
            f"function itself, not its result: count_primitives(f)(x)."
        )

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PrimitiveCounts]:
        interpreter = Interpreter(_dispatcher(), label="count_primitives")
        out, counts = reinterpret(fn, interpreter)({}, *args, **kwargs)
        if _is_traced((args, kwargs, counts)):
            counts = {name: jnp.asarray(count, jnp.int32) for name, count in counts.items()}
        else:
            counts = {name: int(count) for name, count in counts.items()}
        return out, PrimitiveCounts(sorted(counts.items()))

    return wrapped
