"""`count_primitives`: how many times each primitive of a program ran.

The context is a `_Tally`: a `dict` from primitive name to an `int32` count,
and another for the opaque calls. A fallback handler re-binds every equation
that is not control flow and adds one to its name. Loops carry the counts
(names first seen in a body start at zero, through the loop handlers'
`initializer`); every name a `cond` branch can count enters the `cond` first,
so that all branches return the same context; a `shard_map` body starts from no
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
import html
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive, jaxprs_in_params

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    Uninitialized,
    check_policy,
    contains_subjaxprs,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    is_library_primitive,
    reinterpret,
    shard_map_axes,
    source_line,
    wraps_with_leading,
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

    `opaque` holds the calls of control-flow primitives that kups cannot see
    inside (a library's own, such as lineax's `linear_solve`, met by
    `count_primitives(fn, policy=InterpreterPolicy.WARN)` or `IGNORE`): a `dict`
    from primitive name to how many times such a call ran. What runs inside them
    is not in the counts, so a non-empty `opaque` says the counts are incomplete.
    The table lists them under "not counted inside". Equality compares the
    counts only, as for any `dict`: compare `opaque` separately.

    **Arguments:**

    - `counts`: the counts, a mapping or an iterable of `(name, count)` pairs.
    - `opaque`: the opaque calls, a mapping from primitive name to count.

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
    assert counts.opaque == {}  # nothing was hidden from the counts
    ```
    """

    opaque: dict[str, Any]

    def __init__(
        self,
        counts: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        /,
        *,
        opaque: Mapping[str, Any] | None = None,
    ):
        super().__init__(counts)
        self.opaque = dict(opaque or {})

    def total(self) -> Any:
        """The number of primitives that ran, over all names (opaque calls, whose
        insides are not counted, are left out)."""
        return sum(self.values(), start=0)

    def _sections(self) -> list[tuple[str | None, list[tuple[str, str]]]]:
        """The table's sections: the counts, then (if any) the opaque calls under
        their heading."""
        sections: list[tuple[str | None, list[tuple[str, str]]]] = [(None, _rows(self))]
        if self.opaque:
            sections.append(("not counted inside:", _rows(self.opaque)))
        return sections

    def __repr__(self) -> str:
        if not self and not self.opaque:
            return "PrimitiveCounts({})"
        sections = self._sections()
        rows = [row for _, section in sections for row in section]
        name_width = max(len("primitive"), *(len(name) for name, _ in rows))
        count_width = max(len("count"), *(len(count) for _, count in rows))
        lines = [f"{'primitive':<{name_width}}  {'count':>{count_width}}"]
        lines.append(f"{'-' * name_width}  {'-' * count_width}")
        for heading, section in sections:
            if heading is not None:
                lines.append(heading)
            lines += [f"{name:<{name_width}}  {count:>{count_width}}" for name, count in section]
        return "PrimitiveCounts(\n" + "\n".join("  " + line for line in lines) + "\n)"

    def _repr_html_(self) -> str:
        body = ""
        for heading, section in self._sections():
            if heading is not None:
                body += (
                    f"<tr><th colspan='2' style='text-align:left'>{html.escape(heading)}</th></tr>"
                )
            body += "".join(
                f"<tr><td><code>{html.escape(name)}</code></td>"
                f"<td style='text-align:right'>{html.escape(count)}</td></tr>"
                for name, count in section
            )
        return (
            "<table><thead><tr><th style='text-align:left'>primitive</th>"
            f"<th style='text-align:right'>count</th></tr></thead><tbody>{body}</tbody></table>"
        )


def _rows(counts: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`(name, count)` as text, sorted by count (largest first), then by name."""

    def key(item: tuple[str, Any]) -> tuple[int, str]:
        count = _as_int(item[1])
        return (-count if count is not None else 0, item[0])

    return [(name, _format_count(count)) for name, count in sorted(counts.items(), key=key)]


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


def _flatten_counts(
    counts: PrimitiveCounts,
) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    names = tuple(sorted(counts))
    children: list[tuple[Any, Any]] = [
        (jax.tree_util.DictKey(name), counts[name]) for name in names
    ]
    # A dict is a pytree node: no opaque call, no leaf.
    children.append((jax.tree_util.GetAttrKey("opaque"), dict(sorted(counts.opaque.items()))))
    return children, names


def _unflatten_counts(names: tuple[str, ...], values: Iterable[Any]) -> PrimitiveCounts:
    *counts, opaque = values
    return PrimitiveCounts(zip(names, counts, strict=True), opaque=opaque)


jax.tree_util.register_pytree_with_keys(
    PrimitiveCounts,
    _flatten_counts,
    _unflatten_counts,
    lambda counts: (
        tuple(child for _, child in _flatten_counts(counts)[0]),
        tuple(sorted(counts)),
    ),
)


# ---------------------------------------------------------------------------
# Handlers. The context is a `_Tally`: counts by primitive name, and opaque
# calls by primitive name, each an int32 count.
# ---------------------------------------------------------------------------


class _Tally(NamedTuple):
    counts: Counts
    opaque: Counts


def _add(counts: Counts, other: Counts) -> Counts:
    """The sum of two count dicts, by name."""
    out = dict(counts)
    for name, count in other.items():
        out[name] = out[name] + count if name in out else count
    return out


def _add_tallies(tally: _Tally, other: _Tally) -> _Tally:
    return _Tally(_add(tally.counts, other.counts), _add(tally.opaque, other.opaque))


def _count_equation(interpreter: Any, ctx: _Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The fallback handler: re-binds the equation and counts it once."""
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    counts = _add(ctx.counts, {eqn.primitive.name: np.int32(1)})
    return HandlerResult(_Tally(counts, ctx.opaque), result.outvals)


def _where(eqn: JaxprEqn) -> str:
    kind = "control-flow primitive" if contains_subjaxprs(None, eqn, []) else "primitive"
    return f"{kind} {eqn.primitive.name!r} at {source_line(eqn)}"


def _count_opaque(interpreter: Any, ctx: _Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The handler of a control-flow primitive kups cannot see inside: by the
    interpreter's policy, raises, or re-binds it whole and counts the call."""
    name = eqn.primitive.name
    policy = interpreter.policy
    if policy is InterpreterPolicy.RAISE:
        raise NotImplementedError(
            f"count_primitives cannot count inside the {_where(eqn)}: kups has no "
            f"handler for it (it runs a sub-program or Python functions of its own: a "
            f"library's primitive, or a key type of your own), so the primitives it runs "
            f"inside would be missing from the counts. To run it unchanged and count "
            f"everything around it, pass policy=InterpreterPolicy.IGNORE (or "
            f"WARN, to be warned) to count_primitives (from kups.effects import "
            f"InterpreterPolicy); the counts' .opaque then says how many times "
            f"{name!r} ran, its inside not counted."
        )
    if policy is InterpreterPolicy.WARN:
        warnings.warn(
            f"count_primitives cannot count inside the {_where(eqn)} (kups has no "
            f"handler for it): it runs unchanged, and what it runs is missing from the "
            f"counts. The counts' .opaque says how many times {name!r} ran. Pass "
            f"policy=InterpreterPolicy.IGNORE to count_primitives to silence this.",
            stacklevel=2,
        )
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    opaque = _add(ctx.opaque, {name: np.int32(1)})
    return HandlerResult(_Tally(ctx.counts, opaque), result.outvals)


def _zero_new_names(ctx_before: _Tally, sentinel: _Tally) -> _Tally:
    """The loop initializer: names the body adds start at zero."""
    del ctx_before
    return jax.tree.map(
        lambda count: jnp.zeros((), jnp.int32) if isinstance(count, Uninitialized) else count,
        sentinel,
        is_leaf=lambda leaf: isinstance(leaf, Uninitialized),
    )


def _subjaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    for sub in jaxprs_in_params(eqn.params):
        yield sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


@functools.cache
def _interpreted() -> frozenset[str]:
    """The control-flow primitives count_primitives has a handler for: JAX's own."""
    return frozenset(_dispatcher().handlers)


class _Names(NamedTuple):
    """What a program can count: the names of the primitives the fallback handler
    counts, and the opaque control-flow primitives, by name."""

    counted: frozenset[str]
    opaque: Mapping[str, Primitive]


_NAMES_IN: weakref.WeakKeyDictionary[Jaxpr, _Names] = weakref.WeakKeyDictionary()


def _names_in(program: Jaxpr | ClosedJaxpr) -> _Names:
    """The names `program` and its sub-programs can count (an opaque primitive's
    sub-program is not walked: it runs unchanged)."""
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    names = _NAMES_IN.get(jaxpr)
    if names is None:
        counted: set[str] = set()
        opaque: dict[str, Primitive] = {}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if is_library_primitive(eqn):
                # A library primitive running Python functions kups cannot see.
                opaque[name] = eqn.primitive
            elif not contains_subjaxprs(None, eqn, []):
                counted.add(name)
            elif name in _interpreted():
                for sub in _subjaxprs(eqn):
                    inner = _names_in(sub)
                    counted |= inner.counted
                    opaque.update(inner.opaque)
            else:
                opaque[name] = eqn.primitive
        names = _NAMES_IN[jaxpr] = _Names(frozenset(counted), opaque)
    return names


def _count_cond(interpreter: Any, ctx: _Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Every name any branch can count enters the cond, at zero if new, so that
    all branches return the same context."""
    counts, opaque = dict(ctx.counts), dict(ctx.opaque)
    for branch in eqn.params["branches"]:
        names = _names_in(branch)
        for name in names.counted - counts.keys():
            counts[name] = jnp.zeros((), jnp.int32)
        for name in names.opaque.keys() - opaque.keys():
            opaque[name] = jnp.zeros((), jnp.int32)
    return default_cond_handler(interpreter, _Tally(counts, opaque), eqn, invals)


@functools.lru_cache(maxsize=64)
def _psum_over(manual_axes: tuple[Any, ...]) -> Callable[[_Tally], _Tally]:
    """`reduce_ctx` summing each count over the shards of `manual_axes` (cached so
    that the framework's body cache recognises it)."""

    def reduce_ctx(tally: _Tally) -> _Tally:
        return jax.tree.map(lambda count: _psum(count, manual_axes), tally)

    return reduce_ctx


def _psum(count: Any, manual_axes: tuple[Any, ...]) -> Any:
    # One axis at a time: `psum` rejects an axis tuple over which the value is
    # varying along some axes and invariant along others (JAX 0.10), and over an
    # invariant axis it multiplies by the axis size, which is the sum over shards.
    for axis in manual_axes:
        count = jax.lax.psum(count, axis)
    return count


def _count_shard_map(interpreter: Any, ctx: _Tally, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """The body starts from zero counts; the counts of all shards are summed and
    added to the outer ones."""
    _, manual_axes = shard_map_axes(eqn)
    inner, outvals = default_shard_map_handler(
        interpreter, _Tally({}, {}), eqn, invals, reduce_ctx=_psum_over(manual_axes)
    )
    return HandlerResult(_add_tallies(ctx, inner), outvals)


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


class _CountingInterpreter(Interpreter):
    """The interpreter of `count_primitives`.

    A fallback handler takes no control flow, and the interpreter sends a
    control-flow equation without a handler to its policy, which cannot count it.
    So before running a program, this interpreter registers `_count_opaque` for
    every opaque primitive in it (the top-level program holds every sub-program
    that runs, so later calls find nothing new).
    """

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Any, ctx: Any, args: Any
    ) -> tuple[list[Any], Any]:
        for primitive in _names_in(jaxpr).opaque.values():
            if not self.dispatcher.is_registered(primitive):
                self.dispatcher.register_handler(primitive, _count_opaque)
        return super().interpret_jaxpr(jaxpr, consts, ctx, args)


def count_primitives(
    fn: Callable[..., Any], *, policy: InterpreterPolicy = InterpreterPolicy.RAISE
) -> Callable[..., tuple[Any, PrimitiveCounts]]:
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

    A control-flow primitive that kups has no handler for (a library's own, such
    as lineax's `linear_solve` or an equinox filter primitive) is opaque: kups
    cannot see what it runs; so is a library primitive that holds Python
    functions rather than jaxprs. `policy` says what happens then.

    **Arguments:**

    - `fn`: the function to count. Its arguments are pytrees; leaves that are not
      arrays are static.
    - `policy`: for opaque control flow. `InterpreterPolicy.RAISE` (the default)
      raises `NotImplementedError` naming the primitive and its source line;
      `WARN` warns, runs it unchanged and reports it; `IGNORE` runs it unchanged
      and reports it. A reported call is listed in `counts.opaque` (with how many
      times it ran, by the rules above), and what it runs is not in the counts.

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
    check_policy(policy, "count_primitives(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PrimitiveCounts]:
        interpreter = _CountingInterpreter(_dispatcher(), policy=policy, label="count_primitives")
        interpreter.policy_hint = "count_primitives(fn, policy=...)"
        out, tally = reinterpret(fn, interpreter)(_Tally({}, {}), *args, **kwargs)
        if _is_traced((args, kwargs, tally)):
            tally = jax.tree.map(lambda count: jnp.asarray(count, jnp.int32), tally)
        else:
            tally = jax.tree.map(int, tally)
        return out, PrimitiveCounts(
            sorted(tally.counts.items()), opaque=dict(sorted(tally.opaque.items()))
        )

    return wrapped
