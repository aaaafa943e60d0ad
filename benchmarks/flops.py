"""Benchmark: FLOPs through loops, `count_flops` against XLA and roofline.

Three counters of the FLOPs of a jitted program, side by side with a count
worked out by hand:

- `kups.instrument.count_flops` (what ran: loop trip counts, the branch taken,
  remat recomputation);
- XLA's `jax.jit(f).lower(*args).compile().cost_analysis()["flops"]` (after
  optimisation; a `while` body, and so a `scan` body, counted once);
- `jax.experimental.roofline.roofline(f)(*args)[1].unfused_flops`, where it
  imports (it needs `absl`).

Programs: a 10-step recurrence in a `scan` (`h = tanh(h @ w)`, `[16, 64] @ [64,
64]`); the same step in a `fori_loop` whose trip count (25) is an argument (a
`while` loop); the gradient of the scan with `jax.checkpoint` on the step
(recomputed in the backward pass); a loop-free matrix product, where all agree.
No timings: the figures are counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kups.instrument import count_flops

from ._report import Section, Table, Target, main

BATCH, WIDTH = 16, 64
STEP = 2 * BATCH * WIDTH * WIDTH  # h @ w
SCAN_STEPS, WHILE_TRIPS = 10, 25


def scan_rnn(w: Any, h: Any) -> Any:
    return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, None, length=SCAN_STEPS)[0]


def while_rnn(w: Any, h: Any, trips: Any) -> Any:
    return lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ w), h)


def remat_grad(w: Any, h: Any) -> Any:
    def loss(w: Any) -> Any:
        step = jax.checkpoint(lambda h, _: (jnp.tanh(h @ w), None))
        return jnp.sum(lax.scan(step, h, None, length=SCAN_STEPS)[0])

    return jax.grad(loss)(w)


def matmul(w: Any, h: Any) -> Any:
    return h @ w


def xla_flops(fn: Callable[..., Any], *args: Any) -> float:
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per program
        (analysis,) = analysis
    return float(analysis.get("flops", 0.0))


def roofline_flops(fn: Callable[..., Any], *args: Any) -> str | float:
    try:
        from jax.experimental import roofline
    except ImportError as error:
        return f"n/a ({error.name} missing)"
    return float(roofline.roofline(fn)(*args)[1].unfused_flops)


def run(quick: bool = False) -> Section:
    del quick  # counts only: as quick as it gets
    start = time.perf_counter()
    w = jax.random.normal(jax.random.key(0), (WIDTH, WIDTH)) / WIDTH**0.5
    h = jnp.ones((BATCH, WIDTH))
    trips = jnp.int32(WHILE_TRIPS)
    # The FLOPs of the matrix products, by hand (they are most of the work). The
    # remat gradient: per step, the forward product, its recomputation, and the
    # two products of the backward pass (cotangents of h and of w).
    programs: dict[str, tuple[Callable[..., Any], tuple[Any, ...], int]] = {
        f"scan, {SCAN_STEPS} steps": (scan_rnn, (w, h), SCAN_STEPS * STEP),
        f"while, {WHILE_TRIPS} trips": (
            while_rnn,
            (w, h, trips),
            WHILE_TRIPS * STEP,
        ),
        f"grad of checkpointed scan, {SCAN_STEPS} steps": (
            remat_grad,
            (w, h),
            SCAN_STEPS * 4 * STEP,
        ),
        "matmul, no loop": (matmul, (w, h), STEP),
    }
    rows, targets = [], []
    for name, (fn, args, by_hand) in programs.items():
        _, cost = jax.jit(count_flops(fn))(*args)
        products = cost.by_primitive["dot_general"][0]
        rows.append(
            [
                name,
                by_hand,
                products,
                cost.flops,
                xla_flops(fn, *args),
                roofline_flops(fn, *args),
            ]
        )
        targets.append(
            Target(
                f"count_flops' matrix products = hand count: {name}",
                float(products),
                f"= {by_hand}",
                products == by_hand,
            )
        )
    table = Table(
        "FLOPs of one call",
        [
            "program",
            "products, by hand",
            "products, count_flops",
            "all, count_flops",
            "all, XLA cost_analysis",
            "all, roofline unfused",
        ],
        rows,
    )
    return Section(
        name="flops",
        title="FLOPs through loops: count_flops, XLA and roofline",
        method=__doc__ or "",
        tables=[table],
        targets=targets,
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
