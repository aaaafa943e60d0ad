"""The four effects on programs whose mesh has Explicit axes (sharding in types).

`jax.make_mesh` makes Explicit axes by default: avals carry shardings, `reshard`
moves values between them, `auto_axes` regions run with the axes Auto again,
and `shard_map` checks its `in_specs` against each argument's sharding. Every
effect must work there as on an Auto mesh: `sow`, `check` and a NaN inside a
`shard_map` body and inside an `auto_axes` region, eagerly and under `jax.jit`,
with and without `jax.set_mesh(mesh)` around the call. The oracle is plain JAX
(the same values computed without kups, and counts from an independent walk of
the program's jaxpr). What an effect returns from a jitted function (the context
it created inside the program) must be usable again next to sharded arrays.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxprs_in_params
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kups.checks import check, checked
from kups.debug import find_nans
from kups.effects import Interpreter, default_dispatcher, reinterpret
from kups.harvest import plant, reap, sow
from kups.instrument import count_primitives

MESH = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
_SOURCE = Path(__file__).read_text().splitlines()


def at(marker: str) -> str:
    """`test_explicit_sharding.py:LINE` of the only line ending with `# <marker>`."""
    lines = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, marker
    return f"{Path(__file__).name}:{lines[0]}"


def on(*spec: Any) -> NamedSharding:
    return NamedSharding(MESH, P(*spec))


def placed(values: Any, *spec: Any) -> jax.Array:
    return jax.device_put(jnp.asarray(values, jnp.float32), on(*spec))


# ---------------------------------------------------------------------------
# The programs: a shard_map body and an auto_axes region, each with a sow, a
# check and a log (a NaN where its input is negative).
# ---------------------------------------------------------------------------


def shard_body(block):
    value = sow(jnp.sin(block), tag="t", name="in_shard")
    check(jnp.all(value < 0.9), "too big: {}", jnp.max(value))  # shard check
    logged = jnp.log(value + 0.5)  # shard log
    return logged + lax.psum(jnp.sum(value), ("x", "y")) * 0.01


def shard_program(x):
    return jax.shard_map(shard_body, mesh=MESH, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)


def shard_x_body(block):
    value = sow(jnp.sin(block), tag="t", name="in_shard")
    check(jnp.all(value < 0.9), "too big: {}", jnp.max(value))  # shard_x check
    logged = jnp.log(value + 0.5)  # shard_x log
    return logged + lax.psum(jnp.sum(value), "x") * 0.01


def shard_x_program(x):
    # Manual over x only: y stays an Explicit axis inside the body.
    mapped = jax.shard_map(
        shard_x_body, mesh=MESH, in_specs=P("x"), out_specs=P("x"), axis_names={"x"}
    )
    return mapped(x)


def auto_region(u, w):
    product = sow(jnp.tanh(u @ w.T), tag="t", name="in_auto")
    check(jnp.all(product < 0.9), "too big: {}", jnp.max(product))  # auto check
    return jnp.log(product + 0.5)  # auto log


def auto_program(x, w):
    # x: P("x", "y"), w: P(None, "y"): both contract over "y", which has no
    # sharding type, so the product runs in an auto_axes region.
    return jax.sharding.auto_axes(auto_region, out_sharding=on("x", None))(x, w) + 1.0


def shard_args(scale: float) -> tuple[jax.Array]:
    values = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4) * scale
    return (placed(values, "x", "y"),)


def shard_x_args(scale: float) -> tuple[jax.Array]:
    values = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4) * scale
    return (placed(values, "x", None),)


def auto_args(scale: float) -> tuple[jax.Array, jax.Array]:
    values = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4) * scale
    w = np.full((4, 4), 0.25, np.float32)
    return placed(values, "x", "y"), placed(w, None, "y")


PROGRAMS: dict[str, tuple[Callable[..., Any], Callable[[float], tuple[jax.Array, ...]]]] = {
    "shard_map": (shard_program, shard_args),
    "shard_map_x": (shard_x_program, shard_x_args),
    "auto_axes": (auto_program, auto_args),
}
# How the program is called: eagerly or jitted, with or without a context mesh.
CALLS = ["eager", "jit", "eager-set_mesh", "jit-set_mesh"]


def call(fn: Callable[..., Any], how: str, *args: Any) -> Any:
    context = jax.set_mesh(MESH) if how.endswith("set_mesh") else contextlib.nullcontext()
    with context:
        return (jax.jit(fn) if how.startswith("jit") else fn)(*args)


def plain_region_value(x: jax.Array, w: jax.Array) -> np.ndarray:
    return np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T)


def plain_shard_values(x: jax.Array, where: str = "shard_map") -> np.ndarray:
    """`sin` of each shard's block, stacked in mesh order (x major): over x and y,
    or over x only (`shard_map_x`)."""
    values = np.sin(np.asarray(x, np.float64))
    if where == "shard_map_x":
        return np.stack([values[2 * i : 2 * i + 2] for i in range(4)])
    return np.stack(
        [values[2 * i : 2 * i + 2, 2 * j : 2 * j + 2] for i in range(4) for j in range(2)]
    )


def shard_coordinates(where: str, index: int) -> dict[str, int]:
    """The mesh coordinates of the shard at `index` in mesh order."""
    return {"x": index} if where == "shard_map_x" else {"x": index // 2, "y": index % 2}


def assert_reusable(tree: Any, x: jax.Array) -> None:
    """The arrays an effect returned from a jitted program can be placed on the
    mesh and used next to sharded arrays again, eagerly and under jit."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    assert leaves
    for leaf in leaves:
        replicated = jax.device_put(leaf, on())
        assert replicated.sharding.is_equivalent_to(on(), leaf.ndim)
    again = jax.jit(lambda t, a: (jax.tree.map(lambda v: v + 0, t), a * 2.0))(leaves, x)
    for got, want in zip(again[0], leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---------------------------------------------------------------------------
# Where kups fails today: strict xfails, each with its reproducer in the
# explicit-sharding failure notes; remove the entry when it is fixed.
# ---------------------------------------------------------------------------

# Where kups fails today, as strict xfails keyed by (effect, program, call); none
# left on the supported releases.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


def params(effect: str, programs: Any = PROGRAMS) -> list[Any]:
    out = []
    for where in programs:
        for how in CALLS:
            reason = KNOWN_FAILURES.get((effect, where, how))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(where, how, marks=marks, id=f"{where}-{how}"))
    return out


# ---------------------------------------------------------------------------
# harvest
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "how"), params("reap"))
def test_reap(where, how):
    fn, make_args = PROGRAMS[where]
    args = make_args(0.5)
    expected = call(fn, "jit", *args)
    out, reaped = call(reap(fn, tag="t"), how, *args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
    assert out.sharding.is_equivalent_to(expected.sharding, out.ndim)
    if where.startswith("shard_map"):
        # One entry per shard, in mesh order.
        assert set(reaped) == {"in_shard"}
        want = plain_shard_values(*args, where)
        np.testing.assert_allclose(reaped["in_shard"], want, rtol=1e-6)
    else:
        assert set(reaped) == {"in_auto"}
        np.testing.assert_allclose(reaped["in_auto"], plain_region_value(*args), rtol=1e-6)
    if how.startswith("jit"):
        assert_reusable(reaped, args[0])


@pytest.mark.parametrize(("where", "how"), params("plant"))
def test_plant(where, how):
    fn, make_args = PROGRAMS[where]
    args = make_args(0.5)
    if where.startswith("shard_map"):
        # Every shard's value replaced by 0.25: log(0.75) everywhere, plus the psum
        # of the 32 planted values.
        shape = plain_shard_values(*args, where).shape
        planted = {"in_shard": jnp.full(shape, 0.25, jnp.float32)}
        want = np.log(np.float32(0.75)) + 32 * 0.25 * 0.01
    else:
        planted = {"in_auto": jnp.full((8, 4), 0.25, jnp.float32)}
        want = np.log(np.float32(0.75)) + 1.0
        if how == "jit":
            # Planted, the region no longer reads x or w: its only input is the
            # (unplaced) planted value, and plain JAX then needs the mesh from
            # the context to place the output (`jax.set_mesh`).
            how = "jit-set_mesh"
    out = call(plant(fn, tag="t"), how, planted, *args)
    np.testing.assert_allclose(np.asarray(out), np.full(out.shape, want), rtol=1e-6)
    assert out.sharding.is_equivalent_to(call(fn, "jit", *args).sharding, out.ndim)


def test_plant_a_value_placed_on_the_mesh_into_auto_axes():
    args = auto_args(0.5)
    planted = {"in_auto": jax.device_put(jnp.full((8, 4), 0.25, jnp.float32), on("x", None))}
    out = jax.jit(plant(auto_program, tag="t"))(planted, *args)
    np.testing.assert_allclose(np.asarray(out), np.log(np.float32(0.75)) + 1.0, rtol=1e-6)


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_value_reaped_in_auto_axes_meets_the_programs_arrays(how):
    args = auto_args(0.5)
    _, reaped = call(reap(auto_program, tag="t"), how, *args)
    total = reaped["in_auto"] + args[0]
    np.testing.assert_allclose(total, plain_region_value(*args) + np.asarray(args[0]), rtol=1e-6)


def test_value_reaped_in_auto_axes_meets_arrays_after_a_staged_run():
    # After the region, enough equations for the interpreter to stage them as one
    # call: the reaped value is still typed for the program's mesh.
    def program(x, w):
        y = auto_program(x, w)
        for _ in range(20):
            y = jnp.sin(y) * 0.5
        return y

    args = auto_args(0.5)
    staged = jax.make_jaxpr(reap(program, tag="t"))(*args)
    assert any(e.params.get("name") == "kups_untouched" for e in staged.eqns)
    _, reaped = jax.jit(reap(program, tag="t"))(*args)
    total = reaped["in_auto"] + args[0]
    np.testing.assert_allclose(total, plain_region_value(*args) + np.asarray(args[0]), rtol=1e-6)


# ---------------------------------------------------------------------------
# instrument: count_primitives against an independent walk of the jaxpr
# ---------------------------------------------------------------------------


def _body_of(sub: Any) -> Any:
    return sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def walked_counts(jaxpr: Any, times: int = 1, counts: collections.Counter | None = None) -> Any:
    """How many times each primitive of `jaxpr` runs, for programs whose only loops
    are `scan`s and whose `shard_map`s are manual over the whole mesh (one run of
    the body per device). Control-flow primitives themselves are not counted."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            walked_counts(_body_of(eqn.params["jaxpr"]), times * eqn.params["length"], counts)
        elif name == "shard_map":
            walked_counts(_body_of(eqn.params["jaxpr"]), times * eqn.params["mesh"].size, counts)
        elif name in ("jit", "pjit", "closed_call"):
            for sub in jaxprs_in_params(eqn.params):
                walked_counts(_body_of(sub), times, counts)
        else:
            assert name not in ("while", "cond"), "walked_counts handles scan only"
            counts[name] += times
    return counts


def scan_program(x, w):
    # A scan of length 3 around a shard_map and an auto_axes region.
    def step(carry, _):
        carry = jax.sharding.reshard(shard_program(carry), on("x", "y"))
        mixed = auto_program(carry, w)
        return carry * 0.5, jnp.sum(mixed)

    return lax.scan(step, x, None, length=3)


COUNTED = {
    "shard_map": (shard_program, lambda: shard_args(0.5), {"sin": 8, "log": 8}),
    "auto_axes": (auto_program, lambda: auto_args(0.5), {"dot_general": 1, "tanh": 1}),
    "scan": (scan_program, lambda: auto_args(0.5), {"sin": 3 * 8, "dot_general": 3}),
}


@pytest.mark.parametrize(("where", "how"), params("count_primitives", COUNTED))
def test_count_primitives(where, how):
    fn, make_args, some = COUNTED[where]
    args = make_args()
    with jax.set_mesh(MESH) if how.endswith("set_mesh") else contextlib.nullcontext():
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    want = walked_counts(jaxpr)
    # The walk is independent of kups; make sure it sees what the test is about.
    assert {name: want[name] for name in some} == some, want
    out, counts = call(count_primitives(fn), how, *args)
    assert {name: int(count) for name, count in counts.items()} == dict(want)
    expected = call(fn, "jit", *args)
    for got_leaf, want_leaf in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=1e-6)
    if how.startswith("jit"):
        assert_reusable(counts, args[0])


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "how"), params("checks"))
def test_check_fails_and_passes(where, how):
    fn, make_args = PROGRAMS[where]
    # Passing: every value below 0.9.
    args = make_args(0.25)
    out, error = call(checked(fn), how, *args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(call(fn, "jit", *args)), rtol=1e-6)
    assert error.get() is None
    # Failing.
    args = make_args(2.0)
    out, error = call(checked(fn), how, *args)
    if where.startswith("shard_map"):
        # sin of each block; the first shard in mesh order holding a value >= 0.9
        # is the first failure.
        blocks = plain_shard_values(*args, where)
        first = next(i for i in range(len(blocks)) if np.max(blocks[i]) >= 0.9)
        assert error.shard == shard_coordinates(where, first)
        biggest = np.max(blocks[first])
        assert error.source == at("shard_x check" if where == "shard_map_x" else "shard check")
    else:
        assert error.shard is None
        biggest = np.max(plain_region_value(*args))
        assert error.source == at("auto check")
    assert error.message.startswith("too big: ")
    np.testing.assert_allclose(float(error.message.split(": ")[1]), biggest, rtol=1e-6)
    with pytest.raises(Exception, match="too big"):
        error.throw()
    if how.startswith("jit"):
        assert_reusable(error, args[0])


@pytest.mark.parametrize("how", CALLS)
def test_automatic_checks_locate_the_failing_element_of_sharded_arrays(how):
    """A division, an integer division and a gather on arrays sharded over
    Explicit axes (an optimizer step on sharded parameters, say): the checks find
    the first failing element without flattening the sharded flags."""
    from kups.checks import div_checks, index_checks

    errors = div_checks | index_checks

    def fn(a, b, i, table):
        quotient = a / b  # sharded div
        steps = jnp.floor_divide(i, 2)
        row = table.at[i].get(out_sharding=on("x"))  # sharded gather
        return quotient, steps, row

    a = placed(np.ones((4, 8)), None, "y")
    b = placed(np.full((4, 8), 2.0), None, "y")
    i = jax.device_put(jnp.arange(8, dtype=jnp.int32), on("x"))
    table = placed(np.arange(8.0), None)
    out, error = call(checked(fn, errors=errors), how, a, b, i, table)
    for got, want in zip(out, call(fn, "jit", a, b, i, table), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert error.get() is None
    # A zero divisor at [2, 5] and at [3, 1]: the first in row-major order.
    divisor = np.full((4, 8), 2.0)
    divisor[2, 5] = divisor[3, 1] = 0.0
    b = placed(divisor, None, "y")
    _, error = call(checked(fn, errors=errors), how, a, b, i, table)
    assert error.message == "division by zero in 'div' (divisor element [2 5])"
    assert error.source == at("sharded div")
    # Index 9 at position 6 of the sharded indices (8 is past the table too).
    i = jax.device_put(jnp.array([0, 1, 2, 3, 4, 5, 9, 8], jnp.int32), on("x"))
    ones = placed(np.ones((4, 8)), None, "y")
    _, error = call(checked(fn, errors=errors), how, a, ones, i, table)
    assert error.message.startswith("out-of-bounds index 9 on axis 0")
    assert error.source == at("sharded gather")


def test_the_failing_element_keeps_its_bits_and_an_empty_batch_fails_nothing():
    from kups.checks import div_checks

    def f(v):
        check(v > 0, "not positive {v}", v=v)
        return v

    _, error = checked(jax.vmap(jax.vmap(f)))(jnp.array([[1.0, 2.0], [3.0, -0.0]]))
    assert error.get().startswith("not positive -0.0 at vmap index (1, 1) (")
    assert checked(jax.vmap(f))(jnp.zeros((0,)))[1].get() is None
    empty = jnp.zeros((0,), jnp.int32)
    assert checked(jnp.floor_divide, errors=div_checks)(empty, empty)[1].get() is None


def test_a_vmapped_check_on_sharded_values_names_the_first_failing_element():
    def f(v):
        check(v > 0, "negative {v}", v=v)
        return v * 2.0

    values = np.ones((4, 8))
    values[1, 6], values[2, 0] = -1.0, -2.0
    x = placed(values, None, "y")
    for fn in (checked(jax.vmap(jax.vmap(f))), jax.jit(checked(jax.vmap(jax.vmap(f))))):
        out, error = fn(x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2.0)
        assert error.get().startswith("negative -1.0 at vmap index (1, 6) (")


# ---------------------------------------------------------------------------
# debug: find_nans
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "how"), params("find_nans"))
def test_find_nans(where, how):
    fn, make_args = PROGRAMS[where]
    # No NaN: every input to the log is above -0.5.
    args = make_args(0.25)
    out, report = call(find_nans(fn), how, *args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(call(fn, "jit", *args)), rtol=1e-6)
    assert not bool(report.found)
    # A NaN from the log: sin / tanh of the most negative inputs is below -0.5.
    args = make_args(2.0)
    out, report = call(find_nans(fn), how, *args)
    assert np.isnan(np.asarray(out)).any()
    assert bool(report.found)
    assert report.primitive == "log"
    marker = {"shard_map": "shard log", "shard_map_x": "shard_x log", "auto_axes": "auto log"}
    assert report.source == at(marker[where])
    if how.startswith("jit"):
        assert_reusable(report, args[0])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_find_nans_reaching_through_an_op_after_shard_map(axis_type):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)

    def fn(a):
        mapped = jax.shard_map(
            lambda b: jnp.log(b + 1.0),  # reaching log
            mesh=mesh,
            in_specs=P("x", "y"),
            out_specs=P("x", "y"),
        )
        return mapped(a) * 2.0

    x = jax.device_put(jnp.linspace(-2.0, 2.0, 32).reshape(8, 4), NamedSharding(mesh, P("x", "y")))
    out, report = jax.jit(find_nans(fn))(x)
    assert np.isnan(np.asarray(out)).any()
    assert jax.jit(find_nans(fn, report="first"))(x)[1].found
    assert (report.found, report.primitive, report.source) == (True, "log", at("reaching log"))


# ---------------------------------------------------------------------------
# The identity: a context that went through a jitted program on the mesh
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", list(PROGRAMS))
def test_identity_context_from_jit_goes_in_again(where):
    fn, make_args = PROGRAMS[where]
    args = make_args(0.25)
    wrapped = jax.jit(reinterpret(fn, Interpreter(default_dispatcher())))
    ctx = {"a": jnp.arange(3.0), "n": jnp.int32(7)}
    out, ctx_out = wrapped(ctx, *args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(*args)))
    # The context comes back on the program's mesh; it goes into the same program
    # again, and onto the mesh explicitly.
    again, ctx_again = wrapped(ctx_out, *args)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    for leaf, original in zip(jax.tree.leaves(ctx_again), jax.tree.leaves(ctx), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original))
    assert_reusable(ctx_again, args[0])
