"""The demo that `python -m kups` runs.

A small MLP is trained with SGD: a `lax.scan` over the steps, each step
running the forward and backward pass in `jax.shard_map` over the `data` axis
(one shard of the batch per device, loss and gradients averaged with a
`pmean`), all under `jax.jit`. The demo runs it plainly and under the four
effects of kups, prints what each one sees, and checks every number it prints
against plain JAX.

Import this module only after the device count is set (`kups.__main__` does
that): it imports JAX.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import kups
from kups._demo_report import Report, table
from kups.checks import check, checked
from kups.debug import find_nans
from kups.harvest import reap, sow
from kups.instrument import count_primitives

FEATURES = 4
HIDDEN = 16
SAMPLES_PER_SHARD = 16
LEARNING_RATE = 0.1
AXIS = "data"

Params = dict[str, jax.Array]


# ---------------------------------------------------------------------------
# The program: nothing below knows about kups except `sow` and `check`, which
# are the identity when no kups interpreter runs the program.
# ---------------------------------------------------------------------------


def init_params(seed: int = 0) -> Params:
    """A 4-16-1 MLP with a ReLU hidden layer."""
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(FEATURES, HIDDEN)) / 2, jnp.float32),
        "b1": jnp.zeros(HIDDEN),
        "w2": jnp.asarray(rng.normal(size=HIDDEN) / 4, jnp.float32),
        "b2": jnp.zeros(()),
    }


def make_data(steps: int, devices: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One batch per step, `SAMPLES_PER_SHARD` samples per device (NumPy arrays:
    building them with JAX would compile a program per operation)."""
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(steps, devices * SAMPLES_PER_SHARD, FEATURES)).astype(np.float32)
    ys = np.tanh(xs @ np.arange(1.0, FEATURES + 1, dtype=np.float32) / 4)
    return xs, ys


def hidden(params: Params, x: jax.Array) -> jax.Array:
    """The hidden layer, on samples normalised to unit root-mean-square."""
    x = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    return jax.nn.relu(x @ params["w1"] + params["b1"])


def local_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """The mean squared error on one shard's samples."""
    check(jnp.all(jnp.abs(x) < 100.0), "input out of range: max |x| = {:.1f}", jnp.max(jnp.abs(x)))
    h = hidden(params, x)
    sow(jnp.mean(h > 0), tag="stats", name="active_relus", mode="append")
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def shard_loss_and_grads(params: Params, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    """Runs on each shard: the loss averaged over the shards, and its gradients.

    With `check_vma=True` the replicated `params` are cast to per-shard values
    where they meet the data (`pvary`); in the backward pass that cast becomes
    the `psum` of the gradients over the shards.
    """
    return jax.value_and_grad(lambda p: lax.pmean(local_loss(p, x, y), AXIS))(params)


def sgd_update(params: Params, grads: Params, lr: Any) -> Params:
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def make_train(mesh: Mesh) -> Callable[..., tuple[Params, jax.Array]]:
    """`train(params, xs, ys, lr) -> (params, losses)`: one SGD step per batch."""
    sharded = jax.shard_map(
        shard_loss_and_grads,
        mesh=mesh,
        in_specs=(P(), P(AXIS), P(AXIS)),
        out_specs=(P(), P()),
    )

    def train(params: Params, xs: jax.Array, ys: jax.Array, lr: Any) -> tuple[Params, jax.Array]:
        check(lr > 0, "learning rate must be positive, got {}", lr)

        def step(params: Params, batch: tuple[jax.Array, jax.Array]) -> tuple[Params, Any]:
            loss, grads = sharded(params, *batch)
            return sgd_update(params, grads, lr), loss

        return lax.scan(step, params, (xs, ys))

    return train


# ---------------------------------------------------------------------------
# Options and verifications (printing: `kups._demo_report`).
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """What `python -m kups` asked for (see `kups.__main__` for the meaning)."""

    sections: Sequence[str]
    steps: int = 8
    devices: int = 8
    bad_step: int = 3
    bad_shard: int = 5
    nan_step: int = 5
    nan_shard: int = 0
    color: bool = False


def _line_of(snippet: str) -> int:
    """The line of this file that holds `snippet` (the demo's expected answers)."""
    with open(__file__, encoding="utf-8") as source:
        for number, line in enumerate(source, start=1):
            if snippet in line and "_line_of(" not in line:
                return number
    raise AssertionError(f"{snippet!r} is not in {__file__}")


def _same_losses(report: Report, what: str, losses: Any, plain: Any) -> None:
    losses, plain = np.asarray(losses), np.asarray(plain)
    difference = float(np.max(np.abs(losses - plain)))
    report.verify(
        bool(np.allclose(losses, plain, rtol=1e-5, atol=1e-6)),
        f"{what}: the losses equal plain JAX's (largest difference {difference:.1e})",
        f"interpreted {losses}, plain {plain}",
    )


# ---------------------------------------------------------------------------
# The sections.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Setup:
    options: Options
    mesh: Mesh
    train: Callable[..., Any]
    params: Params
    xs: np.ndarray
    ys: np.ndarray
    plain_losses: np.ndarray


def _counts(setup: _Setup, report: Report) -> None:
    options, steps, devices = setup.options, setup.options.steps, setup.options.devices
    report.heading("kups.instrument.count_primitives: what ran, and how often")
    report.para(
        "count_primitives(train) counts every primitive each time it runs: the scan body "
        f"{steps} times, the shard_map body once per shard. Counting the shard_map body alone, "
        "inside a shard_map, gives the counts of one shard and one step."
    )
    (_, losses), total = jax.jit(count_primitives(setup.train))(
        setup.params, setup.xs, setup.ys, LEARNING_RATE
    )

    def one_shard(params: Params, x: jax.Array, y: jax.Array) -> Any:
        return count_primitives(shard_loss_and_grads)(params, x, y)[1]

    per_shard = jax.jit(
        jax.shard_map(one_shard, mesh=setup.mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
    )(setup.params, setup.xs[0], setup.ys[0])
    # Under jit, like in train: the learning rate is then a weakly typed tracer,
    # and `lr * g` converts it to the gradient's dtype.
    _, per_update = jax.jit(count_primitives(sgd_update))(setup.params, setup.params, LEARNING_RATE)

    total = {name: int(count) for name, count in total.items()}
    per_shard = {name: int(count) for name, count in per_shard.items()}
    per_update = {name: int(count) for name, count in per_update.items()}
    names = sorted(total, key=lambda name: (-total[name], name))
    rows = [
        [
            name,
            str(per_shard.get(name, "")),
            str(per_update.get(name, "")),
            str(total[name]),
        ]
        for name in names
    ]
    report.text()
    header = ["primitive", "per shard and step", "per SGD update", "total"]
    report.text(table(header, rows))
    in_bodies = steps * devices * sum(per_shard.values())
    in_updates = steps * sum(per_update.values())
    report.text(
        f"  {sum(total.values())} primitives ran: {in_bodies} in the shard_map bodies, "
        f"{in_updates} in the updates, {sum(total.values()) - in_bodies - in_updates} before "
        "the scan."
    )
    report.para(
        "pvary: JAX's cast of a replicated value to a per-shard one (check_vma=True). "
        "psum_invariant: the psum of the loss (in pmean) and of the gradients (the "
        "transpose of pvary). kups_check, kups_sow: the effects that check and sow bind.",
        indent="  ",
        dim=True,
    )
    report.text()
    once = {
        name: total[name] - steps * (devices * per_shard.get(name, 0) + per_update.get(name, 0))
        for name in total
    }
    once = {name: count for name, count in once.items() if count}
    report.verify(
        once == {"gt": 1, "kups_check": 1},
        f"total = {steps} steps x ({devices} shards x per shard + per update) "
        "+ the learning-rate check (gt, kups_check) once",
        f"left over: {once}",
    )
    report.verify(
        per_shard.get("dot_general") == 5,
        "5 dot_generals per shard and step: 2 matmuls forward, 3 backward "
        "(the input needs no gradient)",
        f"got {per_shard.get('dot_general')}",
    )
    report.verify(
        total.get("kups_sow") == steps * devices,
        f"one sow per shard and step: {steps * devices}",
        f"got {total.get('kups_sow')}",
    )
    _same_losses(report, "count_primitives", losses, setup.plain_losses)
    del options


def _reap(setup: _Setup, report: Report) -> None:
    options = setup.options
    report.heading("kups.harvest.reap: an activation statistic, per step and shard")
    report.para(
        'local_loss sows jnp.mean(h > 0), the fraction of active ReLUs, with mode="append". '
        "reap stacks it along the scan's steps, with one entry per shard of the shard_map."
    )
    (_, losses), sown = jax.jit(reap(setup.train, tag="stats"))(
        setup.params, setup.xs, setup.ys, LEARNING_RATE
    )
    active = np.asarray(sown["active_relus"])
    report.text()
    header = ["step", *(f"{AXIS}={i}" for i in range(options.devices)), "mean"]
    rows = [
        [str(step), *(f"{value:.3f}" for value in row), f"{row.mean():.3f}"]
        for step, row in enumerate(active)
    ]
    report.text(table(header, rows))
    report.text()

    # The oracle: the same steps in a Python loop of plain JAX, and the statistic
    # recomputed from the parameters of each step, shard by shard.
    step = jax.jit(lambda params, x, y: setup.train(params, x[None], y[None], LEARNING_RATE))

    @jax.jit
    def active_per_shard(params: Params, x: jax.Array) -> jax.Array:
        shards = x.reshape(options.devices, SAMPLES_PER_SHARD, FEATURES)
        return jnp.mean(hidden(params, shards) > 0, axis=(1, 2))

    params, expected = setup.params, []
    for x, y in zip(setup.xs, setup.ys):
        expected.append(active_per_shard(params, x))
        params, _ = step(params, x, y)
    expected = np.asarray(expected)
    one_unit = 1 / (SAMPLES_PER_SHARD * HIDDEN)
    report.verify(
        active.shape == (options.steps, options.devices),
        f"shape (steps, shards) = {(options.steps, options.devices)}",
        f"got {active.shape}",
    )
    report.verify(
        active.shape == expected.shape and bool(np.allclose(active, expected, atol=1.5 * one_unit)),
        "each entry equals the statistic recomputed in plain JAX from that step's parameters",
        f"largest difference {np.max(np.abs(active - expected)) if active.shape == expected.shape else '-'}",
    )
    _same_losses(report, "reap", losses, setup.plain_losses)


def _checks(setup: _Setup, report: Report) -> None:
    options = setup.options
    report.heading("kups.checks: runtime checks inside jit, scan and shard_map")
    report.para(
        "local_loss checks that every input is in range; train checks the learning rate. "
        "checked(train) returns the first failure, with its step (the scan iteration) and shard."
    )
    run = jax.jit(checked(setup.train))
    bad = setup.xs.copy()
    bad[options.bad_step, options.bad_shard * SAMPLES_PER_SHARD + 7, 1] = 1000.0
    (_, losses), clean_error = run(setup.params, setup.xs, setup.ys, LEARNING_RATE)
    _, bad_error = run(setup.params, bad, setup.ys, LEARNING_RATE)
    _, lr_error = run(setup.params, setup.xs, setup.ys, -LEARNING_RATE)
    report.text()
    report.text(f"  clean data:               {clean_error!r}")
    report.text(
        f"  a reading of 1000.0 in step {options.bad_step}'s batch on shard {options.bad_shard}:"
    )
    report.text(f"    error.get() = {bad_error.get()!r}")
    report.text(f"  learning rate {-LEARNING_RATE}:")
    report.text(f"    error.get() = {lr_error.get()!r}")
    report.text()

    file = os.path.basename(__file__)
    range_line = _line_of('"input out of range')
    expected_bad = (
        f"input out of range: max |x| = 1000.0 at iteration {options.bad_step} "
        f"on shard {AXIS}={options.bad_shard} ({file}:{range_line})"
    )
    expected_lr = (
        f"learning rate must be positive, got {-LEARNING_RATE} "
        f"({file}:{_line_of('learning rate must be positive')})"
    )
    report.verify(clean_error.get() is None, "no check fails on clean data", repr(clean_error))
    report.verify(
        bad_error.get() == expected_bad,
        "the range check names the step, the shard and its line",
        f"expected {expected_bad!r}",
    )
    report.verify(
        lr_error.get() == expected_lr, "the learning-rate check fires", f"expected {expected_lr!r}"
    )
    _same_losses(report, "checked", losses, setup.plain_losses)


def _nans(setup: _Setup, report: Report) -> None:
    options = setup.options
    report.heading("kups.debug.find_nans: where the first NaN came from")
    report.para(
        "An all-zero sample (say, padding) normalises to 0/0. find_nans(train) checks the "
        "output of every equation and reports the first NaN or Inf: primitive, line, step, shard."
    )
    run = jax.jit(find_nans(setup.train))
    zero = setup.xs.copy()
    zero[options.nan_step, options.nan_shard * SAMPLES_PER_SHARD + 11] = 0.0
    (_, losses), clean = run(setup.params, setup.xs, setup.ys, LEARNING_RATE)
    (_, zero_losses), found = run(setup.params, zero, setup.ys, LEARNING_RATE)
    report.text()
    report.text(f"  clean data:   {clean!r}")
    report.text(
        f"  an all-zero sample in step {options.nan_step}'s batch on shard {options.nan_shard}:"
    )
    report.text(f"    {found!r}")
    if found.found and found.path is not None and found.source is not None:
        number = int(found.source.rsplit(":", 1)[1])
        code = linecache.getline(found.path, number).strip()
        report.text(report.dim(f"    {found.source}:  {code}"))
    report.text(
        f"  losses with that sample: {np.array2string(np.asarray(zero_losses), precision=3)}"
    )
    report.text()

    expected_source = f"{os.path.basename(__file__)}:{_line_of('x = x / jnp.sqrt(')}"
    expected = {
        "found": True,
        "kind": "nan",
        "primitive": "div",
        "iteration": (options.nan_step,),
        "shard": {AXIS: options.nan_shard},
    }
    got = {key: getattr(found, key) for key in expected} if found.found else {"found": False}
    report.verify(not clean.found, "no NaN on clean data", repr(clean))
    report.verify(
        got == expected,
        "the NaN is a division, at that step and shard",
        f"expected {expected}, got {got}",
    )
    report.verify(
        found.source == expected_source,
        f"the NaN comes from the normalisation, {expected_source}",
        f"got {found.source}",
    )
    _same_losses(report, "find_nans", losses, setup.plain_losses)


_SECTIONS: dict[str, Callable[[_Setup, Report], None]] = {
    "counts": _counts,
    "reap": _reap,
    "checks": _checks,
    "nans": _nans,
}


def run(options: Options) -> int:
    """Runs the demo's sections; returns 0 when every verification passed, else 1."""
    start = time.perf_counter()
    report = Report(options.color)
    devices = jax.devices()[: options.devices]
    mesh = jax.make_mesh((options.devices,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)
    train = make_train(mesh)
    params = init_params()
    xs, ys = make_data(options.steps, options.devices)

    report.text(
        report.style(f"kups {kups.__version__}", "1")
        + f"  (jax {jax.__version__}, {len(devices)} {devices[0].platform.upper()} devices)"
    )
    report.text()
    report.para(
        f"The program: {options.steps} SGD steps on a {FEATURES}-{HIDDEN}-1 MLP, in a lax.scan "
        f"under jax.jit. Each step runs the forward and backward pass in jax.shard_map over "
        f"the {options.devices} devices ({SAMPLES_PER_SHARD} samples per shard) and averages "
        f"loss and gradients with a pmean. Plain JAX, without kups:"
    )
    _, plain_losses = jax.jit(train)(params, xs, ys, LEARNING_RATE)
    plain_losses = np.asarray(plain_losses)
    report.text(f"  losses: {np.array2string(plain_losses, precision=3)}")
    setup = _Setup(options, mesh, train, params, xs, ys, plain_losses)

    for name in options.sections:
        section_start = time.perf_counter()
        _SECTIONS[name](setup, report)
        report.text(report.dim(f"  ({time.perf_counter() - section_start:.1f} s)"))

    elapsed = time.perf_counter() - start
    report.text()
    if report.failed:
        report.text(
            report.style(
                f"{len(report.failed)} of {report.passed + len(report.failed)} verifications "
                f"FAILED ({elapsed:.1f} s):",
                "31;1",
            )
        )
        for claim in report.failed:
            report.text(f"  - {claim}")
        return 1
    report.text(
        report.style(f"All {report.passed} verifications passed", "32;1") + f" ({elapsed:.1f} s)."
    )
    return 0
