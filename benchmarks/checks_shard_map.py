"""Benchmark 7: compiled runtime of `kups.checks` on a data-parallel step, against
`checkify`'s user checks on the same step.

The program: one step of SGD on a two-layer MLP (width `WIDTH`) inside a
`jax.shard_map` over all devices (mesh axis `data`): each shard takes its part
of the batch (`BATCH` rows in all), computes its gradients, and `pmean`s them
over the shards. The step checks that the loss is finite and that the gradient
norm is below a bound; no check fails on these inputs. (The same step in a
`lax.scan` of `STEPS` steps, and the step on a mesh of Explicit axes, are also
tried with both; the section records what each does. Checkify cannot transform
the scanned step under `check_vma=True`, the default.) The timed programs use a
mesh of Auto axes.

- unchecked: `jax.jit` of the program without checks.
- kups: `jax.jit(checked(program))`, the checks written with `kups.checks.check`.
- checkify: `jax.jit(checkify.checkify(program))`, the same checks written with
  `checkify.check`.

Both checked programs must combine each shard's record into one result (the
first failure in mesh order for kups); the figures are each one's runtime over
the unchecked program's, and kups' over checkify's. Runtime is measured as in
benchmark 3 (process CPU time, interleaved repeats, median of per-repeat
ratios). The section also counts the cross-device collectives in each compiled
program.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ._report import Section, Table, Target, main
from .effects import _time

STEPS, BATCH, WIDTH = 4, 1024, 256
BOUND = 1.0  # kups' runtime over checkify's
COLLECTIVES = r" (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(-start)?\("


def program(
    mesh: Any, check: Callable[..., Any] | None, steps: int | None = None
) -> Callable[..., Any]:
    """The data-parallel step (a scan of `steps` of them if given);
    `check(pred, message)` is called twice per step when given."""

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        w1, w2 = params
        return jnp.mean((jnp.tanh(x @ w1) @ w2 - y) ** 2)

    def shard(params: Any, x: Any, y: Any) -> Any:
        def step(params: Any, _: Any) -> tuple[Any, Any]:
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            grads = lax.pmean(grads, "data")
            norm = jnp.sqrt(sum(jnp.sum(g**2) for g in grads))
            if check is not None:
                check(jnp.isfinite(loss), "loss is not finite")
                check(norm < 1e6, "gradient norm too large")
            params = tuple(p - 0.1 * g for p, g in zip(params, grads, strict=True))
            return params, lax.pmean(loss, "data")

        if steps is None:
            return step(params, None)
        return lax.scan(step, params, None, length=steps)

    def run(params: Any, x: Any, y: Any) -> Any:
        return jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P()),
        )(params, x, y)

    return run


def _attempt(fn: Callable[[], Any]) -> str:
    """ "runs", or the first line of what `fn` raises."""
    try:
        jax.block_until_ready(fn())
    except Exception as err:  # noqa: BLE001 (recorded, whatever it is)
        return f"`{type(err).__name__}: {str(err).splitlines()[0][:200]}`"
    return "runs"


def _collectives(fn: Any, args: tuple[Any, ...]) -> int:
    return len(re.findall(COLLECTIVES, fn.lower(*args).compile().as_text()))


def run(quick: bool = False) -> Section:
    from kups.checks import check, checked

    start = time.perf_counter()
    calls, repeats = (3, 3) if quick else (10, 61)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), 4)
    params = (
        jax.random.normal(keys[0], (WIDTH, WIDTH)) / WIDTH**0.5,
        jax.random.normal(keys[1], (WIDTH, 1)) / WIDTH**0.5,
    )
    batch = NamedSharding(mesh, P("data"))
    x = jax.device_put(jax.random.normal(keys[2], (BATCH, WIDTH)), batch)
    y = jax.device_put(jax.random.normal(keys[3], (BATCH, 1)), batch)
    args = (params, x, y)

    variants = {
        "unchecked": jax.jit(program(mesh, None)),
        "kups": jax.jit(checked(program(mesh, check))),
        "checkify": jax.jit(checkify.checkify(program(mesh, checkify.check))),
    }
    plain = variants["unchecked"](*args)
    out_kups, error = variants["kups"](*args)
    error_checkify, out_checkify = variants["checkify"](*args)
    same = all(
        bool(jnp.array_equal(a, b)) and bool(jnp.array_equal(a, c))
        for a, b, c in zip(
            jax.tree.leaves(plain),
            jax.tree.leaves(out_kups),
            jax.tree.leaves(out_checkify),
            strict=True,
        )
    )
    clean = error.get() is None and error_checkify.get() is None
    collectives = {name: _collectives(fn, args) for name, fn in variants.items()}

    # What checkify does not transform, and kups does.
    scanned = _attempt(
        lambda: jax.jit(checkify.checkify(program(mesh, checkify.check, STEPS)))(*args)
    )
    kups_scanned = jax.jit(checked(program(mesh, check, STEPS)))(*args)[1].get() is None
    explicit = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))
    explicit_args = jax.device_put(
        args, (NamedSharding(explicit, P()), *(NamedSharding(explicit, P("data")),) * 2)
    )
    on_explicit = _attempt(
        lambda: jax.jit(checkify.checkify(program(explicit, checkify.check)))(*explicit_args)
    )
    kups_explicit = jax.jit(checked(program(explicit, check)))(*explicit_args)[1].get() is None

    timings = _time(variants, args, calls, repeats)

    kups_over = timings.ratio("kups", "unchecked")
    checkify_over = timings.ratio("checkify", "unchecked")
    kups_vs_checkify = timings.ratio("kups", "checkify")
    table = Table(
        f"Compiled runtime (median CPU ms per call; {repeats} repeats of {calls} calls; "
        f"{jax.device_count()} devices)",
        ["program", "ms per call", "/ unchecked", "collectives in the compiled program"],
        [
            [
                name,
                1e3 * timings.median(name) / calls,
                timings.ratio(name, "unchecked") if name != "unchecked" else 1.0,
                collectives[name],
            ]
            for name in variants
        ],
    )
    targets = [
        Target(
            "data-parallel step: runtime kups / checkify",
            kups_vs_checkify,
            f"<= {BOUND}",
            kups_vs_checkify <= BOUND,
        ),
        Target(
            "data-parallel step: same outputs, no failure reported",
            float(same and clean),
            "identical",
            same and clean,
        ),
    ]
    return Section(
        name="checks_shard_map",
        title="7. Checks in shard_map: runtime against checkify",
        method=__doc__ or "",
        tables=[table],
        targets=targets,
        notes=[
            f"Over the unchecked program: kups {kups_over:.3f}, checkify {checkify_over:.3f}. "
            "Collectives counts the all-reduce, all-gather and similar instructions in "
            "each compiled program (the unchecked one has the gradient and loss means).",
            f"The same step in a scan of {STEPS} steps: kups "
            f"{'runs it, no failure reported' if kups_scanned else 'reports a failure'}; "
            f"checkify on JAX {jax.__version__}: {scanned}",
            f"The step on a mesh of Explicit axes: kups "
            f"{'runs it, no failure reported' if kups_explicit else 'reports a failure'}; "
            f"checkify: {on_explicit}",
        ],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
