"""The fixed overhead of tracing an effect on a small program.

Users call effects on small functions in notebooks all the time, so what an
effect adds to tracing a small program matters as much as how it grows. Each
program is traced end to end: `jax.make_jaxpr(reap(f, tag=...))` against
`jax.make_jaxpr(f)` in the same repeat, with fresh closures at every trace (as
in benchmarks 2 and 6; JAX's caches never hit for them):

- a `scan`, a `while_loop`, a `cond` or a `jax.jit` around one sow
  (`mode="clobber"`; the while's has an `init`, for a loop that runs zero times,
  and the cond sows in both branches);
- the same nested 2, 3 and 4 deep (a scan in a scan in a scan around the sow;
  each cond level doubles the program, as in plain JAX);
- 20 straight-line `lax` ops, then one sow.

`reap` traces `f`, then walks its jaxpr once, tracing again the bodies that
hold a sow. Its result is checked once per program: the reaped value equals the
sown one computed by plain JAX.

Beside it, the floor of that design (`walk floor`): trace `f`, then walk its
jaxpr with no context and no handler, tracing every sub-program again with
JAX's `eval_jaxpr` of its equations and re-binding each equation as it is, the
control flow with its new sub-programs (a while loop's condition too, which
`reap` does not trace again when no sow is in it). It is the least an interpreter that
goes inside bodies pays (tracing with the same entry point kups uses, without
`jax.make_jaxpr`'s jit machinery); `reap / walk floor` is what kups adds to it:
threading the context, the sows' values as new outputs of each level, and the
handlers' checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.core as jax_core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal

from kups.effects import _compat
from kups.harvest import reap, sow

from ._report import Section, Table, Target, main
from ._timing import paired, trace_clock

BOUND = 1.8  # make_jaxpr(reap(f)) / make_jaxpr(f)
TAG = "small"
KINDS = ("scan", "while", "cond", "jit", "20 lax ops")
NESTED = ("scan", "while", "cond", "jit")
DEPTHS = (2, 3, 4)


def _build(kind: str, depth: int = 1) -> Callable[[Any], Any]:
    """A fresh `f` of the given kind, `depth` levels of it around one sow under
    `TAG`."""

    def step(c: Any) -> Any:
        return sow(jnp.sin(c), tag=TAG, name="v", mode="clobber", init=0.0)

    def level(c: Any, d: int) -> Any:
        if d == 0:
            return step(c)

        def inner(c: Any) -> Any:
            return level(c, d - 1)

        if kind == "scan":
            return lax.scan(lambda c, _: (inner(c), None), c, None, length=3)[0]
        if kind == "while":
            return lax.while_loop(lambda s: s[1] < 3, lambda s: (inner(s[0]), s[1] + 1), (c, 0))[0]
        if kind == "cond":
            return lax.cond(c.sum() > 0, inner, lambda c: inner(c * 2.0), c)
        return jax.jit(inner)(c)

    def f(x: Any) -> Any:
        if kind in NESTED:
            return level(x, depth)
        y = x
        for i in range(20):
            y = lax.sin(y) if i % 2 else lax.mul(y, y)
        return step(y)

    return f


def _retraced(closed: Any) -> Any:
    """`closed` traced again by `_walked`, as a closed jaxpr."""
    jaxpr, _, consts = _compat.trace_to_jaxpr(
        lambda *args: _walked(closed.jaxpr, closed.consts, args),
        [v.aval for v in closed.jaxpr.invars],
        "walk floor",
    )
    if consts:
        raise AssertionError("the walk floor's programs close over no arrays")
    return _compat.new_closed_jaxpr(jaxpr, ())


def _walked(jaxpr: Any, consts: Any, args: Any) -> list[Any]:
    """JAX's `eval_jaxpr`, but each control-flow equation's sub-programs traced
    again (`_retraced`) before it is re-bound."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        params = dict(eqn.params)
        for key, value in params.items():
            if isinstance(value, ClosedJaxpr):
                params[key] = _retraced(value)
            elif isinstance(value, tuple) and value and isinstance(value[0], ClosedJaxpr):
                params[key] = tuple(map(_retraced, value))
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]


def _walk_floor(f: Callable[[Any], Any], x: Any) -> tuple[Any, Any]:
    closed = jax.make_jaxpr(f)(x)
    jaxpr, _, consts = _compat.trace_to_jaxpr(
        lambda *args: _walked(closed.jaxpr, closed.consts, args),
        [jax.typeof(x)],
        "walk floor",
    )
    return jaxpr, consts


def _check(kind: str, depth: int, x: Any) -> None:
    out, reaped = reap(_build(kind, depth), tag=TAG)(x)
    plain = _build(kind, depth)(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    floor_jaxpr, floor_consts = _walk_floor(_build(kind, depth), x)
    (walked,) = jax_core.eval_jaxpr(floor_jaxpr, floor_consts, x)
    np.testing.assert_array_equal(np.asarray(walked), np.asarray(plain))
    if "v" not in reaped:
        raise AssertionError(f"{kind}: reap returned {sorted(reaped)}, expected ['v']")


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    repeats = 5 if quick else 41
    x = jnp.ones(4)
    rows, ms_rows, floor_rows, targets = [], [], [], []
    depth_rows: dict[str, list[Any]] = {kind: [kind] for kind in NESTED}
    programs = [(kind, 1) for kind in KINDS] + [(k, d) for k in NESTED for d in DEPTHS]
    for kind, depth in programs:
        _check(kind, depth, x)
        timings = paired(
            {
                "trace f": lambda k=kind, d=depth: jax.make_jaxpr(_build(k, d))(x),
                "reap": lambda k=kind, d=depth: jax.make_jaxpr(reap(_build(k, d), tag=TAG))(x),
                "walk floor": lambda k=kind, d=depth: _walk_floor(_build(k, d), x),
            },
            repeats,
            warmup=3,
            clock=trace_clock,
        )
        value = timings.ratio("reap", "trace f")
        floor = timings.ratio("walk floor", "trace f")
        over_floor = timings.ratio("reap", "walk floor")
        what = f"{kind} around one sow" if depth == 1 else f"{kind} {depth} deep around one sow"
        if kind in NESTED:
            depth_rows[kind].append(value)
        if depth == 1:
            rows.append([kind, value, repeats])
        floor_rows.append([what, floor, value, over_floor])
        ms_rows.append(
            [
                what,
                1e3 * timings.median("trace f"),
                1e3 * timings.median("walk floor"),
                1e3 * timings.median("reap"),
            ]
        )
        targets.append(Target(f"{what}: reap / trace f", value, f"<= {BOUND}", value <= BOUND))
    tables = [
        Table(
            "make_jaxpr(reap(f)) / make_jaxpr(f) (median of per-repeat ratios, thread CPU time)",
            ["program", "reap / trace f", "repeats"],
            rows,
        ),
        Table(
            "make_jaxpr(reap(f)) / make_jaxpr(f) by nesting depth",
            ["program", *(f"depth {d}" for d in (1, *DEPTHS))],
            list(depth_rows.values()),
        ),
        Table(
            "The floor of walking every body: what kups adds to it (medians of per-repeat ratios)",
            ["program", "walk floor / trace f", "reap / trace f", "reap / walk floor"],
            floor_rows,
        ),
        Table(
            "Trace time (median ms of thread CPU time)",
            ["program", "trace f", "walk floor", "reap"],
            ms_rows,
        ),
    ]
    return Section(
        name="small_trace",
        title="Small programs: the fixed overhead of an effect, by nesting depth",
        method=__doc__ or "",
        tables=tables,
        targets=targets,
        notes=[],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
