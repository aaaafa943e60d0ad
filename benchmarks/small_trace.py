"""The fixed overhead of tracing an effect on a small program.

Users call effects on small functions in notebooks all the time, so what an
effect adds to tracing a small program matters as much as how it grows. Each
program is traced end to end: `jax.make_jaxpr(reap(f, tag=...))` against
`jax.make_jaxpr(f)` in the same repeat, with fresh closures at every trace (as
in benchmarks 2 and 6; JAX's caches never hit for them):

- a `scan`, a `while_loop`, a `cond` or a `jax.jit` around one sow
  (`mode="clobber"`; the while's has an `init`, for a loop that runs zero times,
  and the cond sows in both branches);
- 20 straight-line `lax` ops, then one sow.

`reap` traces `f`, then walks its jaxpr once, tracing again the bodies that
hold a sow. Its result is checked once per program: the reaped value equals the
sown one computed by plain JAX.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kups.harvest import reap, sow

from ._report import Section, Table, Target, main
from ._timing import paired, trace_clock

BOUND = 1.8  # make_jaxpr(reap(f)) / make_jaxpr(f)
TAG = "small"
KINDS = ("scan", "while", "cond", "jit", "20 lax ops")


def _build(kind: str) -> Callable[[Any], Any]:
    """A fresh `f` of the given kind, sowing under `TAG`."""

    def step(c: Any) -> Any:
        return sow(jnp.sin(c), tag=TAG, name="v", mode="clobber", init=0.0)

    def f(x: Any) -> Any:
        if kind == "scan":
            return lax.scan(lambda c, _: (step(c), None), x, None, length=3)[0]
        if kind == "while":
            return lax.while_loop(lambda c: c[1] < 3, lambda c: (step(c[0]), c[1] + 1), (x, 0))[0]
        if kind == "cond":
            return lax.cond(x.sum() > 0, step, lambda c: step(c * 2.0), x)
        if kind == "jit":
            return jax.jit(step)(x)
        y = x
        for i in range(20):
            y = lax.sin(y) if i % 2 else lax.mul(y, y)
        return step(y)

    return f


def _check(kind: str, x: Any) -> None:
    out, reaped = reap(_build(kind), tag=TAG)(x)
    plain = _build(kind)(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    if "v" not in reaped:
        raise AssertionError(f"{kind}: reap returned {sorted(reaped)}, expected ['v']")


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    repeats = 5 if quick else 41
    x = jnp.ones(4)
    rows, ms_rows, targets = [], [], []
    for kind in KINDS:
        _check(kind, x)
        timings = paired(
            {
                "trace f": lambda kind=kind: jax.make_jaxpr(_build(kind))(x),
                "reap": lambda kind=kind: jax.make_jaxpr(reap(_build(kind), tag=TAG))(x),
            },
            repeats,
            warmup=3,
            clock=trace_clock,
        )
        value = timings.ratio("reap", "trace f")
        rows.append([kind, value, repeats])
        ms_rows.append([kind, 1e3 * timings.median("trace f"), 1e3 * timings.median("reap")])
        targets.append(
            Target(f"{kind} around one sow: reap / trace f", value, f"<= {BOUND}", value <= BOUND)
        )
    tables = [
        Table(
            "make_jaxpr(reap(f)) / make_jaxpr(f) (median of per-repeat ratios, thread CPU time)",
            ["program", "reap / trace f", "repeats"],
            rows,
        ),
        Table("Trace time (median ms of thread CPU time)", ["program", "trace f", "reap"], ms_rows),
    ]
    return Section(
        name="small_trace",
        title="Fixed overhead of an effect on small programs",
        method=__doc__ or "",
        tables=tables,
        targets=targets,
        notes=[],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
