"""kups on real programs of the JAX ecosystem (the `ecosystem` extra).

Each library's program is small (a few steps, a few numbers) and run through
kups four ways, with plain JAX as the oracle:

- the identity interpretation, `reinterpret(f, Interpreter(default_dispatcher()))`,
  returns `f`'s outputs bit for bit, eagerly and under `jax.jit`, and the context
  unchanged;
- gradients through the interpretation equal plain JAX's gradients bit for bit;
- one `count_primitives` figure equals a count made without kups: the library's
  own step statistics times what one step runs, or the primitive counted in
  `jax.make_jaxpr` times the loops' trip counts;
- an effect used inside the library's code: a `sow` reaped, a `check` failing,
  a NaN found.

`count_primitives` walks every equation (it has a fallback handler), so its
outputs are also compared with plain JAX: that is the identity of a walking
interpreter, where the `default_dispatcher()` identity may re-bind untouched
control flow whole.

Each library is imported with `pytest.importorskip`, so the suite runs without
the extra. Where kups fails on a program, the test is an `xfail(strict=True)`
naming the kups limitation, so it flips when that is fixed (none is left).

lineax's `linear_solve` (which optimistix's Newton and Levenberg-Marquardt and
diffrax's implicit solvers run) is an equinox filter primitive that kups goes
inside: its counts, sows and NaNs are seen there, and derivatives through an
effect are plain JAX's (`assert_derivatives_through`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params

from kups.checks import check, checked
from kups.debug import find_nans, nan_sites
from kups.effects import Interpreter, InterpreterPolicy, default_dispatcher, reinterpret
from kups.harvest import plant, reap, sow
from kups.instrument import count_primitives

pytestmark = pytest.mark.ecosystem

IDENTITY = Interpreter(default_dispatcher())
# A context the identity must hand back unchanged.
CTX = {"step": jnp.int32(3), "scale": jnp.float32(0.5)}


def library(module: str, distribution: str) -> ModuleType:
    """Imports a library of the extra, or skips saying why: not installed (no
    extra), or installed but failing to import on the running JAX release."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.importorskip(
            module, reason=f"{distribution} is not installed: pip install -e '.[ecosystem]'"
        )
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "unsupported here"
        version = importlib.metadata.version(distribution)
        pytest.skip(
            f"{distribution} {version} does not support JAX {jax.__version__}: "
            f"{type(exc).__name__}: {exc}"
        )


# ---------------------------------------------------------------------------
# Oracles.
# ---------------------------------------------------------------------------


def assert_trees_equal(actual: Any, expected: Any, what: str) -> None:
    """Same tree structure, and every leaf equal bit for bit (NaNs where the
    expected value has NaNs), with the same dtype."""
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree, f"{what}: {actual_tree} != {expected_tree}"
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        if isinstance(e, jax.Array) and jnp.issubdtype(e.dtype, jax.dtypes.prng_key):
            assert isinstance(a, jax.Array) and a.dtype == e.dtype, f"{what} leaf {i}: {a}"
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype, f"{what} leaf {i}: dtype {a.dtype} != {e.dtype}"
        equal_nan = bool(jnp.issubdtype(e.dtype, jnp.inexact))
        assert np.array_equal(a, e, equal_nan=equal_nan), f"{what} leaf {i}: {a} != {e}"


def identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` interpreted by the identity, with the context threaded through."""
    return reinterpret(fn, IDENTITY)


def assert_identity(fn: Callable[..., Any], *args: Any, eager_expected: Any = None) -> Any:
    """The identity interpretation of `fn` returns `fn(*args)` and the context,
    eagerly and under `jit` (compared with `jax.jit(fn)`). Returns `fn(*args)`."""
    expected = fn(*args)
    out, ctx = identity(fn)(CTX, *args)
    assert_trees_equal(out, expected if eager_expected is None else eager_expected, "eager")
    assert_trees_equal(ctx, CTX, "eager context")
    out, ctx = jax.jit(identity(fn))(CTX, *args)
    assert_trees_equal(out, jax.jit(fn)(*args), "jit")
    assert_trees_equal(ctx, CTX, "jit context")
    return expected


def assert_grad_identity(
    loss: Callable[..., Any], *args: Any, argnums: int | tuple[int, ...], eager: bool = True
) -> Any:
    """`jax.grad` through the identity interpretation equals plain `jax.grad`
    under `jit` and (with `eager=True`) eagerly. Returns the plain jitted gradient.

    Eager gradients of long loops run op by op, slowly: programs with many steps
    compare under `jit` only."""

    def interpreted_loss(*a: Any) -> Any:
        out, _ = identity(loss)(CTX, *a)
        return out

    if eager:
        assert_trees_equal(
            jax.grad(interpreted_loss, argnums=argnums)(*args),
            jax.grad(loss, argnums=argnums)(*args),
            "grad",
        )
    expected = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    assert_trees_equal(
        jax.jit(jax.grad(interpreted_loss, argnums=argnums))(*args), expected, "jit(grad)"
    )
    return expected


def count_and_compare(fn: Callable[..., Any], *args: Any, **options: Any) -> Any:
    """`count_primitives(fn)(*args)`, checking that its outputs are `fn`'s compiled
    (an effect called eagerly is compiled as a whole; counting adds no reads)."""
    out, counts = count_primitives(fn, **options)(*args)
    assert_trees_equal(out, eqx.filter_jit(fn)(*args), "count_primitives outputs")
    return counts


def assert_derivatives_through(
    effect: Callable[..., Any],
    fn: Callable[..., Any],
    *args: Any,
    argnums: int,
    exact: bool = True,
    modes: tuple[str, ...] = ("jvp", "grad"),
) -> None:
    """Forward (`jax.jvp`) and reverse (`jax.grad`) derivatives (those of `modes`)
    of `fn`'s first output through `effect(fn)` (whose first output is `fn`'s
    outputs) equal plain JAX's under `jit`: bit for bit, or (`exact=False`) to
    float32 rounding."""

    def first(f: Callable[..., Any]) -> Callable[..., Any]:
        return lambda x: jax.tree.leaves(f(*args[:argnums], x, *args[argnums + 1 :])[0])[0]

    interpreted = first(lambda *a: effect(fn)(*a)[0])
    plain = first(fn)
    x = args[argnums]
    tangent = jnp.linspace(0.5, 1.5, x.size, dtype=x.dtype).reshape(x.shape)
    derivatives = {
        "jvp": lambda f: jax.jit(lambda x: jax.jvp(f, (x,), (tangent,)))(x),
        "grad": lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(x),
    }
    results = [[derivatives[mode](f) for mode in modes] for f in (interpreted, plain)]
    if exact:
        assert_trees_equal(results[0], results[1], "jvp and grad")
    else:
        for actual, expected in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def static_count(jaxpr: Jaxpr | ClosedJaxpr, name: str) -> int:
    """How many times `name` runs in `jaxpr`, read off the program without kups:
    a `scan` body counts `length` times, anything else holding sub-programs
    (`jit`, `custom_jvp_call`, `remat`, ...) once. A `cond` whose branches run
    `name` a different number of times, or a `while` that runs it, has no static
    count: an error."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    total = 0
    for eqn in jaxpr.eqns:
        primitive = eqn.primitive.name
        if primitive == name:
            total += 1
        if primitive == "scan":
            total += eqn.params["length"] * static_count(eqn.params["jaxpr"], name)
        elif primitive == "cond":
            counts = {static_count(branch, name) for branch in eqn.params["branches"]}
            if len(counts) > 1:
                raise ValueError(f"the branches of a cond run {name!r} {sorted(counts)} times")
            total += counts.pop()
        elif primitive == "while":
            inside = static_count(eqn.params["body_jaxpr"], name)
            inside += static_count(eqn.params["cond_jaxpr"], name)
            if inside:
                raise ValueError(f"a while loop runs {name!r}: no static count")
        else:
            total += sum(static_count(sub, name) for sub in jaxprs_in_params(eqn.params))
    return total


# ---------------------------------------------------------------------------
# diffrax: an adaptive ODE solve and its gradient.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dfx() -> ModuleType:
    return library("diffrax", "diffrax")


def ode_solver(
    dfx: ModuleType, vector_field: Callable[..., Any], adjoint: Any = None
) -> Callable[..., Any]:
    """Tsit5 with a PID step-size controller from t=0 to t=2, the solution at
    t=2 and the solver's statistics; the default adjoint
    (RecursiveCheckpointAdjoint) unless `adjoint` is given."""

    def solve(y0: jax.Array, k: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        solution = dfx.diffeqsolve(
            dfx.ODETerm(vector_field),
            dfx.Tsit5(),
            t0=0.0,
            t1=2.0,
            dt0=0.1,
            y0=y0,
            args=k,
            stepsize_controller=dfx.PIDController(rtol=1e-5, atol=1e-5),
            saveat=dfx.SaveAt(t1=True),
            max_steps=64,
            adjoint=dfx.RecursiveCheckpointAdjoint() if adjoint is None else adjoint,
        )
        return solution.ys, solution.stats

    return solve


def decay(t: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
    return -k * y + jnp.sin(t)


ODE_ARGS = (jnp.array([1.0, 2.0]), jnp.float32(0.7))


def test_diffrax_identity(dfx: ModuleType) -> None:
    assert_identity(ode_solver(dfx, decay), *ODE_ARGS)


def test_diffrax_gradient(dfx: ModuleType) -> None:
    solve = ode_solver(dfx, decay)

    def loss(y0: jax.Array, k: jax.Array) -> jax.Array:
        ys, _ = solve(y0, k)
        return jnp.sum(ys**2)

    grads = assert_grad_identity(loss, *ODE_ARGS, argnums=(0, 1), eager=False)
    assert all(bool(jnp.all(g != 0)) for g in grads)


def test_diffrax_count(dfx: ModuleType) -> None:
    solve = ode_solver(dfx, decay)
    counts = count_and_compare(solve, *ODE_ARGS)
    _, stats = solve(*ODE_ARGS)
    steps = int(stats["num_steps"])  # accepted and rejected
    assert steps > 2
    # Tsit5 is first-same-as-last: the vector field (one `sin`) runs once at t0,
    # then six times a step, whether the step is accepted or rejected.
    assert counts["sin"] == 1 + 6 * steps
    assert counts.opaque == {}


def test_diffrax_check_in_vector_field(dfx: ModuleType) -> None:
    def guarded(limit: float) -> Callable[..., Any]:
        def vector_field(t: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
            check(y[0] < limit, "y[0]={} at t={}", y[0], t)
            return decay(t, y, k)

        return ode_solver(dfx, vector_field)

    ys, stats = ode_solver(dfx, decay)(*ODE_ARGS)
    assert float(ys[0, 0]) > 1.1  # so the vector field saw y[0] > 1.1 at some stage
    (out, _), error = checked(guarded(1.1))(*ODE_ARGS)
    assert_trees_equal(out, ys, "checked outputs")
    assert error.message is not None and error.message.startswith("y[0]=")
    assert float(error.message.split("=")[1].split()[0]) >= 1.1
    assert error.iteration is not None and 0 <= error.iteration[0] < int(stats["num_steps"])
    assert error.source is not None and error.source.startswith("test_ecosystem.py:")
    _, error = checked(guarded(100.0))(*ODE_ARGS)
    assert error.get() is None


def test_diffrax_sow_in_vector_field(dfx: ModuleType) -> None:
    def vector_field(t: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
        t = sow(t, tag="ode", name="t", mode="clobber", init=-1)
        return decay(t, y, k)

    (ys, _), reaped = reap(ode_solver(dfx, vector_field), tag="ode")(*ODE_ARGS)
    assert_trees_equal(ys, ode_solver(dfx, decay)(*ODE_ARGS)[0], "reaped outputs")
    # Tsit5's last stage of the last step is at the step's end: t1.
    assert_trees_equal(reaped, {"t": jnp.float32(2.0)}, "reaped")
    # DirectAdjoint runs equinox's bounded while loop, a scan of conds whose last
    # iterations do not step: the last sown value still wins, under jit too.
    direct = reap(ode_solver(dfx, vector_field, dfx.DirectAdjoint()), tag="ode")
    for fn in (direct, jax.jit(direct)):
        (ys, _), reaped = fn(*ODE_ARGS)
        assert_trees_equal(ys, ode_solver(dfx, decay, dfx.DirectAdjoint())(*ODE_ARGS)[0], "ys")
        assert_trees_equal(reaped, {"t": jnp.float32(2.0)}, "reaped with DirectAdjoint")

    # Under jax.grad, the default adjoint's backward pass runs the steps again, the
    # first last: the forward pass's value is still the one reaped.
    def loss(y0: jax.Array, k: jax.Array) -> jax.Array:
        return jnp.sum(ode_solver(dfx, vector_field)(y0, k)[0])

    grads, reaped = reap(jax.grad(loss, argnums=1), tag="ode")(*ODE_ARGS)
    assert_trees_equal(reaped, {"t": jnp.float32(2.0)}, "reaped under grad")
    np.testing.assert_allclose(grads, jax.grad(loss, argnums=1)(*ODE_ARGS), rtol=1e-6)


@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint"])
def test_diffrax_grad_of_plant_in_vector_field(dfx: ModuleType, adjoint: str) -> None:
    # The adjoints are custom_vjp rules that run the vector field again (the
    # default one's checkpointed loop, a custom_jvp rule too): the planted value
    # reaches those runs, and the gradient is that of the planted solve.
    def vector_field(rate: jax.Array | None) -> Callable[..., jax.Array]:
        def field(t: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
            sown = sow(k * jnp.cos(y), tag="ode", name="rate", mode="clobber", init=0.0)
            return -(sown if rate is None else rate) * y + jnp.sin(t)

        return field

    def loss(field: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        def summed(y0: jax.Array, k: jax.Array) -> jax.Array:
            return jnp.sum(ode_solver(dfx, field, getattr(dfx, adjoint)())(y0, k)[0])

        return summed

    rate = jnp.array([0.3, 1.1])
    planted = plant(loss(vector_field(None)), tag="ode")
    # k only makes the sown rate: its gradient is zero once the rate is planted.
    expected = jax.value_and_grad(loss(vector_field(rate)), argnums=(0, 1))(*ODE_ARGS)
    differentiated = jax.value_and_grad(functools.partial(planted, {"rate": rate}), argnums=(0, 1))
    for fn in (differentiated, jax.jit(differentiated)):
        value, (grad_y0, grad_k) = fn(*ODE_ARGS)
        np.testing.assert_allclose(value, expected[0], rtol=1e-6)
        np.testing.assert_allclose(grad_y0, expected[1][0], rtol=1e-5)
        assert grad_k == 0.0 and expected[1][1] == 0.0


def implicit_solver(
    dfx: ModuleType,
    vector_field: Callable[..., Any],
    adjoint: Any = None,
    *,
    constant_steps: bool = False,
) -> Callable[..., Any]:
    """`ode_solver` with Kvaerno5, an implicit solver: each step solves its stages
    with optimistix's Newton (chord) iterations, whose linear solves are
    lineax's. The default adjoint is reverse-mode only (a `custom_vjp`). With
    `constant_steps`, eight steps of 0.25 (so a NaN is not rejected: it reaches
    the solution)."""
    optx = library("optimistix", "optimistix")
    if constant_steps:
        root_finder = dfx.VeryChord(rtol=1e-5, atol=1e-5, norm=optx.max_norm)
        solver, controller, dt0 = (
            dfx.Kvaerno5(root_finder=root_finder),
            dfx.ConstantStepSize(),
            0.25,
        )
    else:
        solver, controller, dt0 = dfx.Kvaerno5(), dfx.PIDController(rtol=1e-5, atol=1e-5), 0.1

    def solve(y0: jax.Array, k: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        solution = dfx.diffeqsolve(
            dfx.ODETerm(vector_field),
            solver,
            t0=0.0,
            t1=2.0,
            dt0=dt0,
            y0=y0,
            args=k,
            stepsize_controller=controller,
            saveat=dfx.SaveAt(t1=True),
            max_steps=64,
            adjoint=dfx.RecursiveCheckpointAdjoint() if adjoint is None else adjoint,
            throw=False,  # a failed solve hands back an error code, not an exception
        )
        return solution.ys, solution.stats

    return solve


def test_diffrax_implicit_count(dfx: ModuleType) -> None:
    calls: list[np.ndarray] = []

    def vector_field(t: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
        jax.debug.callback(lambda t: calls.append(np.asarray(t)), t)
        return decay(t, y, k)

    solve = implicit_solver(dfx, vector_field)
    _, stats = solve(*ODE_ARGS)
    expected = len(calls)
    assert int(stats["num_steps"]) > 2 and expected > int(stats["num_steps"])
    calls.clear()
    counts = count_and_compare(solve, *ODE_ARGS)
    # Without kups: the host callback ran once each time the vector field did
    # (inside the Newton iterations and the Jacobians of the linear solves too),
    # and the vector field runs one `sin`.
    assert counts["debug_callback"] == expected
    assert counts["sin"] == expected
    # The LU factorisations of the stages' linear solves are counted.
    assert counts["lu"] >= int(stats["num_steps"])
    assert counts.opaque == {}
    reverse = implicit_solver(dfx, decay)
    assert_derivatives_through(count_primitives, reverse, *ODE_ARGS, argnums=1, modes=("grad",))
    forward = implicit_solver(dfx, decay, dfx.ForwardMode())
    assert_derivatives_through(count_primitives, forward, *ODE_ARGS, argnums=1, modes=("jvp",))


def test_diffrax_implicit_find_nans(dfx: ModuleType) -> None:
    def vector_field(t: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
        return -jnp.sqrt(k) * y + jnp.sin(t)

    solve = implicit_solver(dfx, vector_field, constant_steps=True)
    y0, k = ODE_ARGS
    negative = jnp.float32(-0.7)
    ys, _ = solve(y0, negative)
    assert not bool(jnp.any(jnp.isfinite(ys)))
    out, report = jax.jit(find_nans(solve))(y0, negative)
    assert_trees_equal(out, jax.jit(solve)(y0, negative), "find_nans outputs")
    # Made in the vector field, which the implicit stages (and the Jacobians of
    # their linear solves) run.
    assert report.found and report.kind == "nan" and report.primitive == "sqrt"
    assert report.source is not None and report.source.startswith("test_ecosystem.py:")
    out, report = jax.jit(find_nans(solve))(y0, k)
    assert_trees_equal(out, jax.jit(solve)(y0, k), "find_nans outputs")
    assert not report.found
    assert_derivatives_through(
        find_nans, implicit_solver(dfx, decay), *ODE_ARGS, argnums=1, modes=("grad",), exact=False
    )
    forward = implicit_solver(dfx, decay, dfx.ForwardMode())
    assert_derivatives_through(
        find_nans, forward, *ODE_ARGS, argnums=1, modes=("jvp",), exact=False
    )


def sqrt_decay(t: jax.Array, y: jax.Array, args: Any) -> jax.Array:
    return -y * jnp.sqrt(1.0 - 2.0 * t)  # NaN once t > 0.5


SQRT_DECAY_LINE = sqrt_decay.__code__.co_firstlineno + 1


@pytest.mark.parametrize("direct", [False, True], ids=["checkpointed", "direct"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_diffrax_euler_find_nans_names_the_vector_field(
    dfx: ModuleType, jit: bool, direct: bool
) -> None:
    # Constant steps of 0.1: step 6 (t = 0.6) makes the NaN that reaches the
    # output. The saved-output buffer starts as Inf and is carried through the
    # loop; the final write replaces all of it, so its Inf is not what reaches.
    # DirectAdjoint's loop is equinox's bounded while loop: nested scans whose
    # carries go through one another.
    adjoint = dfx.DirectAdjoint() if direct else dfx.RecursiveCheckpointAdjoint()

    def solve(y0: jax.Array) -> jax.Array:
        term = dfx.ODETerm(sqrt_decay)
        return dfx.diffeqsolve(
            term, dfx.Euler(), t0=0.0, t1=1.0, dt0=0.1, y0=y0, adjoint=adjoint
        ).ys

    y0 = jnp.ones(2)
    wrapped = jax.jit(find_nans(solve)) if jit else find_nans(solve)
    out, report = wrapped(y0)
    assert_trees_equal(out, jax.jit(solve)(y0), "find_nans outputs")
    assert bool(jnp.all(jnp.isnan(out)))
    assert (report.found, report.kind, report.primitive) == (True, "nan", "sqrt")
    assert report.source == f"test_ecosystem.py:{SQRT_DECAY_LINE}"
    assert report.iteration == ((0, 0, 6) if direct else (6,))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_diffrax_saved_rows_find_nans_names_each_rows_step(dfx: ModuleType, jit: bool) -> None:
    # Saved at 11 times, the rows after t = 0.5 are NaN. diffrax fills its
    # buffer with Inf and writes one row per save (equinox's maybe_set in a
    # checkpointed loop inside custom derivatives): each row keeps the origin
    # of its write, so the finite rows report nothing and the others name the
    # vector field at the step that made their NaN.
    def solve(y0: jax.Array) -> jax.Array:
        term = dfx.ODETerm(sqrt_decay)
        saveat = dfx.SaveAt(ts=jnp.linspace(0.0, 1.0, 11))
        return dfx.diffeqsolve(term, dfx.Euler(), t0=0.0, t1=1.0, dt0=0.1, y0=y0, saveat=saveat).ys

    y0 = jnp.ones(2)
    wrap = jax.jit if jit else (lambda f: f)
    ys, report = wrap(find_nans(solve))(y0)
    # The checks change XLA's fusions: equal to float32 rounding (sharp bits).
    np.testing.assert_allclose(ys, jax.jit(solve)(y0), rtol=1e-6)
    assert bool(jnp.all(jnp.isfinite(ys[:7]))) and bool(jnp.all(jnp.isnan(ys[7:])))
    for fn in (solve, lambda y0: solve(y0)[-1], lambda y0: solve(y0)[5:]):
        _, report = wrap(find_nans(fn))(y0)
        assert (report.found, report.kind, report.primitive) == (True, "nan", "sqrt")
        assert report.source == f"test_ecosystem.py:{SQRT_DECAY_LINE}"
        assert report.iteration == (6,)
    assert not wrap(find_nans(lambda y0: solve(y0)[:7]))(y0)[1].found


def test_diffrax_adaptive_find_nans_first_nan(dfx: ModuleType) -> None:
    # The controller rejects every step that makes a NaN, so none reaches the
    # output (the solve stops at max_steps with a finite value, throw=False):
    # "reaching" has nothing to report, and the first NaN made is the way in.
    def solve(y0: jax.Array) -> jax.Array:
        controller = dfx.PIDController(rtol=1e-3, atol=1e-6)
        term = dfx.ODETerm(sqrt_decay)
        return dfx.diffeqsolve(
            term,
            dfx.Tsit5(),
            t0=0.0,
            t1=1.0,
            dt0=0.1,
            y0=y0,
            stepsize_controller=controller,
            max_steps=64,
            throw=False,
        ).ys

    y0 = jnp.ones(2)
    # The checks change XLA's fusions: equal to float32 rounding (sharp bits).
    out, report = jax.jit(find_nans(solve))(y0)
    np.testing.assert_allclose(out, jax.jit(solve)(y0), rtol=1e-6)
    assert bool(jnp.all(jnp.isfinite(out))) and not report.found
    out, report = jax.jit(find_nans(solve, report="first", kinds=("nan",)))(y0)
    np.testing.assert_allclose(out, jax.jit(solve)(y0), rtol=1e-6)
    assert (report.found, report.kind, report.primitive) == (True, "nan", "sqrt")
    assert report.source == f"test_ecosystem.py:{SQRT_DECAY_LINE}"
    # The step loop's iteration, then the Runge-Kutta stage's.
    assert len(report.iteration) == 2 and report.iteration[0] > 0


# ---------------------------------------------------------------------------
# lineax: CG on a matrix-free operator.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lx() -> ModuleType:
    return library("lineax", "lineax")


SPD = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]])
CG_ARGS = (jnp.array([1.0, -2.0, 0.5]), jnp.float32(1.5))


def cg_solver(lx: ModuleType, matvec: Callable[..., Any]) -> Callable[..., Any]:
    """Solves `matvec(v, scale) = b` with CG on a `FunctionLinearOperator`:
    the solution and the solver's statistics."""

    def solve(b: jax.Array, scale: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        operator = lx.FunctionLinearOperator(
            lambda v: matvec(v, scale),
            jax.ShapeDtypeStruct((3,), jnp.float32),
            tags=lx.positive_semidefinite_tag,
        )
        solution = lx.linear_solve(operator, b, lx.CG(rtol=1e-6, atol=1e-6))
        return solution.value, solution.stats

    return solve


def spd_matvec(v: jax.Array, scale: jax.Array) -> jax.Array:
    return scale * (SPD @ v)


def test_lineax_identity(lx: ModuleType) -> None:
    value, _ = assert_identity(cg_solver(lx, spd_matvec), *CG_ARGS)
    np.testing.assert_allclose(spd_matvec(value, CG_ARGS[1]), CG_ARGS[0], rtol=1e-5, atol=1e-5)


def test_lineax_gradient(lx: ModuleType) -> None:
    solve = cg_solver(lx, spd_matvec)

    def loss(b: jax.Array, scale: jax.Array) -> jax.Array:
        value, _ = solve(b, scale)
        return jnp.sum(value**2)

    grads = assert_grad_identity(loss, *CG_ARGS, argnums=(0, 1))
    assert all(bool(jnp.all(g != 0)) for g in grads)


def counting_matvec(calls: list[np.ndarray]) -> Callable[..., Any]:
    """`spd_matvec` that records, through a host callback, each vector it is
    applied to when it runs: how many times (and on what) CG applied it."""

    def matvec(v: jax.Array, scale: jax.Array) -> jax.Array:
        jax.debug.callback(lambda x: calls.append(np.asarray(x)), v)
        return spd_matvec(v, scale)

    return matvec


def test_lineax_count(lx: ModuleType) -> None:
    calls: list[np.ndarray] = []
    solve = cg_solver(lx, counting_matvec(calls))
    _, stats = solve(*CG_ARGS)
    expected = len(calls)
    assert expected >= int(stats["num_steps"]) > 1
    calls.clear()
    counts = count_and_compare(solve, *CG_ARGS)
    # One host callback per application of the operator, as the callbacks counted,
    # and the operator's matrix product with it.
    assert counts["debug_callback"] == expected
    assert counts["dot_general"] >= expected
    assert counts.opaque == {}
    # Nothing is opaque, so the policy changes nothing.
    assert count_and_compare(solve, *CG_ARGS, policy=InterpreterPolicy.IGNORE) == counts
    assert_derivatives_through(count_primitives, cg_solver(lx, spd_matvec), *CG_ARGS, argnums=1)


def test_lineax_count_batched(lx: ModuleType) -> None:
    # Under jax.vmap lineax's solve becomes equinox's `vprim`, which kups enters too.
    b, scale = CG_ARGS
    solve = jax.vmap(cg_solver(lx, spd_matvec), (0, None))
    bs = jnp.stack([b, 2.0 * b, -b])
    closed = jax.make_jaxpr(solve)(bs, scale)
    assert static_count(closed, "vprim") == 1
    counts = count_and_compare(solve, bs, scale)
    assert counts["dot_general"] > 0 and counts.opaque == {}
    assert_derivatives_through(count_primitives, solve, bs, scale, argnums=1)


def test_lineax_sow_in_operator(lx: ModuleType) -> None:
    calls: list[np.ndarray] = []
    cg_solver(lx, counting_matvec(calls))(*CG_ARGS)
    last_vector = calls[-1]

    def matvec(v: jax.Array, scale: jax.Array) -> jax.Array:
        v = sow(v, tag="cg", name="v", mode="clobber", init=0)
        return spd_matvec(v, scale)

    (value, _), reaped = reap(cg_solver(lx, matvec), tag="cg")(*CG_ARGS)
    assert_trees_equal(value, cg_solver(lx, spd_matvec)(*CG_ARGS)[0], "reaped outputs")
    # The last vector CG applied the operator to, as the host callback saw it.
    assert_trees_equal(reaped, {"v": jnp.asarray(last_vector)}, "reaped")


def test_lineax_grad_of_plant_through_a_rule_that_solves(lx: ModuleType) -> None:
    # A custom_jvp whose rule runs a linear solve on the tangent (as optimistix's
    # implicit derivatives do), under jax.grad of plant.
    def solve(b: jax.Array, m: jax.Array) -> jax.Array:
        return lx.linear_solve(lx.MatrixLinearOperator(m), b, lx.LU()).value

    f = jax.custom_jvp(jnp.sin)
    f.defjvp(
        lambda p, t: (jnp.sin(p[0]), solve(jnp.array([t[0]]), jnp.array([[1 / jnp.cos(p[0])]]))[0])
    )
    x = jnp.float32(0.9)
    expected = jax.grad(f)(x)
    for grad in (jax.grad(lambda x: plant(f, tag="t")({}, x)),):
        for wrap in (lambda g: g, jax.jit):
            np.testing.assert_allclose(wrap(grad)(x), expected, rtol=1e-6)


@pytest.mark.parametrize("solver", ["LU", "CG"])
def test_lineax_plant_in_a_function_operator(lx: ModuleType, solver: str) -> None:
    # A sow in the matvec of a FunctionLinearOperator, planted: the value and the
    # forward-mode derivatives are those of the program with the value written
    # in (lineax's rule runs with the sows of its tangent solves planted).
    # Reverse mode, and a derivative with respect to the planted value, cannot
    # be given; they are refused, not silently lineax's derivative of the
    # unplanted operator.
    method = lx.LU() if solver == "LU" else lx.CG(rtol=1e-6, atol=1e-6)

    def program(planted: jax.Array | None) -> Callable[[jax.Array], jax.Array]:
        def f(p: jax.Array) -> jax.Array:
            def matvec(v: jax.Array) -> jax.Array:
                d = p * jnp.array([1.0, 2.0, 3.0])
                d = sow(d, tag="k", name="d", mode="clobber") if planted is None else planted
                return SPD @ v + d * v

            operator = lx.FunctionLinearOperator(
                matvec, jax.ShapeDtypeStruct((3,), jnp.float32), lx.positive_semidefinite_tag
            )
            return jnp.sum(lx.linear_solve(operator, jnp.array([1.0, p, 2.0]), method).value ** 2)

        return f

    k, p = jnp.array([0.5, 0.3, 0.2]), jnp.float32(0.9)
    oracle = program(k)

    def planted(p: jax.Array) -> jax.Array:
        return plant(program(None), tag="k")({"d": k}, p)

    def jvp(f: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
        return lambda p: jax.jvp(f, (p,), (jnp.float32(1.0),))[1]

    expected = jvp(oracle)(p)
    # Not the derivative of the unplanted operator at the planted value.
    assert abs(float(jvp(program(None))(p)) - float(expected)) > 1e-2
    np.testing.assert_allclose(planted(p), oracle(p), rtol=1e-5)
    for wrap in (lambda g: g, jax.jit):
        np.testing.assert_allclose(wrap(jvp(planted))(p), expected, rtol=1e-4)
    np.testing.assert_allclose(jax.jacfwd(planted)(p), expected, rtol=1e-4)
    with pytest.raises(NotImplementedError, match=r"Reverse-mode differentiation.*linear_solve"):
        jax.grad(planted)(p)
    with pytest.raises(ValueError, match="library primitive 'linear_solve'") as info:
        jax.grad(lambda k: plant(program(None), tag="k")({"d": k}, p))(k)
    # Placed at the user's call of lx.linear_solve (inside lineax's filter_jit,
    # the equation has lineax's and equinox's lines only).
    assert f"called from {__file__}:" in str(info.value)
    assert "program.<locals>.f)" in str(info.value)


def test_lineax_grad_with_respect_to_a_planted_value_the_solve_does_not_read(
    lx: ModuleType,
) -> None:
    def f(p: jax.Array) -> jax.Array:
        d = sow(p * 2.0, tag="k", name="d", mode="clobber")
        x = lx.linear_solve(lx.MatrixLinearOperator(SPD * p), jnp.array([1.0, 2.0, 3.0]), lx.LU())
        return jnp.sum(x.value) * d

    def oracle(k: jax.Array, p: jax.Array) -> jax.Array:
        return jnp.sum(jnp.linalg.solve(SPD * p, jnp.array([1.0, 2.0, 3.0]))) * k

    k, p = jnp.float32(3.0), jnp.float32(1.5)
    expected = jax.grad(oracle, argnums=(0, 1))(k, p)
    for wrap in (lambda g: g, jax.jit):
        grads = wrap(jax.grad(lambda k, p: plant(f, tag="k")({"d": k}, p), argnums=(0, 1)))(k, p)
        np.testing.assert_allclose(grads, expected, rtol=1e-5)
        only_k = wrap(jax.grad(lambda k: plant(f, tag="k")({"d": k}, p)))(k)
        np.testing.assert_allclose(only_k, expected[0], rtol=1e-5)


def test_lineax_sow_in_operator_vmapped(lx: ModuleType) -> None:
    # reap of a vmapped CG solve (equinox's vprim, which kups enters): CG applies
    # its operator to its zero initial guess before its loop, a sow JAX binds
    # unbatched, then in the batched loop. The right-hand sides are multiples of
    # one another, so every element's loop runs the same steps and reap(vmap)
    # equals vmap(reap) element by element.
    def matvec(v: jax.Array, scale: jax.Array) -> jax.Array:
        v = sow(v, tag="cg", name="v", mode="clobber", init=0)
        return spd_matvec(v, scale)

    b, scale = CG_ARGS
    bs = jnp.stack([b, 2.0 * b, -b])
    solve = jax.vmap(cg_solver(lx, matvec), (0, None))
    expected = jax.vmap(reap(cg_solver(lx, matvec), tag="cg"), (0, None))(bs, scale)
    assert expected[1]["v"].shape == (3, 3)
    for wrapped in (reap(solve, tag="cg"), jax.jit(reap(solve, tag="cg"))):
        assert_trees_equal(wrapped(bs, scale), expected, "reap(vmap)")
    assert_trees_equal(
        expected[0], jax.vmap(cg_solver(lx, spd_matvec), (0, None))(bs, scale), "out"
    )


def spd_operator(v: jax.Array) -> jax.Array:
    """A matrix-free operator at module level: a function with no closure, which
    equinox keeps as it is (no jaxpr) in the params of lineax's solve."""
    return SPD @ v


def sowing_spd_operator(v: jax.Array) -> jax.Array:
    return SPD @ sow(v, tag="cg", name="v", mode="clobber", init=0)


def module_level_solve(lx: ModuleType, operator_fn: Callable[..., Any]) -> Callable[..., Any]:
    def solve(b: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        operator = lx.FunctionLinearOperator(
            operator_fn, jax.ShapeDtypeStruct((3,), jnp.float32), tags=lx.positive_semidefinite_tag
        )
        solution = lx.linear_solve(operator, b, lx.CG(rtol=1e-6, atol=1e-6))
        return solution.value, solution.stats

    return solve


def test_lineax_sow_in_module_level_operator(lx: ModuleType) -> None:
    # The operator function stays a Python function in linear_solve's params (no
    # jaxpr): kups traces the solve's implementation, which calls it.
    b = CG_ARGS[0]
    expected, _ = module_level_solve(lx, spd_operator)(b)
    last: list[np.ndarray] = []

    def recording_operator(v: jax.Array) -> jax.Array:
        jax.debug.callback(lambda x: last.append(np.asarray(x)), v)
        return spd_operator(v)

    module_level_solve(lx, recording_operator)(b)
    for wrapped in (
        reap(module_level_solve(lx, sowing_spd_operator), tag="cg"),
        jax.jit(reap(module_level_solve(lx, sowing_spd_operator), tag="cg")),
    ):
        (value, _), reaped = wrapped(b)
        assert_trees_equal(value, expected, "reaped outputs")
        # The last vector CG applied the operator to, as the host callback saw it.
        assert_trees_equal(reaped, {"v": jnp.asarray(last[-1])}, "reaped")


def counting_spd_operator(v: jax.Array) -> jax.Array:
    jax.debug.callback(lambda x: OPERATOR_CALLS.append(np.asarray(x)), v)
    return SPD @ v


OPERATOR_CALLS: list[np.ndarray] = []


def test_lineax_count_module_level_operator(lx: ModuleType) -> None:
    solve = module_level_solve(lx, counting_spd_operator)
    b = CG_ARGS[0]
    OPERATOR_CALLS.clear()
    _, stats = solve(b)
    expected = len(OPERATOR_CALLS)
    assert expected >= int(stats["num_steps"]) > 1
    OPERATOR_CALLS.clear()
    counts = count_and_compare(solve, b)
    assert counts["debug_callback"] == expected
    assert counts["dot_general"] >= expected
    assert counts.opaque == {}


@pytest.mark.parametrize("operator", ["closure", "module_level"])
def test_lineax_count_in_cond(lx: ModuleType, operator: str) -> None:
    # A solve in one branch of a cond: every key its inside can count (CG's loop,
    # the operator's callback and matrix product) enters the cond first, so that
    # both branches return the same counts, and only the branch taken counts. A
    # module-level operator leaves no jaxpr in the solve's params: its inside is
    # found in the solve's implementation.
    if operator == "closure":
        solve = cg_solver(lx, lambda v, scale: counting_spd_operator(scale * v))
    else:
        module_solve = module_level_solve(lx, counting_spd_operator)
        solve = lambda b, scale: module_solve(scale * b)  # noqa: E731

    def f(b: jax.Array, scale: jax.Array) -> jax.Array:
        return jax.lax.cond(scale > 0, lambda: solve(b, scale)[0], lambda: jnp.sin(b))

    OPERATOR_CALLS.clear()
    _, stats = solve(*CG_ARGS)
    expected = len(OPERATOR_CALLS)
    assert expected >= int(stats["num_steps"]) > 1
    OPERATOR_CALLS.clear()
    counts = count_and_compare(f, *CG_ARGS)
    assert counts["debug_callback"] == expected
    assert counts["dot_general"] >= expected
    assert counts["sin"] == 0 and counts.opaque == {}
    assert "linear_solve" not in counts
    jit_out, jit_counts = jax.jit(count_primitives(f))(*CG_ARGS)
    assert_trees_equal(jit_out, jax.jit(f)(*CG_ARGS), "jit outputs")
    assert {name: int(count) for name, count in jit_counts.items()} == counts
    # The other branch: the solve's keys are there, at zero.
    counts = count_and_compare(f, CG_ARGS[0], -CG_ARGS[1])
    assert counts["sin"] == 1 and counts["debug_callback"] == 0 and counts["dot_general"] == 0
    assert_derivatives_through(count_primitives, f, *CG_ARGS, argnums=1)


def sqrt_matvec(v: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.sqrt(scale) * (SPD @ v)


def test_lineax_find_nans(lx: ModuleType) -> None:
    b, scale = CG_ARGS
    solve = cg_solver(lx, sqrt_matvec)
    negative = jnp.float32(-1.0)
    # The operator makes a NaN (the square root of -1) inside the solve, and
    # lineax's CG hides it: the solution comes out finite, so only
    # report="first" can find where the NaN was made.
    value, _ = solve(b, negative)
    assert bool(jnp.all(jnp.isfinite(value)))
    for wrapped in (find_nans(solve, report="first"), jax.jit(find_nans(solve, report="first"))):
        out, report = wrapped(b, negative)
        assert_trees_equal(out[0], value, "find_nans outputs")
        assert report.found and report.kind == "nan" and report.primitive == "sqrt"
        assert report.source is not None and report.source.startswith("test_ecosystem.py:")
    # With a positive scale the operator makes none; the first non-finite value
    # is an Inf that CG's own first iteration makes and throws away, in the
    # library's code.
    _, report = find_nans(solve, report="first")(b, scale)
    assert report.found and report.kind == "inf"
    assert report.path is not None and "site-packages" in report.path
    # find_nans under `jax.jvp` moves float32 results by an ulp even on
    # `jnp.sin(s * A @ b) / 3` (no library primitive): compared to rounding.
    first = functools.partial(find_nans, report="first")
    assert_derivatives_through(first, cg_solver(lx, spd_matvec), *CG_ARGS, argnums=1, exact=False)


def dense_solver(lx: ModuleType) -> Callable[..., Any]:
    """Solves `(scale * SPD) x = b` with lineax's LU on a matrix operator: the
    solution (nonlinear in `scale`, so second derivatives are not zero)."""

    def solve(b: jax.Array, scale: jax.Array) -> jax.Array:
        operator = lx.MatrixLinearOperator(scale * SPD)
        return jnp.tanh(lx.linear_solve(operator, jnp.sin(b), lx.LU()).value)

    return solve


@pytest.mark.parametrize("solver", ["LU", "CG"])
def test_lineax_vmap_and_second_derivatives(lx: ModuleType, solver: str) -> None:
    # An interpreted program holding a lineax solve (kups goes inside it):
    # `jax.vmap` of it and its second derivatives equal plain JAX's, bit for bit.
    if solver == "LU":
        solve = dense_solver(lx)
    else:
        cg = cg_solver(lx, spd_matvec)
        solve = lambda b, scale: jnp.tanh(cg(jnp.sin(b), scale)[0])  # noqa: E731
    assert static_count(jax.make_jaxpr(solve)(*CG_ARGS), "linear_solve") == 1

    def interpreted(b: jax.Array, scale: jax.Array) -> jax.Array:
        out, counts = count_primitives(solve)(b, scale)
        assert counts.opaque == {} and "linear_solve" not in counts  # went inside
        return out

    b, scale = CG_ARGS
    bs = jnp.stack([b, 2.0 * b, -b])
    scales = jnp.stack([scale, 2.0 * scale, 0.5 * scale])
    for in_axes, args in (((0, None), (bs, scale)), ((None, 0), (b, scales)), (0, (bs, scales))):
        assert_trees_equal(
            jax.jit(jax.vmap(interpreted, in_axes))(*args),
            jax.jit(jax.vmap(solve, in_axes))(*args),
            f"vmap {in_axes}",
        )

    def loss(f: Callable[..., Any]) -> Callable[..., Any]:
        return lambda b, scale: jnp.sum(f(b, scale) ** 2)

    derivatives = {
        "hessian": (lambda f: jax.hessian(loss(f), argnums=(0, 1)), (b, scale)),
        "jacfwd(grad)": (lambda f: jax.jacfwd(jax.grad(loss(f), argnums=1), argnums=1), (b, scale)),
        "jacrev(grad)": (lambda f: jax.jacrev(jax.grad(loss(f))), (b, scale)),
        "vmap(grad)": (
            lambda f: jax.vmap(jax.grad(loss(f), argnums=(0, 1)), (0, None)),
            (bs, scale),
        ),
    }
    for what, (derivative, args) in derivatives.items():
        actual = jax.jit(derivative(interpreted))(*args)
        expected = jax.jit(derivative(solve))(*args)
        assert_trees_equal(actual, expected, what)
        assert any(bool(jnp.any(leaf != 0)) for leaf in jax.tree.leaves(expected)), what


def test_lineax_callback_runs_as_in_plain_jax(lx: ModuleType) -> None:
    # A host callback in the operator of a lineax solve that kups goes inside
    # runs as many times as in plain JAX (the solve is not run twice), eagerly,
    # under jit and differentiated. An ordered one runs as often too: plain JAX
    # cannot compile it inside lineax's primitive (its lowering threads no
    # tokens), kups runs the implementation inlined, once.
    calls: list[np.ndarray] = []

    def operator(ordered: bool) -> Callable[..., Any]:
        def matvec(v: jax.Array, scale: jax.Array) -> jax.Array:
            jax.debug.callback(lambda x: calls.append(np.asarray(x)), v, ordered=ordered)
            return spd_matvec(v, scale)

        return matvec

    def runs(transform: Callable[..., Any], f: Callable[..., Any]) -> tuple[list[np.ndarray], Any]:
        calls.clear()
        out = transform(f)
        jax.effects_barrier()
        return list(calls), out

    def counted(solve: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            out, counts = count_primitives(solve)(*args)
            assert counts.opaque == {} and "linear_solve" not in counts
            return out

        return run

    b, scale = CG_ARGS
    transforms: dict[str, Callable[[Callable[..., Any]], Any]] = {
        "eager": lambda f: f(b, scale),
        "jit": lambda f: jax.jit(f)(b, scale),
        "jvp": lambda f: jax.jvp(lambda s: f(b, s)[0], (scale,), (jnp.float32(1.0),)),
        "grad": lambda f: jax.grad(lambda s: jnp.sum(f(b, s)[0]))(scale),
    }
    plain = cg_solver(lx, operator(ordered=False))
    steps = int(plain(b, scale)[1]["num_steps"])
    for what, transform in transforms.items():
        expected_calls, expected = runs(transform, plain)
        assert len(expected_calls) >= steps > 1, what
        for ordered in (False, True) if what in ("eager", "jit") else (False,):
            solve = counted(cg_solver(lx, operator(ordered)))
            actual_calls, actual = runs(transform, solve)
            assert len(actual_calls) == len(expected_calls), (what, ordered)
            if ordered:  # in the order plain JAX applied the operator
                assert_trees_equal(actual_calls, expected_calls, f"{what} calls")
            assert_trees_equal(actual, expected, f"{what} outputs")


# ---------------------------------------------------------------------------
# optimistix: a Newton root find.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def optx() -> ModuleType:
    return library("optimistix", "optimistix")


ROOT_ARGS = (jnp.full((3,), 0.5), jnp.array([0.1, 0.5, 2.0]))


def cubic(y: jax.Array, a: jax.Array) -> jax.Array:
    return jnp.tanh(y) + y**3 - a


def newton_root(optx: ModuleType, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The root of `fn(y, a) = 0` by Newton's method from `y0`, and the solver's
    statistics."""

    def root(y0: jax.Array, a: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        solution = optx.root_find(
            fn, optx.Newton(rtol=1e-6, atol=1e-6), y0, args=a, max_steps=20, throw=False
        )
        return solution.value, solution.stats

    return root


def test_optimistix_identity(optx: ModuleType) -> None:
    value, _ = assert_identity(newton_root(optx, cubic), *ROOT_ARGS)
    np.testing.assert_allclose(cubic(value, ROOT_ARGS[1]), 0.0, atol=1e-5)


def test_optimistix_gradient(optx: ModuleType) -> None:
    root = newton_root(optx, cubic)

    def loss(y0: jax.Array, a: jax.Array) -> jax.Array:
        value, _ = root(y0, a)
        return jnp.sum(value)

    grad = assert_grad_identity(loss, *ROOT_ARGS, argnums=1)
    # The implicit function theorem: dy/da = 1 / f'(y) at the root.
    value, _ = root(*ROOT_ARGS)
    expected = 1.0 / (1.0 - jnp.tanh(value) ** 2 + 3.0 * value**2)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)


def opened_count(jaxpr: Jaxpr | ClosedJaxpr, name: str) -> int:
    """`static_count`, also inside lineax's `linear_solve`: its implementation is
    traced with `jax.make_jaxpr` from the primitive's own `impl` (without kups),
    and a `cond` counts its largest branch."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    total = 0
    for eqn in jaxpr.eqns:
        primitive = eqn.primitive.name
        total += primitive == name
        if primitive == "linear_solve":
            impl = jax.make_jaxpr(lambda *xs, eqn=eqn: eqn.primitive.impl(*xs, **eqn.params))
            total += opened_count(impl(*(v.aval for v in eqn.invars)), name)
        elif primitive == "cond":
            total += max(opened_count(branch, name) for branch in eqn.params["branches"])
        elif primitive == "while":
            body = eqn.params["body_jaxpr"]
            if opened_count(body, name):
                raise ValueError(f"a while loop runs {name!r}: no static count")
        else:
            total += sum(opened_count(sub, name) for sub in jaxprs_in_params(eqn.params))
    return total


def per_step_count(optx: ModuleType, solver: Any, name: str) -> tuple[int, int]:
    """How many times one step of the optimistix `solver` on `cubic` runs `name`,
    and how many times its `init` does, read off plain JAX's traced programs
    (`opened_count`)."""
    eqx = importlib.import_module("equinox")
    y0, a = ROOT_ARGS

    def fn(y: jax.Array, a: jax.Array) -> tuple[jax.Array, None]:
        return cubic(y, a), None

    f_struct = jax.eval_shape(lambda: cubic(y0, a))

    def init(y: jax.Array) -> Any:
        return solver.init(fn, y, a, {}, f_struct, None, frozenset())

    arrays, static = eqx.partition(init(y0), eqx.is_array)

    def step(y: jax.Array, arrays: Any) -> Any:
        out = solver.step(fn, y, a, {}, eqx.combine(arrays, static), frozenset())
        return eqx.filter(out, eqx.is_array)

    step_count = opened_count(jax.make_jaxpr(step)(y0, arrays), name)
    init_count = opened_count(jax.make_jaxpr(lambda y: eqx.filter(init(y), eqx.is_array))(y0), name)
    return step_count, init_count


def optimistix_solve(optx: ModuleType, solver: Any) -> Callable[..., Any]:
    """`cubic`'s root by `solver` (a root finder or a least-squares solver) from
    `y0`, and the solver's statistics."""

    def solve(y0: jax.Array, a: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        run = optx.root_find if isinstance(solver, optx.AbstractRootFinder) else optx.least_squares
        solution = run(cubic, solver, y0, args=a, max_steps=30, throw=False)
        return solution.value, solution.stats

    return solve


@pytest.mark.parametrize(
    ("solver_name", "name", "per_step"),
    [
        ("Newton", "lu", 1),
        ("Newton", "triangular_solve", 2),
        ("LevenbergMarquardt", "dot_general", 6),
    ],
)
def test_optimistix_count(optx: ModuleType, solver_name: str, name: str, per_step: int) -> None:
    solver = getattr(optx, solver_name)(rtol=1e-6, atol=1e-6)
    solve = optimistix_solve(optx, solver)
    counts = count_and_compare(solve, *ROOT_ARGS)
    steps = int(solve(*ROOT_ARGS)[1]["num_steps"])
    assert steps > 2
    # Without kups: what one step runs (inside its linear solve: Newton's LU
    # factorisation and its two triangular solves, Levenberg-Marquardt's matrix
    # products), read off plain JAX's program, times optimistix's step count.
    assert per_step_count(optx, solver, name) == (per_step, 0)
    assert counts[name] == per_step * steps
    # The function runs once a step (its Jacobian, in the linear solve).
    assert counts["tanh"] == steps
    assert counts.opaque == {}
    assert_derivatives_through(count_primitives, solve, *ROOT_ARGS, argnums=1)


def test_optimistix_sow_in_function(optx: ModuleType) -> None:
    def fn(y: jax.Array, a: jax.Array) -> jax.Array:
        y = sow(y, tag="newton", name="y", mode="clobber", init=0)
        return cubic(y, a)

    # The solver's linear solves also run `fn` (for the Jacobian); kups goes
    # inside them, so no policy is needed, and nothing is opaque to ignore.
    expected, _ = newton_root(optx, cubic)(*ROOT_ARGS)
    for policy in (InterpreterPolicy.RAISE, InterpreterPolicy.IGNORE):
        (value, _), reaped = reap(newton_root(optx, fn), tag="newton", policy=policy)(*ROOT_ARGS)
        assert_trees_equal(value, expected, "reaped outputs")
        # Newton's convergence test evaluates the function at the iterate it
        # returns, last.
        assert_trees_equal(reaped, {"y": expected}, "reaped")


def test_optimistix_grad_of_plant(optx: ModuleType) -> None:
    # optimistix differentiates a solve by a custom_jvp whose rule runs a linear
    # solve on the tangents; plant interprets that rule only when a sow it plants
    # is inside, and otherwise leaves JAX's rule as it is (interpreted, it would
    # not transpose).
    def fn(y: jax.Array, a: jax.Array) -> jax.Array:
        y = sow(y, tag="newton", name="y", mode="clobber", init=0)
        return cubic(y, a)

    def loss(root: Callable[..., Any]) -> Callable[..., jax.Array]:
        return lambda y0, a: jnp.sum(root(y0, a)[0] ** 2)

    expected = jax.grad(loss(newton_root(optx, cubic)), argnums=1)(*ROOT_ARGS)
    planted = plant(loss(newton_root(optx, fn)), tag="newton")
    for grad in (jax.grad(functools.partial(planted, {}), argnums=1),):
        for wrap in (lambda g: g, jax.jit):
            np.testing.assert_allclose(wrap(grad)(*ROOT_ARGS), expected, rtol=1e-6)


def test_optimistix_find_nans(optx: ModuleType) -> None:
    y0, a = ROOT_ARGS
    poisoned = a.at[1].set(jnp.nan)
    value, _ = newton_root(optx, cubic)(y0, poisoned)
    assert bool(jnp.isnan(value[1]))
    _, report = find_nans(newton_root(optx, cubic))(y0, poisoned)
    assert report.found
    assert report.source is not None and report.source.startswith("test_ecosystem.py:")
    assert_derivatives_through(find_nans, newton_root(optx, cubic), *ROOT_ARGS, argnums=1)


# ---------------------------------------------------------------------------
# numpyro: NUTS steps on a tiny model.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numpyro() -> ModuleType:
    return library("numpyro", "numpyro")


OBSERVED = jnp.array([0.3, -0.1, 0.5])


def nuts(numpyro: ModuleType, lower: float | None = None) -> tuple[Callable[..., Any], Any, Any]:
    """Five NUTS steps in a `scan` on `mu ~ Normal(0, 1)`, `y ~ Normal(mu, 1)`:
    the program (the samples of `mu` and each step's number of leapfrog steps),
    its initial state (fixed keys) and the potential energy. With `lower`, the
    model checks `mu > lower`."""
    dist = importlib.import_module("numpyro.distributions")
    infer_util = importlib.import_module("numpyro.infer.util")
    hmc = importlib.import_module("numpyro.infer.hmc").hmc

    def model(y: jax.Array) -> None:
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        if lower is not None:
            check(mu > lower, "mu={} is not above {}", mu, lower)
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    init_params, potential_fn, _, _ = infer_util.initialize_model(
        jax.random.key(0), model, model_args=(OBSERVED,)
    )
    init_kernel, sample_kernel = hmc(potential_fn, algo="NUTS")
    state = init_kernel(init_params, num_warmup=0, step_size=0.3, rng_key=jax.random.key(1))

    def run(state: Any) -> tuple[jax.Array, jax.Array]:
        def step(state: Any, _: None) -> tuple[Any, tuple[jax.Array, jax.Array]]:
            state = sample_kernel(state)
            return state, (state.z["mu"], state.num_steps)

        _, samples = jax.lax.scan(step, state, None, length=5)
        return samples

    return run, state, potential_fn


def test_numpyro_identity(numpyro: ModuleType) -> None:
    run, state, _ = nuts(numpyro)
    samples, _ = assert_identity(run, state)
    assert len(set(np.asarray(samples).tolist())) > 1  # the chain moved


def test_numpyro_gradient_of_potential(numpyro: ModuleType) -> None:
    # NUTS itself (while loops of dynamic length) is not reverse-differentiable;
    # its potential energy, numpyro's trace of the model, is.
    _, state, potential_fn = nuts(numpyro)
    assert_grad_identity(potential_fn, state.z, argnums=0)


def test_numpyro_count(numpyro: ModuleType) -> None:
    run, state, potential_fn = nuts(numpyro)
    counts = count_and_compare(run, state)
    _, leapfrog_steps = run(state)
    # Each leapfrog step evaluates the potential and its gradient once.
    per_step = static_count(
        jax.make_jaxpr(jax.value_and_grad(potential_fn))(state.z), "integer_pow"
    )
    assert per_step > 0
    assert counts["integer_pow"] == per_step * int(jnp.sum(leapfrog_steps))
    assert counts.opaque == {}


def test_numpyro_check_in_model(numpyro: ModuleType) -> None:
    run, state, _ = nuts(numpyro, lower=-1.0)
    samples, _ = run(state)  # `check` does nothing outside `checked`
    assert float(samples[0]) < -1.0  # the first step visits mu < -1 (fixed keys)
    out, error = checked(run)(state)
    assert_trees_equal(out[0], samples, "checked outputs")
    assert error.message is not None and error.message.endswith("is not above -1.0")
    assert float(error.message.split("=")[1].split()[0]) <= -1.0
    # The scan step first, then NUTS's own loops: the first step went there.
    assert error.iteration is not None and error.iteration[0] == 0
    run, state, _ = nuts(numpyro, lower=-50.0)
    _, error = checked(run)(state)
    assert error.get() is None


# ---------------------------------------------------------------------------
# blackjax: HMC steps in a scan.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blackjax() -> ModuleType:
    return library("blackjax", "blackjax")


HMC_STEPS, LEAPFROG_STEPS = 6, 4


def hmc_chain(blackjax: ModuleType, logdensity: Callable[..., Any]) -> Callable[..., Any]:
    """`HMC_STEPS` HMC steps of `LEAPFROG_STEPS` leapfrog steps each in a `scan`:
    the positions, acceptances and proposed positions."""
    kernel = blackjax.hmc(
        logdensity,
        step_size=0.5,
        inverse_mass_matrix=jnp.ones(3),
        num_integration_steps=LEAPFROG_STEPS,
    )

    def run(key: jax.Array, state: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        def step(state: Any, key: jax.Array) -> tuple[Any, Any]:
            state, info = kernel.step(key, state)
            return state, (state.position, info.is_accepted, info.proposal.position)

        _, trace = jax.lax.scan(step, state, jax.random.split(key, HMC_STEPS))
        return trace

    return run


def student(x: jax.Array) -> jax.Array:
    return -jnp.sum(jnp.log1p(x**2))


def hmc_start(blackjax: ModuleType) -> tuple[jax.Array, Any]:
    kernel = blackjax.hmc(
        student, step_size=0.5, inverse_mass_matrix=jnp.ones(3), num_integration_steps=1
    )
    return jax.random.key(0), kernel.init(jnp.array([1.0, -0.5, 2.0]))


def test_blackjax_identity(blackjax: ModuleType) -> None:
    _, accepted, _ = assert_identity(hmc_chain(blackjax, student), *hmc_start(blackjax))
    assert bool(jnp.any(accepted))


def test_blackjax_gradient(blackjax: ModuleType) -> None:
    run = hmc_chain(blackjax, student)
    key, state = hmc_start(blackjax)

    def loss(position: jax.Array) -> jax.Array:
        positions, _, _ = run(key, state._replace(position=position))
        return jnp.sum(positions[-1] ** 2)

    assert_grad_identity(loss, state.position, argnums=0)


def test_blackjax_count(blackjax: ModuleType) -> None:
    run = hmc_chain(blackjax, student)
    args = hmc_start(blackjax)
    counts = count_and_compare(run, *args)
    # Without kups: `log1p` in the traced program, scan bodies times their length.
    assert counts["log1p"] == static_count(jax.make_jaxpr(run)(*args), "log1p")
    # ... and by hand: one log density a leapfrog step (velocity Verlet reuses the
    # gradient of the step before).
    assert counts["log1p"] == HMC_STEPS * LEAPFROG_STEPS
    assert counts.opaque == {}


def test_blackjax_sow_in_log_density(blackjax: ModuleType) -> None:
    def logdensity(x: jax.Array) -> jax.Array:
        x = sow(x, tag="hmc", name="x", mode="append")
        return student(x)

    args = hmc_start(blackjax)
    trace, reaped = reap(hmc_chain(blackjax, logdensity), tag="hmc")(*args)
    expected = hmc_chain(blackjax, student)(*args)
    assert_trees_equal(trace, expected, "reaped outputs")
    # One position per leapfrog step of each HMC step; the last of each is the
    # proposal blackjax reports.
    assert reaped["x"].shape == (HMC_STEPS, LEAPFROG_STEPS, 3)
    assert_trees_equal(reaped["x"][:, -1], expected[2], "last leapfrog positions")


def test_blackjax_nuts_nan_sites_agree_with_the_first_report(blackjax: ModuleType) -> None:
    # NUTS starts its trajectory's log-sum-exp at a constant -inf, carried through
    # while loops into conds: both reports blame the same equation, where the
    # first NUTS step combines it with data (`logaddexp` in blackjax's proposal).
    kernel = blackjax.nuts(student, step_size=0.5, inverse_mass_matrix=jnp.ones(3))

    def run(key: jax.Array, state: Any) -> jax.Array:
        def step(state: Any, key: jax.Array) -> tuple[Any, jax.Array]:
            state, _ = kernel.step(key, state)
            return state, state.position

        return jax.lax.scan(step, state, jax.random.split(key, 3))[1]

    args = (jax.random.key(0), kernel.init(jnp.array([1.0, -0.5, 2.0])))
    expected = run(*args)
    out, sites = jax.jit(nan_sites(run))(*args)
    assert_trees_equal(out, expected, "nan_sites outputs")
    _, first = jax.jit(find_nans(run, report="first"))(*args)
    assert first.found and first.kind == "inf"
    # The first step's first tree doubling, which every step runs.
    assert first.iteration == (0, 0)
    found = {(s.primitive, s.source, s.kind, s.first_iteration) for s in sites}
    assert (first.primitive, first.source, "inf", first.iteration) in found
    assert all(s.source == first.source for s in sites)


# ---------------------------------------------------------------------------
# jax-md: a Lennard-Jones NVE run with a neighbor list.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_md() -> ModuleType:
    return library("jax_md", "jax-md")


MD_STEPS = 5


class LennardJones:
    """Sixteen Lennard-Jones particles on a perturbed 4x4 grid in a periodic box,
    a neighbor list, and `MD_STEPS` velocity-Verlet (NVE) steps in a `fori_loop`
    that updates the neighbor list after each step."""

    def __init__(self, jax_md: ModuleType) -> None:
        space, energy, simulate = jax_md.space, jax_md.energy, jax_md.simulate
        displacement, shift = space.periodic(4.0)
        # No cell list (sixteen particles need none): jax-md keeps a cell list's
        # cell size, an array, as static pytree metadata, which JAX's jit cache
        # cannot compare once the same function has been traced twice (plain
        # `jax.grad(jax.jit(f))` fails the same way).
        self.neighbor_fn, self.energy_fn = energy.lennard_jones_neighbor_list(
            displacement,
            4.0,
            r_cutoff=1.5,
            dr_threshold=0.3,
            capacity_multiplier=1.5,
            disable_cell_list=True,
        )
        self.init, self.apply = simulate.nve(self.energy_fn, shift, dt=1e-3)
        grid = jnp.stack(jnp.meshgrid(jnp.arange(4.0), jnp.arange(4.0)), axis=-1).reshape(-1, 2)
        wobble = 0.05 * jnp.sin(jnp.arange(32.0)).reshape(16, 2)
        self.positions = grid + 0.05 + wobble
        self.force_fn = jax_md.quantity.force(self.energy_fn)

    def args(self, positions: jax.Array | None = None) -> tuple[Any, ...]:
        positions = self.positions if positions is None else positions
        return jax.random.key(0), positions, self.neighbor_fn.allocate(positions)

    def run(self, key: jax.Array, positions: jax.Array, neighbors: Any) -> tuple[Any, ...]:
        state = self.init(key, positions, kT=0.1, neighbor=neighbors)

        def step(_: jax.Array, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            state, neighbors = carry
            state = self.apply(state, neighbor=neighbors)
            return state, neighbors.update(state.position)

        state, neighbors = jax.lax.fori_loop(0, MD_STEPS, step, (state, neighbors))
        return state.position, state.momentum, neighbors.did_buffer_overflow


def test_jax_md_identity(jax_md: ModuleType) -> None:
    system = LennardJones(jax_md)
    positions, _, overflow = assert_identity(system.run, *system.args())
    assert not bool(overflow)
    assert not np.array_equal(positions, system.positions)


def test_jax_md_gradient(jax_md: ModuleType) -> None:
    system = LennardJones(jax_md)
    key, positions, neighbors = system.args()

    def final_energy(positions: jax.Array) -> jax.Array:
        final, _, _ = system.run(key, positions, neighbors)
        return system.energy_fn(final, neighbor=neighbors)

    grad = assert_grad_identity(final_energy, positions, argnums=0, eager=False)
    assert bool(jnp.all(jnp.isfinite(grad))) and bool(jnp.any(grad != 0))


def test_jax_md_count(jax_md: ModuleType) -> None:
    system = LennardJones(jax_md)
    args = system.args()
    counts = count_and_compare(system.run, *args)
    # Without kups: `pow` in the traced program (the fori_loop is a scan of
    # MD_STEPS steps)...
    assert counts["pow"] == static_count(jax.make_jaxpr(system.run)(*args), "pow")
    # ... and by hand: one force evaluation to start, one a step.
    per_force = static_count(jax.make_jaxpr(system.force_fn)(args[1], neighbor=args[2]), "pow")
    assert per_force > 0
    assert counts["pow"] == per_force * (1 + MD_STEPS)
    assert counts.opaque == {}


def test_jax_md_find_nans(jax_md: ModuleType) -> None:
    system = LennardJones(jax_md)
    # Two particles on top of each other: an infinite Lennard-Jones force.
    overlapping = system.positions.at[1].set(system.positions[0])
    args = system.args(overlapping)
    positions, _, _ = system.run(*args)
    assert not bool(jnp.all(jnp.isfinite(positions)))
    # Under jit: one compiled program (eagerly, each equation outside the loop
    # would be compiled on its own, with its checks).
    out, report = jax.jit(find_nans(system.run))(*args)
    assert_trees_equal(out, jax.jit(system.run)(*args), "find_nans outputs")
    assert report.found and report.kind in ("nan", "inf")
    assert report.path is not None and f"{os.sep}jax_md{os.sep}" in report.path
    assert report.source is not None and report.primitive is not None
    _, report = jax.jit(find_nans(system.run))(*system.args())
    assert not report.found


# ---------------------------------------------------------------------------
# flax (nnx) and optax: training steps of a small MLP.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nnx() -> ModuleType:
    return library("flax.nnx", "flax")


@pytest.fixture(scope="module")
def optax() -> ModuleType:
    return library("optax", "optax")


TRAIN_STEPS = 3
FEATURES = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
TARGETS = jnp.sum(jnp.sin(FEATURES), axis=1, keepdims=True)


def mlp_trainer(
    nnx: ModuleType, optax: ModuleType, *, sow_hidden: bool
) -> tuple[Callable[..., Any], Any]:
    """`TRAIN_STEPS` Adam steps of a 4-8-1 tanh MLP on a mean squared error, in a
    `scan` over the split (graph, state) of model and optimizer: the program
    (the losses, the hidden activations of each step and the final state) and
    the initial state. With `sow_hidden`, the model sows its hidden activations
    (tag "flax", name "hidden", appended) instead of handing them back."""

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.hidden = nnx.Linear(4, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            hidden = jnp.tanh(self.hidden(x))
            if sow_hidden:
                hidden = sow(hidden, tag="flax", name="hidden", mode="append")
            return self.out(hidden), hidden

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graph, state = nnx.split((model, optimizer))

    def train(state: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        def step(state: Any, _: None) -> tuple[Any, tuple[jax.Array, jax.Array]]:
            # copy=True: the merged objects are new, so eager steps never write
            # into the caller's state.
            model, optimizer = nnx.merge(graph, state, copy=True)

            def loss_fn(model: Any) -> tuple[jax.Array, jax.Array]:
                prediction, hidden = model(x)
                return jnp.mean((prediction - y) ** 2), hidden

            (loss, hidden), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
            optimizer.update(model, grads)
            _, state = nnx.split((model, optimizer))
            return state, (loss, hidden)

        state, (losses, hiddens) = jax.lax.scan(step, state, None, length=TRAIN_STEPS)
        return losses, (None if sow_hidden else hiddens), state

    return train, state


def test_flax_identity(nnx: ModuleType, optax: ModuleType) -> None:
    train, state = mlp_trainer(nnx, optax, sow_hidden=False)
    losses, _, _ = assert_identity(train, state, FEATURES, TARGETS)
    assert float(losses[-1]) < float(losses[0])


def test_flax_gradient(nnx: ModuleType, optax: ModuleType) -> None:
    train, state = mlp_trainer(nnx, optax, sow_hidden=False)

    def final_loss(state: Any, x: jax.Array) -> jax.Array:
        losses, _, _ = train(state, x, TARGETS)
        return losses[-1]

    # With respect to the data, through the training steps (second order: each
    # step holds a gradient).
    grad = assert_grad_identity(final_loss, state, FEATURES, argnums=1)
    assert bool(jnp.any(grad != 0))


def test_flax_count(nnx: ModuleType, optax: ModuleType) -> None:
    train, state = mlp_trainer(nnx, optax, sow_hidden=False)
    args = (state, FEATURES, TARGETS)
    counts = count_and_compare(train, *args)
    # Without kups: `dot_general` in the traced program, the scan body times its
    # length...
    assert counts["dot_general"] == static_count(jax.make_jaxpr(train)(*args), "dot_general")
    # ... and by hand: a step runs two layers forward, and backward the gradients
    # of both kernels and of the hidden activations.
    assert counts["dot_general"] == TRAIN_STEPS * (2 + 3)
    assert counts.opaque == {}


def test_flax_sow_in_module(nnx: ModuleType, optax: ModuleType) -> None:
    train, state = mlp_trainer(nnx, optax, sow_hidden=True)
    (losses, _, final), reaped = reap(train, tag="flax")(state, FEATURES, TARGETS)
    # The same program handing its hidden activations back by hand.
    threaded_train, _ = mlp_trainer(nnx, optax, sow_hidden=False)
    expected_losses, hiddens, expected_final = threaded_train(state, FEATURES, TARGETS)
    assert_trees_equal((losses, final), (expected_losses, expected_final), "reaped outputs")
    assert_trees_equal(reaped, {"hidden": hiddens}, "reaped")
    assert reaped["hidden"].shape == (TRAIN_STEPS, 8, 8)
