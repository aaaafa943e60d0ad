"""Benchmark: `find_nans` against `checkify`'s `nan_checks` on a training loop.

The program: 100 SGD steps of a 3-layer MLP in a `lax.scan` under `jax.jit`,
whose loss masks missing targets (NaN) with a `where`, as a library would: a
NaN is made and discarded at every step. At step 37 an input goes negative and
`sqrt` makes a NaN that reaches the parameters and the losses.

Variants: `jit(f)` (plain), `find_nans(f)` (`report="reaching"`, the default),
`find_nans(f, report="first")`, `nan_sites(f)` (every site, with counts) and
`checkify(f, errors=nan_checks)`, each under `jax.jit`. Figures:

- what each one reports (`reaching` must say `sqrt` at iteration 37; `first`
  and checkify stop at the NaN target masked at step 0; `nan_sites` lists
  the equations that made a NaN themselves: `sqrt` at step 37 only, since
  the masked targets were NaN on input);
- equations in the scan body of the traced program (the cost of the
  instrumentation, before XLA);
- time to the report: tracing, compiling and running a fresh function, until
  the report is read (median over repeats, paired with the plain `jit(f)`);
- compiled runtime over plain: the median of the per-repeat ratio of CPU times
  of a batch of calls of the compiled programs (see `benchmarks/_timing.py`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify
from jax.extend.core import ClosedJaxpr

from kups.debug import find_nans, nan_sites

from ._report import Section, Table, Target, main
from ._timing import paired, runtime_clock

LAYERS = (32, 64, 64, 1)
BATCH = 32
STEPS = 100
BAD_STEP = 37


def init(bad_step: int | None = BAD_STEP) -> tuple[Any, Any, Any]:
    keys = jax.random.split(jax.random.key(0), len(LAYERS))
    params = [
        (jax.random.normal(k, (n_in, n_out)) / n_in**0.5, jnp.zeros(n_out))
        for k, (n_in, n_out) in zip(keys, itertools.pairwise(LAYERS), strict=False)
    ]
    xs = jax.random.normal(keys[-1], (STEPS, BATCH, LAYERS[0])) * 0.1 + 1.0
    ys = jnp.zeros((STEPS, BATCH, 1)).at[:, 0, 0].set(jnp.nan)  # missing targets
    if bad_step is not None:
        xs = xs.at[bad_step, 0, 0].set(-1.0)
    return params, xs, ys


def loss(params: Any, x: Any, y: Any) -> Any:
    h = jnp.sqrt(x)  # NaN where an input is negative (step 37)
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    err = jnp.where(jnp.isnan(y), 0.0, h @ w + b - y)  # NaN made and discarded
    return jnp.mean(err**2)


def train(params: Any, xs: Any, ys: Any) -> Any:
    def step(params: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads), value

    return lax.scan(step, params, (xs, ys))


def variants() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """How each variant wraps a training function (the plain one returns it)."""
    return {
        "jit(f)": lambda f: f,
        "find_nans reaching": lambda f: find_nans(f),
        "find_nans first": lambda f: find_nans(f, report="first"),
        "nan_sites": lambda f: nan_sites(f),
        "checkify nan_checks": lambda f: checkify.checkify(f, errors=checkify.nan_checks),
    }


def describe(name: str, result: Any) -> str:
    if name == "jit(f)":
        return "-"
    if name == "nan_sites":
        return "; ".join(
            f"{s.primitive} {s.kind} x{s.count} from iteration {s.first_iteration}"
            for s in result[1]
        )
    if name.startswith("find_nans"):
        report = result[1]
        if not report.found:
            return "nothing"
        return f"{report.primitive}, {report.kind}, iteration {report.iteration}"
    message = result[0].get()
    return "nothing" if message is None else message.splitlines()[0]


def body_equations(closed: ClosedJaxpr) -> int:
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"]
            return len(getattr(body, "jaxpr", body).eqns)
    return 0


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    params, xs, ys = init()
    compile_repeats, calls, repeats = (1, 2, 3) if quick else (5, 10, 31)
    wraps = variants()

    reports, equations = {}, {}
    compiled = {}
    for name, wrap in wraps.items():
        fn = jax.jit(wrap(train))
        reports[name] = describe(name, fn(params, xs, ys))
        equations[name] = body_equations(jax.make_jaxpr(wrap(train))(params, xs, ys))
        compiled[name] = fn

    def fresh(wrap: Callable[..., Any]) -> Callable[[], object]:
        def once() -> object:
            # A new function object each time: nothing comes from JAX's caches.
            def f(params: Any, xs: Any, ys: Any) -> Any:
                return train(params, xs, ys)

            return jax.block_until_ready(jax.jit(wrap(f))(params, xs, ys))

        return once

    to_report = paired(
        {name: fresh(wrap) for name, wrap in wraps.items()}, compile_repeats, warmup=0
    )

    def batch(fn: Callable[..., Any]) -> Callable[[], object]:
        def go() -> object:
            out = None
            for _ in range(calls):
                out = fn(params, xs, ys)
            return jax.block_until_ready(out)

        return go

    runtime = paired(
        {name: batch(fn) for name, fn in compiled.items()}, repeats, clock=runtime_clock
    )
    rows = [
        [
            name,
            reports[name],
            equations[name],
            to_report.median(name),
            to_report.ratio(name, "jit(f)"),
            runtime.median(name) / calls * 1e3,
            runtime.ratio(name, "jit(f)"),
        ]
        for name in wraps
    ]
    table = Table(
        f"{STEPS}-step MLP scan, NaN made at step {BAD_STEP} and discarded NaNs at every "
        f"step ({compile_repeats} trace+compile repeats; runtime: {repeats} repeats of "
        f"{calls} calls)",
        [
            "variant",
            "reports",
            "scan-body equations",
            "trace+compile+run s",
            "ratio to jit(f)",
            "compiled ms per call",
            "runtime ratio to jit(f)",
        ],
        rows,
    )
    reaching_ok = reports["find_nans reaching"] == f"sqrt, nan, iteration ({BAD_STEP},)"
    report_ratio = to_report.ratio("find_nans reaching", "checkify nan_checks")
    sites_ratio = to_report.ratio("nan_sites", "find_nans first")
    first_ratio = to_report.ratio("find_nans first", "find_nans reaching")
    runtime_ratio = runtime.ratio("find_nans reaching", "checkify nan_checks")
    targets = [
        Target(
            "find_nans reaching reports the NaN of step 37 (sqrt)",
            float(reaching_ok),
            "yes",
            reaching_ok,
            reports["find_nans reaching"],
        ),
        Target(
            "time to the report (trace+compile+run): reaching / checkify",
            report_ratio,
            "<= 1.5",
            report_ratio <= 1.5,
        ),
        Target(
            "time to the report (trace+compile+run): first / reaching",
            first_ratio,
            "<= 1",
            first_ratio <= 1.0,
        ),
        Target(
            "time to the report (trace+compile+run): nan_sites / find_nans first",
            sites_ratio,
            "<= 1",
            sites_ratio <= 1.0,
        ),
        Target(
            "compiled runtime: reaching / checkify", runtime_ratio, "<= 1", runtime_ratio <= 1.0
        ),
    ]
    return Section(
        name="nans",
        title="NaN reports: find_nans and checkify",
        method=__doc__ or "",
        tables=[table],
        targets=targets,
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
