"""Benchmark 2: control flow nested 1..8 deep, one handled primitive at the bottom.

Each program nests `scan`, `while`, `cond`, `jit` or `shard_map` (or all five in
turn: "mixed") `d` levels deep around one `sin`. A handler for `sin` counts its
visits in a Python counter. A design that traces a loop body twice per level
(once to discover the context, once for real) visits it `2**d` times; kups
interprets each sub-program once per trace. Trace time is
`jax.make_jaxpr(reinterpret(f, interpreter))`, against tracing `f` alone
(`jax.make_jaxpr(f)`) in the same repeat. Growth with depth is the trace time
summed over the deeper half of the depths over the same for the shallower half
(depths 5..8 over 1..4): 2.6 for a cost proportional to depth, 16 for 2**d; the
bound allows 25% over linear.

Two contexts: "carry", an `int32` scalar the handler increments (every loop
carries it as it is), and "adds a leaf", a dict that starts empty and that the
handler adds `count` to, so every loop level needs an initializer
(`functools.partial(default_scan_handler, initializer=...)`, the same for
`while`). `cond` is left out of the second: a `cond` whose branches return
different context structures is an error by design (the leaf must exist before
the `cond`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from kups.effects import (
    HandlerResult,
    Interpreter,
    Uninitialized,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_while_handler,
    reinterpret,
)

from ._report import Section, Table, Target, main
from ._timing import paired, trace_clock

MAX_DEPTH = 8
# Growth: the trace time summed over the deeper half of the depths over the same
# for the shallower half (sums, to average out noise). For t = b*d it is the ratio
# of the depth sums (26/10 for depths 1..8); the bound allows 25% on top. 2**d
# gives 16 there, d**2 gives 5.8.
GROWTH_SLACK = 1.25
OUTPACE_BOUND = 1.6  # (kups / trace f) at the deepest level over the same at depth 1
KINDS = ("scan", "while", "cond", "jit", "shard_map")
# The "mixed" programs cycle through the kinds, level by level.
MIXED = {"mixed": KINDS, "mixed without cond": ("scan", "while", "jit", "shard_map")}


def _mesh() -> jax.sharding.Mesh:
    # One mesh axis per shard_map level: each level makes its own axis manual.
    shape = (2, 2, 2) + (1,) * (MAX_DEPTH - 3)
    names = tuple(f"a{i}" for i in range(MAX_DEPTH))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * MAX_DEPTH)


def _wrap(kind: str, inner: Callable[[Any], Any], level: int) -> Callable[[Any], Any]:
    if kind == "scan":
        return lambda x: lax.scan(lambda c, _: (inner(c), None), x, None, length=3)[0]
    if kind == "while":
        return lambda x: lax.while_loop(
            lambda s: s[0] < 3, lambda s: (s[0] + 1, inner(s[1])), (0, x)
        )[1]
    if kind == "cond":
        return lambda x: lax.cond(x[0] > 0, inner, lambda y: y, x)
    if kind == "jit":
        return lambda x: jax.jit(inner)(x)
    if kind == "shard_map":
        return jax.shard_map(inner, in_specs=P(), out_specs=P(), axis_names={f"a{level}"})
    raise ValueError(kind)


def nested(kind: str, depth: int) -> Callable[[Any], Any]:
    """`sin` at the bottom of `depth` levels of `kind` (fresh closures each call)."""
    cycle = MIXED.get(kind, (kind,))
    kinds = [cycle[level % len(cycle)] for level in range(depth)]
    fn: Callable[[Any], Any] = jnp.sin
    for level in reversed(range(depth)):
        fn = _wrap(kinds[level], fn, level)
    return fn


def _fill_uninitialized(ctx_before: Any, sentinel: Any) -> Any:
    del ctx_before
    return jax.tree.map(
        lambda leaf: jnp.zeros(leaf.shape, leaf.dtype) if isinstance(leaf, Uninitialized) else leaf,
        sentinel,
        is_leaf=lambda leaf: isinstance(leaf, Uninitialized),
    )


class Counter:
    """A `sin` handler that counts its visits in Python."""

    def __init__(self, adds_leaf: bool):
        self.visits = 0
        self.adds_leaf = adds_leaf

    def __call__(self, interpreter: Any, ctx: Any, eqn: Any, invals: list[Any]) -> HandlerResult:
        self.visits += 1
        outvals = default_primitive_handler(interpreter, ctx, eqn, invals).outvals
        if self.adds_leaf:
            count = ctx["count"] + 1 if "count" in ctx else jnp.ones((), jnp.int32)
            return HandlerResult({**ctx, "count": count}, outvals)
        return HandlerResult(ctx + 1, outvals)


def _interpreter(counter: Counter) -> Interpreter:
    dispatcher = default_dispatcher().register_handler("sin", counter)
    if counter.adds_leaf:
        dispatcher.register_handler(
            "scan", functools.partial(default_scan_handler, initializer=_fill_uninitialized)
        )
        dispatcher.register_handler(
            "while", functools.partial(default_while_handler, initializer=_fill_uninitialized)
        )
    return Interpreter(dispatcher)


def _span(depths: tuple[int, ...]) -> str:
    return ",".join(map(str, depths)) if len(depths) < 3 else f"{depths[0]}..{depths[-1]}"


def _notes(irregular_visits: list[str], superlinear: list[str]) -> list[str]:
    notes = [
        'In the "adds a leaf" rows the innermost loop is traced twice (once to find '
        "the context its body returns, once more with the initializer's context), so "
        "the visits are 2; every outer level reuses the cached body of the level "
        "below, so the count stays 2, not 2**d."
    ]
    if irregular_visits:
        notes.append(
            f"**Visits not constant** ({', '.join(irregular_visits)}): 3 instead of 2 "
            "when the loop that adds the leaf sits inside a `shard_map` that sits inside "
            "another loop. The initializer's new leaf is a concrete array, whose aval "
            "has no mesh; when the outer loop re-traces with that leaf, it enters the "
            "`shard_map` body through `shard_aval` and its aval now carries the manual "
            "mesh. A body cache (`kups.effects._body.trace_body`) keyed on the whole "
            "aval, sharding included, traces the levels below that `shard_map` "
            "once more. It is bounded (one extra trace, at any depth), not 2**d. "
            "kups keys the cache on what JAX's type check compares "
            "(`kups.effects._compat.aval_match_key`, checked with `typematch` on a hit), "
            "so seeing this means that key misses a difference of this JAX release."
        )
    if superlinear:
        notes.append(
            f"**Trace time superlinear in depth** ({', '.join(superlinear)}): kups / "
            f"tracing `f` grows more than {OUTPACE_BOUND}x from the shallowest depth to "
            "the deepest, or the growth exceeds its bound. Where the programs nest "
            "`shard_map` on a JAX older than 0.10.2: there kups re-binds each "
            "`shard_map` equation through its `get_bind_params`, which turns the body "
            "jaxpr back into a function that staging traces again, re-staging every "
            "`shard_map` nested in it: O(d**2) in all. From JAX 0.10.2 on, "
            "`kups.effects._compat.bind_shard_map` emits the staged equation with the "
            "already interpreted body instead (depth 8: 11.8 ms before, about 4.5 ms "
            "after, measured when it was introduced)."
        )
    return notes


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    depths = (2, 4, 6, 8) if quick else tuple(range(1, MAX_DEPTH + 1))
    repeats = 1 if quick else 15
    shallow, deep_half = depths[: len(depths) // 2], depths[len(depths) // 2 :]
    linear = sum(deep_half) / sum(shallow)
    growth_bound = GROWTH_SLACK * linear
    exponential = sum(2**d for d in deep_half) / sum(2**d for d in shallow)
    x = jnp.linspace(0.5, 1.0, 8, dtype=jnp.float32)
    variants = {
        "carry": (False, (*KINDS, "mixed")),
        "adds a leaf": (True, ("scan", "while", "jit", "shard_map", "mixed without cond")),
    }
    visit_rows, ratio_rows, growth_rows, ms_rows = [], [], [], []
    irregular_visits, superlinear = [], []
    targets = []
    with jax.set_mesh(_mesh()):
        for variant, (adds_leaf, kinds) in variants.items():
            for kind in kinds:
                counter = Counter(adds_leaf)
                interpreter = _interpreter(counter)
                visits, ratios, kups_ms, trace_ms = [], [], {}, {}
                for depth in depths:
                    ctx: Any = {} if adds_leaf else jnp.zeros((), jnp.int32)
                    counter.visits = 0
                    jax.make_jaxpr(reinterpret(nested(kind, depth), interpreter))(ctx, x)
                    visits.append(counter.visits)
                    timings = paired(
                        {
                            "kups": lambda k=kind, d=depth, c=ctx, i=interpreter: jax.make_jaxpr(
                                reinterpret(nested(k, d), i)
                            )(c, x),
                            "trace f": lambda k=kind, d=depth: jax.make_jaxpr(nested(k, d))(x),
                        },
                        repeats,
                        warmup=0,
                        clock=trace_clock,
                    )
                    ratios.append(timings.ratio("kups", "trace f"))
                    kups_ms[depth] = 1e3 * timings.median("kups")
                    trace_ms[depth] = 1e3 * timings.median("trace f")
                label = f"{kind} ({variant})"
                visit_rows.append([label, *visits])
                ratio_rows.append([label, *ratios])
                ms_rows.append([label, *(kups_ms[d] for d in depths)])
                deep = depths[-1]
                growth = sum(kups_ms[d] for d in deep_half) / sum(kups_ms[d] for d in shallow)
                trace_growth = sum(trace_ms[d] for d in deep_half) / sum(
                    trace_ms[d] for d in shallow
                )
                growth_rows.append([label, kups_ms[depths[0]], kups_ms[deep], growth, trace_growth])
                constant = len(set(visits)) == 1
                if not constant:
                    irregular_visits.append(label)
                # Growth above the bound, or kups' trace time pulling away from
                # tracing `f` alone as the nesting deepens.
                if growth > growth_bound or ratios[-1] / ratios[0] > OUTPACE_BOUND:
                    superlinear.append(label)
                targets.append(
                    Target(
                        f"{label}: handler visits, depth {depths[0]}..{deep}",
                        float(max(visits)),
                        "constant",
                        constant,
                        f"2**{deep} = {2**deep}",
                    )
                )
                targets.append(
                    Target(
                        f"{label}: kups trace time, depths {_span(deep_half)} / "
                        f"depths {_span(shallow)}",
                        growth,
                        f"<= {growth_bound:.2f} (linear: {linear:.2f}; 2**d: {exponential:.0f})",
                        growth <= growth_bound,
                    )
                )
    header = [f"d={d}" for d in depths]
    tables = [
        Table(
            "Handler visits of the innermost `sin` (Python counter)",
            ["program (context)", *header],
            [*visit_rows, ["2**d (double tracing)", *(2**d for d in depths)]],
        ),
        Table(
            f"Trace time of kups (median ms of thread CPU time; {repeats} repeats)",
            ["program (context)", *header],
            ms_rows,
        ),
        Table(
            "Trace time, kups / tracing `f` alone (median of per-repeat ratios)",
            ["program (context)", *header],
            ratio_rows,
        ),
        Table(
            f"Growth with depth (median ms of thread CPU time; {repeats} repeats)",
            [
                "program (context)",
                f"kups ms, d={depths[0]}",
                f"kups ms, d={depths[-1]}",
                f"kups, depths {_span(deep_half)} / {_span(shallow)}",
                f"trace f, depths {_span(deep_half)} / {_span(shallow)}",
            ],
            growth_rows,
        ),
    ]
    return Section(
        name="nesting",
        title="2. Nested control flow",
        method=__doc__ or "",
        tables=tables,
        targets=targets,
        notes=_notes(irregular_visits, superlinear),
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
