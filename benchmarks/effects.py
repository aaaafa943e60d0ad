"""Benchmark 4: compiled runtime of `count_primitives` and `reap` against the same
values threaded by hand.

The program: a 4-layer stack of `tanh(h @ w)` in a `lax.scan` over the stacked
weights, then a `while_loop` with a dynamic trip count applying
`sin(h) * 0.5`, then a sum (batch 256, width 512, 8 trips).

- `count_primitives`: `jax.jit(count_primitives(program))` against a
  hand-written program that carries one iteration counter through the `scan` and
  one through the `while_loop` and builds the same counts from them and the
  primitives of each region (read off the program's jaxpr). The benchmark checks
  both give the same counts.
- `reap`: the program sows every layer's activations (`mode="append"` in the
  scan) and the last `while` iterate (`mode="clobber"`, also sown before the
  loop); `jax.jit(reap(program, tag=...))` against a hand-written program that
  returns the activations as the scan's stacked outputs and carries the last
  iterate. The benchmark checks both give the same values.

Runtime is measured as in benchmark 3 (process CPU time, interleaved repeats,
median of per-repeat ratios).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._report import Section, Table, Target, main
from ._timing import paired, runtime_clock

BOUND = 1.10
DEPTH, BATCH, WIDTH, TRIPS = 4, 256, 512, 8
TAG = "activations"


def program(ws: Any, x: Any, trips: Any, *, sow: Callable[..., Any] | None = None) -> Any:
    """The benchmark program; with `sow` (kups.harvest.sow) it sows its activations."""

    def layer(h: Any, w: Any) -> tuple[Any, None]:
        h = jnp.tanh(h @ w)
        if sow is not None:
            h = sow(h, tag=TAG, name="layers", mode="append")
        return h, None

    h, _ = lax.scan(layer, x, ws)
    if sow is not None:
        h = sow(h, tag=TAG, name="last", mode="clobber")

    def body(state: Any) -> Any:
        i, h = state
        h = jnp.sin(h) * 0.5
        if sow is not None:
            h = sow(h, tag=TAG, name="last", mode="clobber")
        return i + 1, h

    _, h = lax.while_loop(lambda state: state[0] < trips, body, (0, h))
    return jnp.sum(h)


def _histogram(jaxpr: Any) -> collections.Counter[str]:
    return collections.Counter(eqn.primitive.name for eqn in jaxpr.eqns)


def _regions(ws: Any, x: Any, trips: Any) -> dict[str, collections.Counter[str]]:
    """The primitives of the program's top level, scan body, while cond and body."""
    closed = jax.make_jaxpr(program)(ws, x, trips)
    top = collections.Counter()
    regions: dict[str, collections.Counter[str]] = {}
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "scan":
            regions["scan"] = _histogram(eqn.params["jaxpr"].jaxpr)
        elif eqn.primitive.name == "while":
            regions["cond"] = _histogram(eqn.params["cond_jaxpr"].jaxpr)
            regions["body"] = _histogram(eqn.params["body_jaxpr"].jaxpr)
        else:
            top[eqn.primitive.name] += 1
    regions["top"] = top
    return regions


def counted_by_hand(regions: dict[str, collections.Counter[str]]) -> Callable[..., Any]:
    """The program with its primitive counts threaded by hand."""

    def counted(ws: Any, x: Any, trips: Any) -> tuple[Any, dict[str, Any]]:
        def layer(carry: Any, w: Any) -> tuple[Any, None]:
            h, steps = carry
            return (jnp.tanh(h @ w), steps + 1), None

        (h, layers), _ = lax.scan(layer, (x, jnp.int32(0)), ws)

        def body(state: Any) -> Any:
            i, h, n = state
            return i + 1, jnp.sin(h) * 0.5, n + 1

        _, h, n = lax.while_loop(lambda s: s[0] < trips, body, (0, h, jnp.int32(0)))
        multiplier = {"top": 1, "scan": layers, "cond": n + 1, "body": n}
        counts: dict[str, Any] = {}
        for region, histogram in regions.items():
            for name, k in histogram.items():
                counts[name] = counts.get(name, 0) + k * multiplier[region]
        return jnp.sum(h), {name: jnp.asarray(c, jnp.int32) for name, c in sorted(counts.items())}

    return counted


def reaped_by_hand(ws: Any, x: Any, trips: Any) -> tuple[Any, dict[str, Any]]:
    """The program returning its activations by hand, like `reap` does."""

    def layer(h: Any, w: Any) -> tuple[Any, Any]:
        h = jnp.tanh(h @ w)
        return h, h

    h, layers = lax.scan(layer, x, ws)

    def body(state: Any) -> Any:
        i, h = state
        return i + 1, jnp.sin(h) * 0.5

    _, h = lax.while_loop(lambda s: s[0] < trips, body, (0, h))
    return jnp.sum(h), {"last": h, "layers": layers}


def _time(
    variants: dict[str, Callable[..., Any]], args: tuple[Any, ...], calls: int, repeats: int
) -> Any:
    def batch(fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)

        return run

    return paired(
        {name: batch(fn) for name, fn in variants.items()},
        repeats,
        warmup=2,
        clock=runtime_clock,
    )


def _same(a: Any, b: Any) -> bool:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(
        np.allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
        for u, v in zip(leaves_a, leaves_b, strict=True)
    )


def run(quick: bool = False) -> Section:
    from kups.harvest import reap, sow
    from kups.instrument import count_primitives

    start = time.perf_counter()
    calls, repeats = (3, 3) if quick else (10, 101)
    key_w, key_x = jax.random.split(jax.random.key(0))
    ws = jax.random.normal(key_w, (DEPTH, WIDTH, WIDTH)) / WIDTH**0.5
    x = jax.random.normal(key_x, (BATCH, WIDTH))
    trips = jnp.int32(TRIPS)
    args = (ws, x, trips)

    def sowing(ws: Any, x: Any, trips: Any) -> Any:
        return program(ws, x, trips, sow=sow)

    cases = {
        "count_primitives": {
            "by hand": jax.jit(counted_by_hand(_regions(*args))),
            "kups": jax.jit(count_primitives(program)),
        },
        "reap": {"by hand": jax.jit(reaped_by_hand), "kups": jax.jit(reap(sowing, tag=TAG))},
    }
    rows, targets = [], []
    for name, variants in cases.items():
        by_hand, kups = (variants["by hand"](*args), variants["kups"](*args))
        same = _same(by_hand, (kups[0], dict(kups[1])))
        variants = {**variants, "by hand again": jax.jit(variants["by hand"].__wrapped__)}
        timings = _time(variants, args, calls, repeats)
        ratio = timings.ratio("kups", "by hand")
        rows.append(
            [
                name,
                1e3 * timings.median("by hand") / calls,
                1e3 * timings.median("kups") / calls,
                ratio,
                timings.ratio("kups", "by hand", wall=True),
                timings.ratio("by hand again", "by hand"),
                same,
            ]
        )
        targets.append(
            Target(f"{name}: runtime kups / by hand", ratio, f"<= {BOUND}", ratio <= BOUND)
        )
        targets.append(Target(f"{name}: same values as by hand", float(same), "identical", same))
    table = Table(
        f"Compiled runtime (median CPU ms per call; {repeats} repeats of {calls} calls)",
        [
            "effect",
            "by hand ms",
            "kups ms",
            "ratio",
            "ratio (wall clock)",
            "A/A: by hand / by hand",
            "same values",
        ],
        rows,
    )
    return Section(
        name="effects",
        title="4. Compiled runtime of count_primitives and reap",
        method=__doc__ or "",
        tables=[table],
        targets=targets,
        notes=[
            "The A/A column times a second, separately jitted copy of the hand-written "
            "program against the first: how far from 1.00 noise alone moves a ratio "
            "on this machine."
        ],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
