"""Benchmark 1: trace-time cost of an identity interpretation, against the floor.

The floor is re-tracing the same jaxpr by re-binding its equations
(`jax.core.eval_jaxpr`, and `benchmarks._floor.retrace` where the program has
control flow, since `eval_jaxpr` does not walk a body). Figures:

- walk: `Interpreter(default_dispatcher())` on a traced jaxpr, under
  `jax.make_jaxpr`, vs the floor on the same jaxpr, under `jax.make_jaxpr`.
- end-to-end: `jax.make_jaxpr(reinterpret(f, identity))` (which traces `f` and
  interprets its jaxpr) vs tracing `f` and then re-tracing its jaxpr with the
  floor: both trace `f` once and walk its jaxpr once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.core as jax_core
import jax.numpy as jnp

from kups.effects import Interpreter, default_dispatcher, reinterpret

from ._floor import retrace
from ._programs import count_eqns, mixed_control_flow, small_inputs, straight_line
from ._report import Section, Table, Target, main
from ._timing import paired, trace_clock

RATIO_BOUND = 1.5
LINEARITY_SLACK = 1.25  # 16k/1k <= 20 = 16 * 1.25


def _variants(
    builder: Callable[[int], Callable[..., Any]], size: int
) -> tuple[dict[str, Callable[[], object]], int]:
    x, w = small_inputs()
    ctx = jnp.zeros((), jnp.int32)
    closed = jax.make_jaxpr(builder(size))(x, w)
    identity = Interpreter(default_dispatcher())

    def floor_walk() -> object:
        return jax.make_jaxpr(functools.partial(retrace, closed.jaxpr, closed.consts))(x, w)

    def eval_jaxpr_walk() -> object:
        return jax.make_jaxpr(functools.partial(jax_core.eval_jaxpr, closed.jaxpr, closed.consts))(
            x, w
        )

    def kups_walk() -> object:
        return jax.make_jaxpr(lambda ctx, x, w: identity(closed, ctx, x, w))(ctx, x, w)

    # `builder(size)` makes a new function each time: JAX's tracing caches
    # (keyed on the function) never hit, so each run traces from scratch.
    def floor_end_to_end() -> object:
        traced = jax.make_jaxpr(builder(size))(x, w)
        return jax.make_jaxpr(functools.partial(retrace, traced.jaxpr, traced.consts))(x, w)

    def kups_end_to_end() -> object:
        return jax.make_jaxpr(reinterpret(builder(size), identity))(ctx, x, w)

    def trace_only() -> object:
        return jax.make_jaxpr(builder(size))(x, w)

    variants = {
        "floor walk": floor_walk,
        "eval_jaxpr walk": eval_jaxpr_walk,
        "kups walk": kups_walk,
        "floor end-to-end": floor_end_to_end,
        "kups end-to-end": kups_end_to_end,
        "trace f only": trace_only,
    }
    return variants, count_eqns(closed)


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    sizes = (250, 1000) if quick else (1000, 4000, 16000)
    repeats = {250: 3, 1000: 3} if quick else {1000: 15, 4000: 9, 16000: 5}
    programs = {"straight-line": straight_line, "mixed control flow": mixed_control_flow}
    rows = []
    targets = []
    for program, builder in programs.items():
        medians: dict[int, dict[str, float]] = {}
        for size in sizes:
            variants, num_eqns = _variants(builder, size)
            timings = paired(variants, repeats[size], clock=trace_clock)
            medians[size] = {name: timings.median(name) for name in variants}
            walk = timings.ratio("kups walk", "floor walk")
            end_to_end = timings.ratio("kups end-to-end", "floor end-to-end")
            rows.append(
                [
                    program,
                    num_eqns,
                    1e3 * timings.median("floor walk"),
                    1e3 * timings.median("kups walk"),
                    walk,
                    timings.ratio("kups walk", "eval_jaxpr walk"),
                    1e3 * timings.median("floor end-to-end"),
                    1e3 * timings.median("kups end-to-end"),
                    end_to_end,
                    timings.ratio("kups end-to-end", "trace f only"),
                    repeats[size],
                ]
            )
            for figure, value in (("walk", walk), ("end-to-end", end_to_end)):
                targets.append(
                    Target(
                        f"{program}, {num_eqns} eqns: kups / floor, {figure}",
                        value,
                        f"<= {RATIO_BOUND}",
                        value <= RATIO_BOUND,
                    )
                )
        small, large = sizes[0], sizes[-1]
        bound = LINEARITY_SLACK * large / small
        for name in ("kups walk", "kups end-to-end"):
            growth = medians[large][name] / medians[small][name]
            floor_name = name.replace("kups", "floor")
            floor_growth = medians[large][floor_name] / medians[small][floor_name]
            targets.append(
                Target(
                    f"{program}: {name} time, {large} / {small} eqns",
                    growth,
                    f"<= {bound:g}",
                    growth <= bound,
                    f"floor: {floor_growth:.1f}",
                )
            )
    table = Table(
        "Trace time (medians, ms of thread CPU time) and ratios (medians of per-repeat ratios)",
        [
            "program",
            "eqns",
            "floor walk ms",
            "kups walk ms",
            "walk ratio",
            "walk / flat eval_jaxpr",
            "floor e2e ms",
            "kups e2e ms",
            "e2e ratio",
            "e2e / trace f only",
            "repeats",
        ],
        rows,
    )
    return Section(
        name="trace_time",
        title="1. Trace time of an identity interpretation",
        method=__doc__ or "",
        tables=[table],
        targets=targets,
        notes=[
            "`walk / flat eval_jaxpr` compares with `jax.core.eval_jaxpr` itself, which "
            "re-binds a control-flow equation with its body untouched: on the mixed "
            "programs it skips the bodies, so that column measures how much of the "
            "program sits in bodies, not kups' overhead. `e2e / trace f only` is what "
            "interpreting costs compared with only tracing `f` (no target)."
        ],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
