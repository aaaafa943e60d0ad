"""Benchmark: every effect called without `jit`, against the plain program called
without `jit` (notebook speed).

Two programs, each called eagerly, warm (after two untimed calls), in the same
process: one SGD step of a two-layer MLP inside a `jax.shard_map` over all
devices (each shard computes its gradients, then `pmean`s them), and a
`lax.scan` of `STEPS` such steps on one device. The MLP sows its hidden layer
(`tag="act"`), which the plain program ignores.

Variants: the plain program; `count_primitives`, `count_flops`, `reap`, `plant`,
`checked` with each error set, `find_nans` with both reports and `nan_sites`.
An effect called eagerly is compiled as a whole (`stage_eagerly` in the effect
toolkit), as `jax.jit` would; the plain program runs op by op, as eager JAX
does, so an eager `shard_map` body dispatches each operation on every device.
The figure is each variant's wall time per call over the plain program's
(median of per-repeat ratios, interleaved repeats). The identity
interpretation (`reinterpret` with the default dispatcher) is not staged: it
is checked to equal the plain program bit for bit, eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kups import checks
from kups.debug import find_nans, nan_sites
from kups.effects import Interpreter, default_dispatcher, reinterpret
from kups.harvest import plant, reap, sow
from kups.instrument import count_flops, count_primitives

from ._report import Section, Table, Target, main
from ._timing import paired

STEPS, BATCH, WIDTH = 20, 64, 32
BOUND = 3.0  # an effect's eager time over the plain program's


def _loss(params: Any, x: Any, y: Any) -> Any:
    w1, w2 = params
    h = sow(jnp.tanh(x @ w1), tag="act", name="hidden", mode="clobber")
    return jnp.mean((h @ w2 - y) ** 2)


def _update(params: Any, grads: Any) -> Any:
    return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)


def programs(mesh: Any) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    keys = jax.random.split(jax.random.key(0), 4)
    params = (
        jax.random.normal(keys[0], (WIDTH, WIDTH)) / WIDTH**0.5,
        jax.random.normal(keys[1], (WIDTH, 1)) / WIDTH**0.5,
    )
    x = jax.random.normal(keys[2], (BATCH, WIDTH))
    y = jax.random.normal(keys[3], (BATCH, 1))

    def shard_step(params: Any, x: Any, y: Any) -> Any:
        def body(params: Any, x: Any, y: Any) -> Any:
            grads = lax.pmean(jax.grad(_loss)(params, x, y), "data")
            return _update(params, grads)

        specs = (P(), P("data"), P("data"))
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())(params, x, y)

    def scan_steps(params: Any, xs: Any, ys: Any) -> Any:
        def step(params: Any, batch: Any) -> tuple[Any, None]:
            return _update(params, jax.grad(_loss)(params, *batch)), None

        return lax.scan(step, params, (xs, ys))[0]

    data = NamedSharding(mesh, P("data"))
    return {
        f"shard_map SGD step ({mesh.size} devices)": (
            shard_step,
            (params, jax.device_put(x, data), jax.device_put(y, data)),
        ),
        f"scan of {STEPS} SGD steps": (
            scan_steps,
            (params, jnp.stack([x] * STEPS), jnp.stack([y] * STEPS)),
        ),
    }


def _planted(fn: Callable[..., Any]) -> Callable[..., Any]:
    planted = plant(fn, tag="act")
    return lambda *args: planted({}, *args)


def variants() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    wraps: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        "plain": lambda f: f,
        "count_primitives": count_primitives,
        "count_flops": count_flops,
        "reap": lambda f: reap(f, tag="act"),
        "plant": _planted,
    }
    for name in ("user_checks", "nan_checks", "div_checks", "index_checks", "all_checks"):
        errors = getattr(checks, name)
        wraps[f"checked({name})"] = lambda f, errors=errors: checks.checked(f, errors=errors)
    wraps["find_nans reaching"] = find_nans
    wraps["find_nans first"] = lambda f: find_nans(f, report="first")
    wraps["nan_sites"] = nan_sites
    return wraps


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    repeats = 3 if quick else 11
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    tables, targets = [], []
    for title, (program, args) in programs(mesh).items():
        identity = reinterpret(program, Interpreter(default_dispatcher()))
        same = all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(identity(None, *args)[0]),
                jax.tree.leaves(program(*args)),
                strict=True,
            )
        )
        targets.append(
            Target(f"{title}: identity equals plain eager bit for bit", float(same), "yes", same)
        )
        calls = {}
        for name, wrap in variants().items():
            wrapped = wrap(program)
            calls[name] = lambda wrapped=wrapped, args=args: jax.block_until_ready(wrapped(*args))
        timings = paired(calls, repeats, warmup=2)
        rows = []
        for name in calls:
            ratio = timings.ratio(name, "plain")
            rows.append([name, timings.median(name) * 1e3, ratio])
            if name != "plain":
                targets.append(
                    Target(f"{title}: {name} / plain", ratio, f"<= {BOUND}", ratio <= BOUND)
                )
        tables.append(Table(title, ["variant", "ms per call", "ratio to plain"], rows))
    return Section(
        name="eager",
        title="Eager effects: every effect called without jit (notebook speed)",
        method=__doc__ or "",
        tables=tables,
        targets=targets,
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
