"""`kups.debug.find_nans`, checked against where each test program produces its
first NaN or Inf, worked out by hand: the line (marked with a `# <marker>`
comment), the iteration and the shard."""

import contextlib
import inspect
import os
import re

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import kups.effects
from kups import debug
from kups.debug import NanReport, find_nans, nan_sites

with open(__file__) as _file:
    _LINES = _file.read().splitlines()


def line_of(marker: str) -> str:
    """`"test_debug.py:LINE"` of the one line that ends with `# <marker>`."""
    lines = [i for i, text in enumerate(_LINES, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, f"marker {marker!r} on lines {lines}"
    return f"{os.path.basename(__file__)}:{lines[0]}"


def report_of(fn, *args, report="reaching", **kwargs) -> NanReport:
    """The report of `fn` (`find_nans(fn, report=report)`), eagerly and under jit,
    checked to agree; the outputs checked against `fn` itself."""
    out, found = find_nans(fn, report=report)(*args, **kwargs)
    jit_out, jit_report = eqx.filter_jit(find_nans(fn, report=report))(*args, **kwargs)
    expected = fn(*args, **kwargs)
    for got in (out, jit_out):
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert summary(jit_report) == summary(found)
    return found


def summary(report: NanReport) -> dict:
    return {
        "found": report.found,
        "kind": report.kind,
        "primitive": report.primitive,
        "source": report.source,
        "iteration": report.iteration,
        "shard": report.shard,
    }


def expect(report, primitive, marker, kind="nan", iterations=(), shard=None):
    assert summary(report) == {
        "found": True,
        "kind": kind,
        "primitive": primitive,
        "source": line_of(marker),
        "iteration": tuple(iterations),
        "shard": shard,
    }


# ------------------------------------------------------------ straight-line code


def test_nan_from_log_of_minus_one():
    def f(x):
        y = jnp.log(x)  # log-minus-one
        return y * 2.0 + 1.0

    report = report_of(f, jnp.float32(-1.0))
    expect(report, "log", "log-minus-one")
    assert type(report.found) is bool


def test_inf_from_division_by_zero():
    def f(x):
        y = x + 1.0
        return 1.0 / y  # one-over-zero

    expect(report_of(f, jnp.float32(-1.0)), "div", "one-over-zero", kind="inf")


def test_no_nan():
    def f(x):
        return jnp.log(x) / x + jnp.sqrt(x)

    report = report_of(f, jnp.float32(2.0))
    assert report.found is False
    assert report.primitive is None
    assert report.source is None
    assert report.kind is None
    assert report.iteration is None
    assert report.shard is None
    assert repr(report) == "NanReport(found=False)"
    assert report.message is None


def test_report_is_a_toolkit_report_with_its_fields():
    _, nan = find_nans(lambda x: jnp.log(x))(jnp.float32(-1.0))  # log-and-div
    _, inf = find_nans(lambda x: 1.0 / x)(jnp.float32(0.0))
    assert isinstance(nan, kups.effects.Report)
    assert (nan.message, nan.primitive, nan.kind) == ("log made a NaN", "log", "nan")
    assert (inf.message, inf.primitive, inf.kind) == ("div made an Inf", "div", "inf")
    assert nan.path == __file__ and nan.source == line_of("log-and-div")


def test_only_the_first_equation_is_reported():
    def f(x):
        y = 1.0 / x  # first-inf
        z = y - y  # inf - inf is NaN, but the Inf came first
        return jnp.log(-jnp.abs(z)) * z

    expect(report_of(f, jnp.float32(0.0)), "div", "first-inf", kind="inf")


def test_nan_flowing_through_later_equations_stays_reported_at_its_source():
    def f(x):
        y = jnp.sqrt(x)  # sqrt-of-negative
        for _ in range(3):
            y = jnp.sin(y) * 2.0 + y
        return y

    expect(report_of(f, jnp.float32(-4.0)), "sqrt", "sqrt-of-negative")


def test_nan_in_the_input_is_reported_at_the_first_equation_that_outputs_it():
    def f(x):
        return x * 2.0  # consumes-nan

    expect(report_of(f, jnp.float32(jnp.nan)), "mul", "consumes-nan")


def test_integer_outputs_are_not_checked():
    def f(i, x):
        j = i // 0 + i % 0  # integer division by zero: no NaN in integers
        return j, x * 2.0

    report = report_of(f, jnp.int32(3), jnp.float32(1.0))
    assert report.found is False


def test_nan_among_several_outputs_and_in_arrays():
    def f(x):
        return lax.sort((x, jnp.log(x)), num_keys=1)  # log-of-array

    x = jnp.array([3.0, 2.0, 1.0, -1.0])
    expect(report_of(f, x), "log", "log-of-array")


def test_complex_outputs_are_checked():
    def f(x):
        return jnp.exp(x) * jnp.inf  # complex-inf

    report = report_of(f, jnp.complex64(1.0 + 1.0j))
    assert report.primitive == "mul" and report.source == line_of("complex-inf")


def test_static_arguments():
    def f(x, *, offset, activation):
        return activation(x - offset)  # static-args

    report = report_of(f, jnp.float32(1.0), offset=2.0, activation=jnp.log)
    assert report.found and report.primitive == "log"


# ------------------------------------------------------------ constants


@pytest.mark.parametrize(
    "reduction", [jnp.var, jnp.std, jnp.median, jnp.nanvar, lambda x: jnp.cov(x, x)]
)
def test_nan_constants_inside_jnp_functions_are_not_reported(reduction):
    # jnp.var builds a NaN constant (its result for an empty reduction) and
    # selects it away: a constant of the program, not a NaN the data produced.
    assert report_of(reduction, jnp.arange(6.0)).found is False


def test_layer_norm_in_a_scan_in_a_shard_map_is_quiet(mesh8):
    def layer_norm(h):
        return (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)

    def body(h, w):
        return layer_norm(h @ w), jnp.std(h)

    def f(h, ws):
        return jax.shard_map(
            lambda h, ws: lax.scan(body, h, ws),
            mesh=mesh8,
            in_specs=(P("i"), P()),
            out_specs=(P("i"), P("i")),
        )(h, ws)

    h = jnp.arange(32.0).reshape(8, 4) / 10
    ws = jnp.stack([jnp.eye(4)] * 3)
    assert report_of(f, h, ws).found is False


def test_nan_constant_combined_with_data_is_reported_where_they_meet():
    def f(x):
        return jnp.where(x > 0, x * 2.0, jnp.nan)  # where-with-nan

    report = report_of(f, jnp.array([1.0, -1.0]))
    expect(report, "select_n", "where-with-nan")
    assert report_of(f, jnp.array([1.0, 4.0])).found is False


@pytest.mark.parametrize("constant_first", [True, False])
def test_one_jitted_function_called_on_a_constant_and_on_data(constant_first):
    # Both calls share one jaxpr; only the call on data reports, whichever comes
    # first (the body is traced once per kind of call).
    shared = jax.jit(lambda v: jnp.sqrt(v))  # sqrt-in-shared

    def f(x):
        if constant_first:
            return shared(-1.0), shared(x)
        return shared(x), shared(-1.0)

    expect(report_of(f, jnp.float32(-4.0)), "sqrt", "sqrt-in-shared")
    assert report_of(f, jnp.float32(4.0)).found is False


def test_nan_computed_from_constants_alone_is_not_reported():
    def f(x):
        bad = jnp.log(jnp.float32(-1.0))
        return x + 1.0, bad * 2.0

    assert report_of(f, jnp.float32(1.0)).found is False

    def g(x):
        bad = jnp.log(jnp.float32(-1.0))
        return x * bad  # constant-meets-data

    expect(report_of(g, jnp.float32(1.0)), "mul", "constant-meets-data")


# ------------------------------------------------------------ control flow


def test_nan_in_nested_jit():
    @jax.jit
    def inner(x):
        return jnp.arccos(x)  # arccos-out-of-range

    @jax.jit
    def outer(x):
        return inner(x * 2.0) + 1.0

    expect(report_of(outer, jnp.float32(0.75)), "acos", "arccos-out-of-range")


@pytest.mark.parametrize("bad", [0, 3, 5])
def test_scan_iteration(bad):
    def f(xs):
        def body(carry, x):
            return carry + jnp.log(x), None  # log-in-scan

        return lax.scan(body, jnp.float32(0), xs)[0]

    xs = jnp.ones(6).at[bad].set(-1.0)
    expect(report_of(f, xs), "log", "log-in-scan", iterations=[bad])


def test_reverse_scan_reports_the_index_into_xs():
    def f(xs):
        def body(carry, x):
            return carry, jnp.log(x)  # log-in-reverse-scan

        return lax.scan(body, jnp.float32(0), xs, reverse=True)

    # xs[1] is processed by the fourth step of a reversed scan of five; the
    # report names its entry of xs, as the scan's own outputs are aligned.
    xs = jnp.ones(5).at[1].set(-1.0)
    expect(report_of(f, xs), "log", "log-in-reverse-scan", iterations=[1])
    expect(report_of(f, xs, report="first"), "log", "log-in-reverse-scan", iterations=[1])


def test_zero_length_scan():
    def f(xs):
        return lax.scan(lambda c, x: (c + jnp.log(x), None), jnp.float32(0), xs)[0]

    assert report_of(f, jnp.zeros(0)).found is False


def test_nested_scans_report_every_iteration():
    def f(xs, ys):
        def outer(carry, x):
            def inner(c, y):
                return c + jnp.log(x - y), None  # log-in-inner-scan

            return lax.scan(inner, carry, ys)[0], None

        return lax.scan(outer, jnp.float32(0), xs)[0]

    # x - y first reaches zero (log: -inf) at x = xs[2] = 2, y = ys[1] = 2.
    xs = jnp.array([5.0, 4.0, 2.0, 1.0])
    ys = jnp.array([1.0, 2.0, 3.0])
    expect(report_of(f, xs, ys), "log", "log-in-inner-scan", kind="inf", iterations=[2, 1])


@pytest.mark.parametrize("inner", ["scan", "fori_loop"])
def test_an_array_carried_through_an_inner_loop(inner):
    # The outer carry (rows of an array) is the inner loop's carry: both reports
    # follow it through (the inner loop's layout read on every JAX release).
    def halve_root(c):
        return jnp.sqrt(c - 0.5)  # inner-sqrt

    def inner_loop(c):
        if inner == "scan":
            return lax.scan(lambda cc, _: (halve_root(cc), None), c, None, length=2)[0]
        return lax.fori_loop(0, 2, lambda j, cc: halve_root(cc), c)

    def f(x):
        return lax.scan(lambda c, _: (inner_loop(c), None), x, None, length=3)[0]

    # 1 -> sqrt(0.5) -> sqrt(0.21) ~ 0.46 -> sqrt(-0.04): NaN at outer 1, inner 0.
    for report in ("reaching", "first"):
        expect(
            report_of(f, jnp.ones((4, 2)), report=report), "sqrt", "inner-sqrt", iterations=[1, 0]
        )


def test_fori_loop():
    def f(x):
        return lax.fori_loop(0, 10, lambda i, v: jnp.sqrt(v - 1.0), x)  # sqrt-in-fori

    # 17 -> 4 -> sqrt(3) -> sqrt(sqrt(3) - 1) ~ 0.86 -> sqrt(-0.14) is NaN.
    expect(report_of(f, jnp.float32(17.0)), "sqrt", "sqrt-in-fori", iterations=[3])


@pytest.mark.parametrize(("x", "n", "iteration"), [(-1.0, 0, None), (np.e, 2, None), (np.e, 5, 2)])
def test_while_body(x, n, iteration):
    def f(x, n):
        def body(state):
            i, v = state
            return i + 1, jnp.log(v)  # log-in-while

        return lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), x))

    # log(e) = 1, log(1) = 0, then log(0) = -inf at iteration 2; a loop that
    # runs zero times checks nothing.
    report = report_of(f, jnp.float32(x), jnp.int32(n))
    if iteration is None:
        assert report.found is False
    else:
        expect(report, "log", "log-in-while", kind="inf", iterations=[iteration])


def test_while_condition():
    def f(x):
        def cond(v):
            return jnp.log(v) > -5.0  # log-in-condition

        return lax.while_loop(cond, lambda v: v - 1.0, x)

    # The condition sees 2.5, 1.5, 0.5, then -0.5 (NaN) after iteration 2.
    first = report_of(f, jnp.float32(2.5), report="first")
    expect(first, "log", "log-in-condition", iterations=[2])
    # The NaN only decides a comparison: nothing non-finite reaches the output.
    assert report_of(f, jnp.float32(2.5)).found is False


@pytest.mark.parametrize("pred", [False, True])
def test_cond_taken_branch_only(pred):
    def f(p, x):
        return lax.cond(p, lambda x: jnp.log(x), lambda x: x * 2.0, x)  # log-in-cond

    report = report_of(f, jnp.bool_(pred), jnp.float32(-1.0))
    if pred:
        expect(report, "log", "log-in-cond")
    else:
        assert report.found is False


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch(index):
    def f(i, x):
        branches = [
            lambda x: x + 1.0,
            lambda x: jnp.sqrt(x),  # sqrt-in-switch
            lambda x: x / 0.0,  # div-in-switch
        ]
        return lax.switch(i, branches, x)

    report = report_of(f, jnp.int32(index), jnp.float32(-1.0))
    if index == 0:
        assert report.found is False
    elif index == 1:
        expect(report, "sqrt", "sqrt-in-switch")
    else:
        expect(report, "div", "div-in-switch", kind="inf")


def test_branch_given_as_a_jax_function_reports_the_cond_line():
    # JAX keeps no user frame for equations of `jnp.log` passed as the branch
    # itself; the line of the cond is the nearest one of the user's.
    def f(p, x):
        return lax.cond(p, jnp.log, jnp.exp, x)  # cond-with-jnp-branch

    expect(report_of(f, jnp.bool_(True), jnp.float32(-1.0)), "log", "cond-with-jnp-branch")


def test_loop_in_one_branch_only():
    def f(p, x):
        def looping(x):
            return lax.fori_loop(0, 4, lambda i, v: jnp.log(v), x)  # log-in-branch-loop

        return lax.cond(p, looping, jnp.sin, x)

    # log(3) ~ 1.1, log(1.1) ~ 0.09, log(0.09) ~ -2.4, log(-2.4) is NaN.
    expect(
        report_of(f, jnp.bool_(True), jnp.float32(3.0)), "log", "log-in-branch-loop", iterations=[3]
    )
    assert report_of(f, jnp.bool_(False), jnp.float32(3.0)).found is False


def test_cond_in_scan():
    def f(xs):
        def body(carry, x):
            y = lax.cond(x > 0, jnp.sin, lambda x: jnp.log(x), x)  # log-in-cond-in-scan
            return carry + y, None

        return lax.scan(body, jnp.float32(0), xs)[0]

    xs = jnp.array([1.0, 2.0, 3.0, -1.0, -2.0])
    expect(report_of(f, xs), "log", "log-in-cond-in-scan", iterations=[3])


def test_checkpoint():
    def f(x):
        return jax.checkpoint(lambda x: jnp.log(x) * 2.0)(x)  # log-in-checkpoint

    expect(report_of(f, jnp.float32(-1.0)), "log", "log-in-checkpoint")


def test_custom_jvp():
    @jax.custom_jvp
    def g(x):
        return jnp.log(x)  # log-in-custom-jvp

    g.defjvp(lambda primals, tangents: (g(primals[0]), tangents[0] / primals[0]))
    expect(report_of(g, jnp.float32(-1.0)), "log", "log-in-custom-jvp")


def test_custom_vjp():
    @jax.custom_vjp
    def g(x):
        return 1.0 / x  # div-in-custom-vjp

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (-ct / x**2,))
    expect(report_of(g, jnp.float32(0.0)), "div", "div-in-custom-vjp", kind="inf")


# ------------------------------------------------------------ shard_map


def test_shard_map_full_manual(mesh42):
    def f(x):
        return jax.shard_map(
            lambda a: jnp.log(a) + 1.0,  # log-in-shard-map
            mesh=mesh42,
            in_specs=P("x", "y"),
            out_specs=P("x", "y"),
        )(x)

    # Blocks are 2 x 2: row 5 is on x = 2, column 3 on y = 1; row 7 column 0 is
    # on shard (3, 0), later in mesh order.
    x = jnp.ones((8, 4)).at[5, 3].set(-1.0).at[7, 0].set(-1.0)
    expect(report_of(f, x), "log", "log-in-shard-map", shard={"x": 2, "y": 1})


@pytest.mark.parametrize("bad_shard", [0, 3, 7])
def test_nan_spread_by_a_collective_is_reported_where_it_was_made(mesh8, bad_shard):
    def body(a):
        b = jnp.sqrt(a)  # sqrt-before-psum
        total = jax.lax.psum(b.sum(), "i")  # psum-spreads-it
        return b * total

    def f(x):
        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    # Every shard's psum is NaN; only the bad shard's sqrt made one, earlier.
    x = jnp.ones(16).at[2 * bad_shard + 1].set(-1.0)
    expect(report_of(f, x), "sqrt", "sqrt-before-psum", shard={"i": bad_shard})


def test_earlier_equation_on_a_later_shard_wins(mesh8):
    def body(a):
        b = jnp.log(a)  # log-early
        c = jnp.sqrt(b + 10.0)  # sqrt-late
        return c

    def f(x):
        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    # Shard 1 fails at the sqrt (log(1e-9) + 10 < 0), shard 6 at the log.
    x = jnp.ones(16).at[2].set(1e-9).at[13].set(-1.0)
    expect(report_of(f, x), "log", "log-early", shard={"i": 6})


def test_shard_map_partial_manual(mesh42):
    def f(x):
        return jax.shard_map(
            lambda a: jnp.sqrt(a),  # sqrt-in-partial-shard-map
            mesh=mesh42,
            in_specs=P("x"),
            out_specs=P("x"),
            axis_names={"x"},
        )(x)

    x = jnp.ones((8, 4)).at[3, 1].set(-1.0)
    expect(report_of(f, x), "sqrt", "sqrt-in-partial-shard-map", shard={"x": 1})


def test_shard_map_without_nan(mesh8):
    def f(x):
        return jax.shard_map(jnp.log, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    assert report_of(f, jnp.ones(16)).found is False


def test_shard_map_without_check_vma(mesh8):
    def f(x):
        return jax.shard_map(
            lambda a: jnp.log(a),  # log-without-check-vma
            mesh=mesh8,
            in_specs=P("i"),
            out_specs=P("i"),
            check_vma=False,
        )(x)

    x = jnp.ones(16).at[13].set(-1.0)
    expect(report_of(f, x), "log", "log-without-check-vma", shard={"i": 6})


def test_scan_in_shard_map(mesh42):
    def f(x):
        def body(a):
            def step(carry, i):
                return carry + jnp.log(a - i), None  # log-in-scan-in-shard-map

            return lax.scan(step, jnp.zeros_like(a), jnp.arange(4.0))[0]

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    # Shard (1, 0) holds 2.5 (NaN at iteration 3); shard (3, 1) holds 0.5 (NaN at
    # iteration 1): the earlier one is reported, though later in mesh order.
    x = jnp.full((8, 4), 9.0).at[2, 0].set(2.5).at[7, 3].set(0.5)
    expect(
        report_of(f, x), "log", "log-in-scan-in-shard-map", iterations=[1], shard={"x": 3, "y": 1}
    )
    # Alone, shard (1, 0)'s is reported.
    x = jnp.full((8, 4), 9.0).at[2, 0].set(2.5)
    expect(
        report_of(f, x), "log", "log-in-scan-in-shard-map", iterations=[3], shard={"x": 1, "y": 0}
    )


def test_shard_map_in_scan(mesh42):
    def f(x, offsets):
        sharded = jax.shard_map(
            lambda a: jnp.log(a),  # log-in-shard-map-in-scan
            mesh=mesh42,
            in_specs=P("x", "y"),
            out_specs=P("x", "y"),
        )

        def step(carry, offset):
            return carry + sharded(x - offset), None

        return lax.scan(step, jnp.zeros_like(x), offsets)[0]

    # Only x[0, 2] (on shard x = 0, y = 1) goes negative, at the second offset.
    x = jnp.full((8, 4), 10.0).at[0, 2].set(1.5)
    report = report_of(f, x, jnp.array([1.0, 2.0, 3.0]))
    expect(report, "log", "log-in-shard-map-in-scan", iterations=[1], shard={"x": 0, "y": 1})


def test_while_with_per_shard_trip_counts(mesh42):
    def f(x):
        def body(a):
            n = lax.axis_index("x")

            def step(state):
                return state[0] + 1, jnp.log(state[1])  # log-in-per-shard-while

            return lax.while_loop(lambda s: s[0] < n, step, (jnp.int32(0), a))[1]

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    # log(0.5) < 0, so the second iteration is NaN: shards x >= 2 run it.
    report = report_of(f, jnp.full((8, 4), 0.5))
    expect(report, "log", "log-in-per-shard-while", iterations=[1], shard={"x": 2, "y": 0})


def test_nested_shard_maps(mesh42):
    def f(x):
        def outer(a):
            inner = jax.shard_map(
                lambda b: jnp.log(b),  # log-in-inner-shard-map
                mesh=jax.sharding.get_abstract_mesh(),
                in_specs=P(None, "y"),
                out_specs=P(None, "y"),
                axis_names={"y"},
            )
            return inner(a) * 2.0

        return jax.shard_map(
            outer, mesh=mesh42, in_specs=P("x"), out_specs=P("x"), axis_names={"x"}
        )(x)

    x = jnp.ones((8, 4)).at[6, 1].set(-1.0)
    expect(report_of(f, x), "log", "log-in-inner-shard-map", shard={"x": 3, "y": 0})


# ------------------------------------------------------------ the report


def test_report_under_jit_is_a_pytree_read_outside():
    def f(x):
        return jnp.log(x)  # log-for-jit

    _, report = jax.jit(find_nans(f))(jnp.float32(-1.0))
    assert isinstance(report, NanReport)
    expect(report, "log", "log-for-jit")

    @jax.jit
    def inside(x):
        _, report = find_nans(f)(x)
        assert repr(report) == "NanReport(<traced>)"
        with pytest.raises(TypeError, match="concrete"):
            report.primitive
        return report.found

    assert bool(inside(jnp.float32(-1.0))) is True
    assert bool(inside(jnp.float32(1.0))) is False


def test_report_pytree_round_trip():
    _, report = find_nans(lambda x: jnp.log(x))(jnp.float32(-1.0))
    leaves, treedef = jax.tree.flatten(report)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert summary(rebuilt) == summary(report)


def test_report_repr_and_html(mesh42):
    def f(xs):
        def body(a):
            return lax.scan(lambda c, x: (c, jnp.log(x)), 0.0, a[0])[1]  # log-for-repr

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P(("x", "y")))(xs)

    xs = jnp.ones((8, 4)).at[4, 1].set(-1.0)
    _, report = find_nans(f)(xs)
    assert repr(report) == (
        f"NanReport(found=True, kind=nan, primitive=log, source={line_of('log-for-repr')}, "
        "iteration=1, shard=x=2, y=0)"
    )
    html = report._repr_html_()
    assert html.startswith("<table>")
    assert re.search(r"<th[^>]*>primitive</th><td>log</td>", html)
    assert "x=2, y=0" in html
    assert find_nans(lambda x: x + 1.0)(jnp.float32(1.0))[1]._repr_html_().count("<tr>") == 1


def test_wrapped_keeps_the_name_of_the_function():
    def my_function(x):
        return x

    assert find_nans(my_function).__name__ == "my_function"


def test_docstring_examples_run():
    for obj in (debug.find_nans, debug.NanReport):
        for block in re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", re.S):
            exec(compile(block, f"<docstring of {obj.__name__}>", "exec"), {})


def test_vmap_report_reads_as_its_first_event():
    def f(x):
        y = jnp.sqrt(x)  # sqrt-under-vmap
        return jnp.log(y - 1.0)  # log-under-vmap

    # Element 1 makes a NaN in sqrt, element 2 in log (log(-1) is NaN: sqrt(0) - 1).
    _, reports = jax.vmap(find_nans(f, report="first"))(jnp.array([4.0, -1.0, 0.0]))
    assert reports.found is True
    expect(reports, "sqrt", "sqrt-under-vmap")
    expect(jax.tree.map(lambda leaf: leaf[2], reports), "log", "log-under-vmap")
    assert jax.tree.map(lambda leaf: leaf[0], reports).found is False
    # The lowest batch index that found one, whatever the others found.
    _, reports = jax.vmap(find_nans(f))(jnp.array([4.0, 0.0, -1.0]))
    expect(reports, "log", "log-under-vmap")
    assert "primitive=log" in repr(reports)
    _, nothing = jax.vmap(find_nans(f))(jnp.array([4.0, 9.0]))
    assert nothing.found is False and nothing.iteration is None


def test_grad_through_checked_function():
    def f(x):
        return jnp.sqrt(x) * 2.0  # sqrt-under-grad

    grad, report = jax.grad(find_nans(f), has_aux=True)(jnp.float32(-4.0))
    assert jnp.isnan(grad)
    expect(report, "sqrt", "sqrt-under-grad")


# ------------------------------------------------------------ report="reaching"
#
# Libraries make NaNs and Infs on purpose and throw them away with a `where`, a
# mask or an overwrite. report="reaching" (the default) reports only a NaN/Inf
# that is still there in an output, at the equation that made it;
# report="first" reports the first one made anywhere. checkify's nan_checks is
# the reference for "first": it reports every NaN made, discarded or not.


def checkify_error(fn, *args):
    """checkify's nan_checks message for `fn(*args)` (jitted), or None."""
    from jax.experimental import checkify

    error, _ = jax.jit(checkify.checkify(fn, errors=checkify.nan_checks))(*args)
    return error.get()


def safe_mask(mask, fn, operand, placeholder=0.0):
    # jax-md's pattern: fn sees a harmless value where masked, and its result
    # there is replaced. Here fn(0) is an Inf that never leaves.
    masked = jnp.where(mask, operand, 0.0)
    return jnp.where(mask, fn(masked), placeholder)


def test_safe_mask_discards_its_inf():
    def energy(r):
        return safe_mask(r > 0, lambda d: 1.0 / d**6, r).sum()  # safe-mask-div

    r = jnp.array([1.0, 0.0, 2.0])
    assert report_of(energy, r).found is False
    first = report_of(energy, r, report="first")
    expect(first, "div", "safe-mask-div", kind="inf")


def test_safe_mask_with_a_real_nan_elsewhere():
    def energy(r, scale):
        e = safe_mask(r > 0, lambda d: 1.0 / d**6, r).sum()
        return e * jnp.sqrt(scale)  # real-sqrt-nan

    report = report_of(energy, jnp.array([1.0, 0.0]), jnp.float32(-1.0))
    expect(report, "sqrt", "real-sqrt-nan")


def test_double_where_is_quiet_also_under_grad():
    def safe_log(x):
        return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), 0.0).sum()

    x = jnp.array([1.0, 0.0, -2.0])
    assert report_of(safe_log, x).found is False
    assert report_of(jax.grad(safe_log), x).found is False
    assert checkify_error(jax.grad(safe_log), x) is None


def test_naive_where_value_is_quiet_but_its_gradient_is_reported():
    def naive_log(x):
        return jnp.where(x > 0, jnp.log(x), 0.0).sum()  # naive-where-log

    x = jnp.array([1.0, -2.0])
    # The value: log(-2) is NaN but the where drops it. checkify reports it
    # (kups differs on purpose: nothing non-finite leaves the function).
    assert report_of(naive_log, x).found is False
    assert "nan generated by primitive: log" in checkify_error(naive_log, x)
    expect(report_of(naive_log, x, report="first"), "log", "naive-where-log")
    # The gradient: the where's transpose sends a zero cotangent to log's
    # derivative, 0 / -2 is fine, but at x = 0 it is 0 / 0, a NaN that reaches
    # the gradient. It is made by log's derivative, at the line of the log.
    grad = jax.grad(naive_log)
    x0 = jnp.array([1.0, 0.0])
    assert np.isnan(np.asarray(grad(x0))[1])
    expect(report_of(grad, x0), "div", "naive-where-log")
    assert report_of(grad, x).found is False


def _overwrite_dus(x):
    buf = 1.0 / (x * 0.0)  # inf, every element overwritten
    return lax.dynamic_update_slice(buf, jnp.sqrt(x - 5.0), (0,))  # kept-by-dus


def _overwrite_scatter(x):
    buf = 1.0 / (x * 0.0)  # inf, every element overwritten
    return buf.at[jnp.arange(2)].set(jnp.sqrt(x - 5.0))  # kept-by-scatter


def _where_both_sides(x):
    dropped = 1.0 / (x * 0.0)  # inf, never taken
    return jnp.where(x > 0, jnp.sqrt(x - 5.0), dropped)  # kept-by-where


@pytest.mark.parametrize(
    ("fn", "marker"),
    [
        (_overwrite_dus, "kept-by-dus"),
        (_overwrite_scatter, "kept-by-scatter"),
        (_where_both_sides, "kept-by-where"),
    ],
)
def test_an_input_whose_infs_do_not_survive_gives_no_origin(fn, marker):
    # The Inf is older than the NaN, but none of its elements reach the output.
    expect(report_of(fn, jnp.ones(2)), "sqrt", marker)


def test_a_constant_buffer_carried_through_a_loop_then_overwritten():
    # The Inf buffer holds a NaN/Inf of no site (a constant carried by the loop);
    # the write after the loop replaces all of it, so the NaN written is what
    # reaches, not the buffer (diffrax's saved outputs, constant steps).
    def f(x):
        def body(carry):
            i, y, buf = carry
            return i + 1, jnp.sqrt(y - 1.5), jnp.copy(buf)  # carried-sqrt

        buf = jnp.full((1, 2), jnp.inf)
        _, y, buf = lax.while_loop(lambda c: c[0] < 3, body, (0, x, buf))
        return lax.dynamic_update_slice(buf, y[None], (0, 0))

    # Iteration 0 is finite (sqrt(1.5)); iteration 1 makes the NaN.
    expect(report_of(f, jnp.full((2,), 3.0)), "sqrt", "carried-sqrt", iterations=[1])


def test_a_constant_inf_is_named_where_the_program_writes_it():
    def fill_then_write(x):
        buf = jnp.full((4,), jnp.inf)  # inf-fill
        return buf.at[:2].set(x[:2])

    expect(report_of(fill_then_write, jnp.ones(4)), "broadcast_in_dim", "inf-fill", kind="inf")
    # The first report does not check constants: the scatter is where the fill
    # first meets data.
    first = report_of(fill_then_write, jnp.ones(4), report="first")
    assert (first.kind, first.primitive) == ("inf", "scatter")


def test_an_output_written_in_parts_names_only_the_parts_that_are_not_finite():
    # Every element of the Inf fill (or of the log's -Inf) is overwritten; the
    # NaN of the first part reaches, not the fill.
    def two_sets(x):
        buf = jnp.full((4,), jnp.inf)
        buf = buf.at[:2].set(jnp.sqrt(x[:2] - 5.0))  # first-part-nan
        return buf.at[2:].set(x[2:] * 2.0)

    def two_updates(x):
        buf = jnp.log(x - 1.0)
        buf = lax.dynamic_update_slice(buf, jnp.sqrt(x[:2] - 5.0), (0,))  # updated-nan
        return lax.dynamic_update_slice(buf, jnp.exp(x[2:]), (2,))

    def rows(x):
        buf = jnp.full((3, 2), jnp.inf)
        first = jnp.sqrt(x[:2] - 5.0)  # row-zero-nan
        return buf.at[0].set(first).at[1].set(x[:2] + 1.0).at[2].set(x[2:] + 1.0)

    x = jnp.ones(4)
    expect(report_of(two_sets, x), "sqrt", "first-part-nan")
    expect(report_of(two_updates, x), "sqrt", "updated-nan")
    expect(report_of(rows, x), "sqrt", "row-zero-nan")


def test_a_masked_minus_inf_that_never_reaches_is_quiet():
    def masked_softmax(x):
        logits = jnp.where(jnp.arange(4) < 2, x, -jnp.inf)
        return jax.nn.softmax(logits)

    assert report_of(masked_softmax, jnp.ones(4)).found is False


def test_partly_overwritten_operand_keeps_its_origin():
    def f(x):
        buf = 1.0 / (x * 0.0)  # partly-kept-inf
        return lax.dynamic_update_slice(buf, jnp.sqrt(x[:1] - 5.0), (0,))

    expect(report_of(f, jnp.ones(2)), "div", "partly-kept-inf", kind="inf")


def _halves(x):
    """An Inf half (older) and a NaN half, side by side."""
    return jnp.concatenate([1.0 / (x * 0.0), jnp.sqrt(x - 5.0)])  # halves-nan


def _half_rows(x):
    inf = jnp.broadcast_to(1.0 / (x * 0.0), (2, 2))
    nan = jnp.broadcast_to(jnp.sqrt(x - 5.0), (2, 2))  # rows-nan
    return jnp.concatenate([inf, nan], axis=1)  # (2, 4): Inf columns, then NaN


def _padded_with_nan(x):
    return lax.pad(1.0 / (x * 0.0), jnp.sqrt(x[0] - 5.0), [(2, 0, 0)])  # pad-nan


def _inf_buffer(x):
    return 1.0 / (jnp.concatenate([x, x]) * 0.0)


def _nan_of(x):
    return jnp.sqrt(x - 5.0)  # scatter-nan


# Each moves the NaN half into what it keeps and drops the Inf half.
_PIECE_MOVES = {
    "slice": lambda x: _halves(x)[2:],
    "slice with a stride": lambda x: _halves(x)[3::2],
    "dynamic_slice": lambda x: lax.dynamic_slice(_halves(x), (2,), (2,)),
    "index (slice, squeeze)": lambda x: _halves(x)[3],
    "rev (jnp.flip, a jit)": lambda x: jnp.flip(_halves(x))[:2],
    "neg then slice": lambda x: (-_halves(x))[2:],
    "transpose": lambda x: _half_rows(x).T[2:],
    "broadcast_in_dim": lambda x: jnp.broadcast_to(_halves(x), (3, 4))[:, 2:],
    "concatenate of pieces": lambda x: jnp.concatenate([_halves(x), x * 2.0])[2:4],
    "pad": lambda x: _padded_with_nan(x)[:2],
    "reshape (split)": lambda x: _halves(x).reshape(2, 2)[1],
    "reshape (merge)": lambda x: jnp.stack([_halves(x)[:2], _halves(x)[2:]]).reshape(4)[2:],
    "select_n (where)": lambda x: jnp.where(jnp.arange(4) < 9, _halves(x), jnp.sin(x[0]))[2:],
    "where with a constant": lambda x: jnp.where(jnp.arange(4) < 9, _halves(x), 0.0)[2:],
    "where with an argument": lambda x: jnp.where(
        jnp.arange(4) < 9, _halves(x), jnp.concatenate([x, x])
    )[2:],
    "reduce_max (another axis)": lambda x: _half_rows(x).max(axis=0)[2:],
    "sort (another axis)": lambda x: jnp.sort(_half_rows(x), axis=0)[:, 2:],
    "cummax (another axis)": lambda x: lax.cummax(_half_rows(x), axis=0)[:, 2:],
    "gather (x[indices])": lambda x: _halves(x)[jnp.array([2, 3])],
    "gather in fill mode (jnp.take)": lambda x: jnp.take(
        _halves(x), jnp.array([3, 2]), mode="fill"
    ),
    "gather of rows": lambda x: _half_rows(x).T[jnp.array([3, 2])],
    "dynamic_slice at a traced index": lambda x: lax.dynamic_slice(
        _halves(x), (jnp.argmax(x) + 2,), (2,)
    ),
    "index at a traced position": lambda x: _halves(x)[jnp.argmax(x) + 3],
    "arithmetic": lambda x: (_halves(x) * 2.0 + 1.0)[2:],
    "arithmetic of two arrays of parts": lambda x: (_halves(x) - jnp.exp(_halves(x)))[2:],
    "exp": lambda x: jnp.exp(_halves(x))[2:],
    "convert to a wider float": lambda x: _halves(x.astype(jnp.bfloat16)).astype(jnp.float32)[2:],
    "cumsum along the axis": lambda x: jnp.cumsum(jnp.flip(_halves(x)))[:2],
    "cumsum along the axis, in reverse": lambda x: lax.cumsum(_halves(x), reverse=True)[2:],
    "cummax along the axis": lambda x: lax.cummax(jnp.flip(_halves(x)))[:2],
    "cumprod (another axis)": lambda x: jnp.cumprod(_half_rows(x), axis=0)[:, 2:],
    "reduce_sum (another axis)": lambda x: _half_rows(x).sum(axis=0)[2:],
    "scatter of a range (.at[2:].set)": lambda x: _inf_buffer(x).at[2:].set(_nan_of(x))[2:],
    "scatter of an element (.at[3].set)": lambda x: _inf_buffer(x).at[3].set(_nan_of(x)[0])[3],
    "scatter of a row (.at[1].set)": lambda x: (
        _inf_buffer(x).reshape(2, 2).at[1].set(_nan_of(x))[1]
    ),
    "scatter of a column (.at[:, 1:].set)": lambda x: (
        _inf_buffer(x).reshape(2, 2).at[:, 1:].set(_nan_of(x)[:, None])[:, 1]
    ),
    "scatter out of range (dropped)": lambda x: _halves(x).at[7].set(1.0)[2:],
}


@pytest.mark.parametrize("move", sorted(_PIECE_MOVES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_slice_takes_the_origins_of_the_parts_it_keeps(move, jit):
    fn = _PIECE_MOVES[move]
    fn = jax.jit(fn) if jit else fn
    rows = move == "transpose" or "another axis" in move or "rows" in move
    marker = "pad-nan" if move == "pad" else "rows-nan" if rows else "halves-nan"
    if move.startswith("scatter") and "dropped" not in move:
        marker = "scatter-nan"
    out = fn(jnp.ones(2))
    assert np.isnan(np.asarray(out)).all()
    expect(report_of(fn, jnp.ones(2)), "sqrt", marker)


def _stacked(x, reverse=False):
    """A scan whose iterations 0 and 1 output Inf rows, 2 and 3 NaN rows."""

    def step(c, i):
        inf = 1.0 / (c * 0.0)  # row-inf
        nan = jnp.sqrt(c - 5.0)  # row-nan
        return c, jnp.where(i < 2, inf, nan)

    return lax.scan(step, x, jnp.arange(4), reverse=reverse)[1]


# Each keeps NaN rows only: (read, the iteration of the earliest NaN row kept).
_ROW_READS = {
    "slice": (lambda x, i: _stacked(x)[2:], 2),
    "index": (lambda x, i: _stacked(x)[3], 3),
    "negative index": (lambda x, i: _stacked(x)[-2], 2),
    "strided slice": (lambda x, i: _stacked(x)[3:1:-1], 2),
    "dynamic_slice at a traced index": (
        lambda x, i: lax.dynamic_slice(_stacked(x), (i, 0), (2, 2)),
        2,
    ),
    "index at a traced index": (lambda x, i: _stacked(x)[i + 1], 3),
    "gather (ys[indices])": (lambda x, i: _stacked(x)[jnp.stack([i + 1, i])], 2),
    # Reversed, iteration 3 runs first.
    "reverse scan": (lambda x, i: _stacked(x, reverse=True)[2:], 3),
    "slice of a column": (lambda x, i: _stacked(x)[2:, :1], 2),
}


@pytest.mark.parametrize("read", sorted(_ROW_READS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_slice_of_a_scan_output_takes_the_rows_it_keeps(read, jit):
    fn, iteration = _ROW_READS[read]
    fn = jax.jit(fn) if jit else fn
    args = (jnp.ones(2), jnp.int32(2))
    assert np.isnan(np.asarray(fn(*args))).all()
    expect(report_of(fn, *args), "sqrt", "row-nan", iterations=[iteration])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_rows_of_a_scan_output_keep_their_iterations(jit):
    wrap = jax.jit if jit else (lambda f: f)
    x = jnp.ones(2)
    # The whole output, and slices that keep an Inf row, name the earliest Inf
    # row they keep.
    for keeps_an_inf, row in (
        (_stacked, 0),
        (lambda x: _stacked(x)[1:3], 1),
        (lambda x: _stacked(x)[:2], 0),
        (lambda x: _stacked(x)[1], 1),
    ):
        expect(report_of(wrap(keeps_an_inf), x), "div", "row-inf", kind="inf", iterations=[row])
    # NaNs only: the first NaN row, even with the Inf rows kept.
    nans = find_nans(wrap(lambda x: _stacked(x)[1:]), kinds=("nan",))(x)[1]
    expect(nans, "sqrt", "row-nan", iterations=[2])

    # Rows the slice drops are not reported when what it keeps is finite.
    def finite_rows(x):
        ys = lax.scan(lambda c, i: (c, jnp.where(i < 2, jnp.sqrt(c - 5.0), c)), x, jnp.arange(4))[1]
        return ys[2:]

    assert report_of(wrap(finite_rows), x).found is False


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_narrowing_convert_of_a_scan_output_names_the_inf_it_makes(jit):
    # The rows are finite in float32; float16 overflows them. The slice keeps
    # rows the convert made Inf: it names the convert (rows must not pass
    # through a narrowing cast as they were).
    def f(x):
        ys = lax.scan(lambda c, i: (c, c * 1e6 * i), x, jnp.arange(4.0))[1]
        return ys.astype(jnp.float16)[2:]  # narrowing-rows

    fn = jax.jit(f) if jit else f
    assert np.isinf(np.asarray(fn(jnp.ones(2)))).all()
    expect(report_of(fn, jnp.ones(2)), "convert_element_type", "narrowing-rows", kind="inf")


def test_the_rows_of_a_nested_scan_output_keep_both_iterations():
    # The inner scan's rows, sliced inside the outer body: the NaN row of outer
    # iteration 1 at inner iteration 2 is the one kept.
    def f(x):
        def outer(c, j):
            return c, _stacked(c + j)[2:].sum()

        return lax.scan(outer, x, jnp.arange(3.0))[1][1:]

    expect(report_of(f, jnp.ones(2)), "sqrt", "row-nan", iterations=[1, 2])


def test_a_scan_longer_than_the_row_limit_merges_its_rows(monkeypatch):
    # Past MAX_ROWS the stacked output has one origin, the earliest row's.
    import kups.debug._taint_control as control

    monkeypatch.setattr(control, "MAX_ROWS", 3)
    expect(
        report_of(lambda x: _stacked(x)[2:], jnp.ones(2)),
        "div",
        "row-inf",
        kind="inf",
        iterations=[0],
    )


def _nan_row(x):
    return jnp.sqrt(x - 5.0)  # written-nan


def _inf_rows():
    return jnp.full((4, 2), jnp.inf)  # buffer-fill


def _row_body(x):
    """Writes a NaN row at index `i`."""

    def write(i, buf):
        return buf.at[i].set(_nan_row(x))

    return write


def _checkpointed(x, buffers):
    def body(c):
        i, buf = c
        return i + 1, _row_body(x)(i, buf)

    return eqxi.while_loop(
        lambda c: c[0] < 2,
        body,
        (0, _inf_rows()),
        kind="checkpointed",
        max_steps=4,
        buffers=buffers,
    )[1]


# Each fills a (4, 2) buffer with Inf, then a loop writes NaN rows 0 and 1.
_ROW_WRITERS = {
    "fori_loop (a scan)": lambda x: lax.fori_loop(0, 2, _row_body(x), _inf_rows()),
    "while_loop": lambda x: lax.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, _row_body(x)(c[0], c[1])), (0, _inf_rows())
    )[1],
    "dynamic_update_slice": lambda x: lax.fori_loop(
        0, 2, lambda i, buf: lax.dynamic_update_slice(buf, _nan_row(x)[None], (i, 0)), _inf_rows()
    ),
    "a jit around the write": lambda x: lax.fori_loop(
        0, 2, lambda i, buf: jax.jit(_row_body(x))(i, buf), _inf_rows()
    ),
    "an inner loop writes the row": lambda x: lax.fori_loop(
        0, 2, lambda i, buf: lax.fori_loop(i, i + 1, _row_body(x), buf), _inf_rows()
    ),
    "a cond around the write": lambda x: lax.fori_loop(
        0,
        4,
        lambda i, buf: lax.cond(i < 2, _row_body(x), lambda i, buf: buf, i, buf),
        _inf_rows(),
    ),
    "equinox checkpointed while_loop": lambda x: _checkpointed(x, None),
    "equinox buffers (maybe_set)": lambda x: _checkpointed(x, lambda c: c[1]),
}


# Every writer eagerly; under `jax.jit` (a `jit` equation around the loop, the
# same for every writer) two of them, a scan and a while loop.
_ROW_CASES = [
    *((writer, False) for writer in sorted(_ROW_WRITERS)),
    ("fori_loop (a scan)", True),
    ("equinox buffers (maybe_set)", True),
]


@pytest.mark.parametrize(
    "writer, jit", _ROW_CASES, ids=[f"{'jit' if j else 'eager'}-{w}" for w, j in _ROW_CASES]
)
def test_a_buffer_a_loop_writes_row_by_row_keeps_each_rows_origin(writer, jit):
    buffer = _ROW_WRITERS[writer]
    wrap = jax.jit if jit else (lambda f: f)
    x = jnp.ones(2)
    inner = [0] if "inner loop" in writer else []  # the inner loop's one iteration
    # The rows written: the NaN of the first write, not the older Inf fill.
    first = report_of(wrap(lambda x: buffer(x)[:2]), x)
    expect(first, "sqrt", "written-nan", iterations=[0, *inner])
    second = report_of(wrap(lambda x: buffer(x)[1]), x)
    expect(second, "sqrt", "written-nan", iterations=[1, *inner])
    # The rows left: the fill; the whole buffer: the fill, which came first.
    for keeps_the_fill in (lambda x: buffer(x)[2:], buffer):
        report = report_of(wrap(keeps_the_fill), x)
        expect(report, "broadcast_in_dim", "buffer-fill", kind="inf")


_RUN_TIME_WRITES = {
    "scatter (.at[i].set)": lambda buf, row, i: buf.at[i].set(row),
    "dynamic_update_slice": lambda buf, row, i: lax.dynamic_update_slice(buf, row[None], (i, 0)),
    "scatter in clip mode": lambda buf, row, i: buf.at[i].set(row, mode="clip"),
}


@pytest.mark.parametrize("write", sorted(_RUN_TIME_WRITES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_row_written_at_a_run_time_index_keeps_its_origin(write, jit):
    # An Inf buffer with a NaN row written at index i (traced): reading row i
    # names the NaN, another row the Inf; an index out of range drops the write
    # (or clips it to the last row).
    def written(x, i):
        return _RUN_TIME_WRITES[write](_inf_rows() * x[0], _nan_row(x), i)

    wrap = jax.jit if jit else (lambda f: f)
    x = jnp.ones(2)
    at = wrap(lambda x, i: written(x, i)[i])
    expect(report_of(at, x, jnp.int32(1)), "sqrt", "written-nan")
    below = wrap(lambda x, i: written(x, i)[i + 1])
    expect(report_of(below, x, jnp.int32(1)), "broadcast_in_dim", "buffer-fill", kind="inf")
    last = wrap(lambda x, i: written(x, i)[3])
    outside = report_of(last, x, jnp.int32(9))
    if write == "scatter (.at[i].set)":  # dropped: the last row is the buffer's
        expect(outside, "broadcast_in_dim", "buffer-fill", kind="inf")
    else:  # clamped to the last row
        expect(outside, "sqrt", "written-nan")


def test_a_buffer_a_loop_also_rescales_keeps_one_origin():
    # Not only written by rows: every row of the carry changes at each
    # iteration, so the buffer keeps one origin, its fill's (docs/effects/debug.md).
    def f(x):
        body = lambda i, buf: _row_body(x)(i, buf * 1.0)  # noqa: E731
        return lax.fori_loop(0, 2, body, _inf_rows())[:2]

    expect(report_of(f, jnp.ones(2)), "broadcast_in_dim", "buffer-fill", kind="inf")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_slice_that_keeps_both_parts_takes_the_earliest(jit):
    def keeps_the_inf(x):
        return _halves(x)[:2]

    def keeps_both(x):
        return _halves(x)[1:3]

    def drops_both(x):
        return jnp.where(jnp.isfinite(_halves(x)), 0.0, 1.0)[1:3]

    wrap = jax.jit if jit else (lambda f: f)
    expect(report_of(wrap(keeps_the_inf), jnp.ones(2)), "div", "halves-nan", kind="inf")
    expect(report_of(wrap(keeps_both), jnp.ones(2)), "div", "halves-nan", kind="inf")
    assert report_of(wrap(drops_both), jnp.ones(2)).found is False


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_slice_of_an_update_takes_the_part_it_keeps(jit):
    # An Inf buffer with a NaN written into its second half: the slice of the
    # second half names the update, the slice of the first half the buffer.
    def buffer(x):
        buf = 1.0 / (jnp.concatenate([x, x]) * 0.0)  # buffer-inf
        return lax.dynamic_update_slice(buf, jnp.sqrt(x - 5.0), (2,))  # update-nan

    def second(x):
        return buffer(x)[2:]

    def first(x):
        return buffer(x)[:2]

    def around(x):
        return jnp.flip(buffer(x))[1:3]  # one of each: the buffer's is older

    wrap = jax.jit if jit else (lambda f: f)
    expect(report_of(wrap(second), jnp.ones(2)), "sqrt", "update-nan")
    expect(report_of(wrap(first), jnp.ones(2)), "div", "buffer-inf", kind="inf")
    expect(report_of(wrap(around), jnp.ones(2)), "div", "buffer-inf", kind="inf")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_where_that_drops_the_parts_and_takes_a_constant_nan(jit):
    # The where takes the constant NaN where the NaN half was: the slice names
    # the where (the constant meets the data there), not the dropped sqrt.
    def f(x):
        return jnp.where(jnp.arange(4) < 2, _halves(x), jnp.nan)[2:]  # where-nan

    fn = jax.jit(f) if jit else f
    expect(report_of(fn, jnp.ones(2)), "select_n", "where-nan")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_where_names_the_side_it_takes_in_the_part_kept(jit):
    # Both sides are NaN in the second half; the where takes the other side
    # there, so the slice names that side's sqrt, not the older one it dropped.
    def f(x):
        both = _halves(x)
        other = jnp.broadcast_to(jnp.sqrt(x[0] - 9.0), (4,))  # other-nan
        return jnp.where(jnp.arange(4) < 2, both, other)[2:]

    fn = jax.jit(f) if jit else f
    expect(report_of(fn, jnp.ones(2)), "sqrt", "other-nan")


@pytest.mark.parametrize("parts", [3, 8, 9, 40])
def test_arithmetic_keeps_at_most_eight_parts(parts):
    # An array of many parts (a pytree flattened by ravel_pytree) would cost a
    # check per part at every elementwise equation: past eight, it follows the
    # array's origin.
    def f(x):
        first = 1.0 / (x * 0.0)  # many-inf
        rest = [jnp.sin(x) * i for i in range(parts - 2)]
        nan = jnp.sqrt(x - 5.0)  # many-nan
        return (jnp.concatenate([first, *rest, nan]) * 2.0)[-2:]

    found = report_of(jax.jit(f), jnp.ones(2))
    if parts <= 8:
        expect(found, "sqrt", "many-nan")
    else:
        expect(found, "div", "many-inf", kind="inf")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_arithmetic_on_parts_names_the_inf_it_makes_in_the_part_kept(jit):
    # The multiplication overflows the finite part: the slice keeping it names
    # the multiplication, not the NaN of the part it dropped.
    def f(x):
        parts = jnp.concatenate([x * 1e30, jnp.sqrt(x - 5.0)])
        return (parts * 1e30)[:2]  # overflow-here

    fn = jax.jit(f) if jit else f
    assert np.isinf(np.asarray(fn(jnp.ones(2)))).all()
    expect(report_of(fn, jnp.ones(2)), "mul", "overflow-here", kind="inf")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_cumsum_of_parts_names_the_inf_it_makes_in_the_part_kept(jit):
    # The running sum overflows in the finite part, before the NaN part: the
    # slice keeping the first part names the cumsum; the second part keeps the
    # older NaN of the sqrt.
    def first(x):
        parts = jnp.concatenate([x * 3e38, jnp.sqrt(x - 5.0)])  # parts-sqrt
        return jnp.cumsum(parts)[:2]  # cumsum-overflow

    def second(x):
        return jnp.cumsum(jnp.concatenate([x * 3e38, jnp.sqrt(x - 5.0)]))[2:]  # sqrt-kept

    wrap = jax.jit if jit else (lambda f: f)
    assert np.isinf(np.asarray(wrap(first)(jnp.ones(2)))[1])
    expect(report_of(wrap(first), jnp.ones(2)), "cumsum", "cumsum-overflow", kind="inf")
    expect(report_of(wrap(second), jnp.ones(2)), "sqrt", "sqrt-kept")


@pytest.mark.parametrize(
    "fn",
    [
        lambda: jnp.arange(6).reshape(2, 3) * 2 - 1,
        lambda: jnp.broadcast_to(jnp.arange(3), (2, 3)).T.reshape(6)[::-1],
        lambda: jnp.where(jnp.arange(5) < 2, jnp.arange(5), -jnp.arange(5)),
        lambda: jnp.concatenate([jnp.arange(3), jnp.full((2,), 7)]).astype(jnp.int8),
        lambda: jnp.clip(jnp.arange(6), 1, 4) + (jnp.arange(6) % 2 == 0),
        lambda: jnp.maximum(jnp.arange(4), 2) * jnp.minimum(jnp.arange(4), 1),
        lambda: jnp.squeeze(jnp.arange(3)[None, :] >= 1) & (jnp.arange(3) != 2),
        lambda: jnp.int32(2**31 - 1) + jnp.arange(3, dtype=jnp.int32),
        lambda: lax.select_n(jnp.arange(4) < 2, jnp.arange(4), jnp.arange(4) * 3),
        lambda: lax.clamp(1, jnp.arange(5), 3),
    ],
)
def test_integers_known_while_tracing_are_those_jax_computes(fn):
    # find_nans evaluates the integers a program computes from its literals
    # alone with NumPy while tracing (for the indices of `x.at[2:].set(v)`
    # under jit): each equation's value must be JAX's.
    from kups.debug._taint_known import known_outputs

    closed = jax.make_jaxpr(fn)()
    env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    evaluated = 0
    for eqn in closed.jaxpr.eqns:
        values = [v.val if isinstance(v, jax.extend.core.Literal) else env[v] for v in eqn.invars]
        expected = eqn.primitive.bind(*values, **eqn.params)
        expected = expected[0] if eqn.primitive.multiple_results else expected
        env[eqn.outvars[0]] = np.asarray(expected)
        got = known_outputs(eqn, values)
        if got is not None:
            evaluated += 1
            np.testing.assert_array_equal(got, np.asarray(expected))
            assert got.dtype == np.asarray(expected).dtype
    assert evaluated >= 2


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_narrowing_convert_of_parts_names_the_inf_it_makes(jit):
    # Converting to float16 overflows the finite part: the slice keeping it
    # names the convert (before, the parts passed through the cast as they
    # were, and the report said nothing reached).
    def f(x):
        parts = jnp.concatenate([x * 1e6, jnp.sqrt(x - 5.0)])
        return parts.astype(jnp.float16)[:2]  # narrowing-convert

    fn = jax.jit(f) if jit else f
    assert np.isinf(np.asarray(fn(jnp.ones(2)))).all()
    expect(report_of(fn, jnp.ones(2)), "convert_element_type", "narrowing-convert", kind="inf")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_gather_at_run_time_indices_takes_the_parts_it_picks(jit):
    # The indices are data: the gather picks the NaN half for one input and the
    # Inf half for another.
    def f(x, i):
        return _halves(x)[jnp.stack([i, i + 1])]

    fn = jax.jit(f) if jit else f
    expect(report_of(fn, jnp.ones(2), jnp.int32(2)), "sqrt", "halves-nan")
    expect(report_of(fn, jnp.ones(2), jnp.int32(0)), "div", "halves-nan", kind="inf")

    # Out of range in fill mode, the gather itself makes the NaN.
    def g(x, i):
        return jnp.take(_halves(x), jnp.stack([i, i]), mode="fill")  # fill-nan

    expect(report_of(jax.jit(g) if jit else g, jnp.ones(2), jnp.int32(9)), "gather", "fill-nan")


def test_inf_filled_buffer_overwritten_in_a_loop():
    # diffrax-style output buffer: filled with Inf, every row overwritten.
    def solve(xs):
        buffer = jnp.full(xs.shape, jnp.inf)

        def body(i, buffer):
            row = jnp.sin(xs[i])[None]
            return lax.dynamic_update_slice(buffer, row, (i,))  # overwrite-inf

        return lax.fori_loop(0, xs.shape[0], body, buffer)

    xs = jnp.arange(5.0)
    assert report_of(solve, xs).found is False
    expect(
        report_of(solve, xs, report="first"),
        "dynamic_update_slice",
        "overwrite-inf",
        kind="inf",
        iterations=[0],
    )

    def partial(xs):
        buffer = jnp.full((xs.shape[0] + 1,), jnp.inf)  # partial-inf-fill

        def body(i, b):
            return lax.dynamic_update_slice(b, xs[i][None], (i,))

        return lax.fori_loop(0, xs.shape[0], body, buffer)

    # One row left unwritten: the fill's Inf reaches the output, named at the
    # line that writes it (not at the overwrite that only moves it).
    report = report_of(partial, xs)
    expect(report, "broadcast_in_dim", "partial-inf-fill", kind="inf")


def mlp_train(params, xs, ys):
    """100 SGD steps of a small MLP in a scan; the loss is masked where the
    target is missing (NaN), as a library would."""

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        out = h @ p["w2"]
        missing = jnp.isnan(y)
        err = jnp.where(missing, 0.0, out - y) ** 2  # masked-loss
        return err.sum() + jnp.sqrt(x[0, 0] + 1.0).sum() * 0.0  # sqrt-of-input

    def step(p, xy):
        value, grads = jax.value_and_grad(loss)(p, *xy)
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads), value

    return lax.scan(step, params, (xs, ys))


def mlp_data(bad_step=None):
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w1": jax.random.normal(key1, (3, 8)) * 0.3,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(key2, (8, 1)) * 0.3,
    }
    xs = jnp.ones((100, 4, 3)) * 0.5
    ys = jnp.zeros((100, 4, 1)).at[:, 0, 0].set(jnp.nan)  # a missing target every step
    if bad_step is not None:
        xs = xs.at[bad_step, 0, 0].set(-3.0)
    return params, xs, ys


def test_nan_made_at_scan_step_37_is_reported_with_its_iteration():
    params, xs, ys = mlp_data(bad_step=37)
    report = report_of(mlp_train, params, xs, ys)
    # sqrt(-2) * 0.0 is NaN (not forgotten: NaN * 0 is NaN); it reaches the loss
    # and the parameters from step 37 on.
    expect(report, "sqrt", "sqrt-of-input", iterations=[37])
    # "first" and checkify stop at the missing target of step 0, which the where
    # discards.
    first = report_of(mlp_train, params, xs, ys, report="first")
    assert first.iteration == (0,) and first.primitive == "sub"
    assert "nan generated by primitive: sub" in checkify_error(mlp_train, params, xs, ys)


def test_masked_missing_targets_are_quiet():
    params, xs, ys = mlp_data()
    assert report_of(mlp_train, params, xs, ys).found is False
    assert checkify_error(mlp_train, params, xs, ys) is not None


def test_same_line_discarded_early_and_kept_later():
    # The same log makes an Inf that the where drops at every step, and at step
    # 6 a NaN that it keeps: the report is step 6, not step 0.
    def f(xs):
        def body(total, x):
            y = jnp.log(x)  # log-discarded-then-kept
            return total + jnp.where(x == 0.0, 0.0, y).sum(), None

        return lax.scan(body, 0.0, xs)[0]

    xs = jnp.ones((10, 3)).at[:, 1].set(0.0).at[6, 2].set(-1.0)
    expect(report_of(f, xs), "log", "log-discarded-then-kept", iterations=[6])
    expect(
        report_of(f, xs, report="first"),
        "log",
        "log-discarded-then-kept",
        kind="inf",
        iterations=[0],
    )


def test_carried_nan_wins_over_a_later_one():
    def f(xs):
        def body(carry, x):
            return carry + jnp.log(x), jnp.sqrt(x)  # log-carried # sqrt-later

        return lax.scan(body, 0.0, xs)

    # log(-1) at step 2 enters the carry; sqrt(-1) makes ys NaN at step 2 too,
    # but log comes first in the body; sqrt of step 4 alone comes later.
    xs = jnp.ones(6).at[2].set(-1.0)
    expect(report_of(f, xs), "log", "log-carried # sqrt-later", iterations=[2])


def test_while_loop_carries_the_iteration():
    def f(x):
        def body(state):
            i, v, total = state
            v = v - 1.0
            dropped = jnp.where(v < -100.0, jnp.log(v), 0.0)  # log-dropped-in-while
            return i + 1, v, total + dropped + jnp.log(v + 1.0)  # log-in-while-body

        return lax.while_loop(lambda s: s[0] < 6, body, (0, x, 0.0))[2]

    # v after the decrement: 3, 2, 1, 0, -1, -2. The where drops log(0) = -inf at
    # iteration 3; log(v + 1) = log(0) = -inf at iteration 4 enters the carry.
    x = jnp.float32(4.0)
    expect(report_of(f, x), "log", "log-in-while-body", kind="inf", iterations=[4])
    first = report_of(f, x, report="first")
    expect(first, "log", "log-dropped-in-while", kind="inf", iterations=[3])


def test_discarded_inside_jit_and_cond():
    @jax.jit
    def inner(x):
        return jnp.where(x > 0, jnp.log(x), 0.0)

    def f(p, x):
        y = lax.cond(p, inner, lambda x: jnp.sqrt(x), x)  # sqrt-branch
        return y * 2.0

    x = jnp.array([2.0, -1.0])
    assert report_of(f, jnp.bool_(True), x).found is False
    assert report_of(f, jnp.bool_(True), x, report="first").primitive == "log"
    expect(report_of(f, jnp.bool_(False), x), "sqrt", "sqrt-branch")


def test_nan_discarded_after_the_cond_that_made_it():
    def f(p, x):
        y = lax.cond(p, jnp.log, jnp.exp, x)
        return jnp.where(jnp.isnan(y), 1.0, y)

    assert report_of(f, jnp.bool_(True), jnp.array([-1.0, 2.0])).found is False


def test_shard_map_discarded_on_every_shard_and_real_on_one(mesh8):
    def body(a):
        kept = jnp.sqrt(a - 1.0)  # sqrt-kept-in-shard
        dropped = jnp.where(a > 0, jnp.log(a), 0.0)
        return kept + dropped

    def f(x):
        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.full(16, 2.0).at[1::2].set(-1.0)
    x = jnp.where(jnp.arange(16) == 11, 2.0, x)
    # Every shard's second element is negative: the log's NaN is dropped, but
    # sqrt(-2) is kept... on every shard; the first shard wins the tie.
    report = report_of(f, x)
    expect(report, "sqrt", "sqrt-kept-in-shard", shard={"i": 0})
    # Only shard 5 keeps one.
    x = jnp.full(16, 2.0).at[10].set(0.5)
    expect(report_of(f, x), "sqrt", "sqrt-kept-in-shard", shard={"i": 5})
    assert report_of(f, jnp.full(16, 2.0).at[3].set(0.0)).found is True
    assert report_of(f, jnp.full(16, 2.0)).found is False


def test_collective_spreads_a_shards_nan_reported_where_made(mesh8):
    def body(a):
        b = jnp.where(a > -5.0, jnp.sqrt(a), 0.0)  # sqrt-before-collective
        total = jax.lax.psum(b.sum(), "i")
        return jnp.ones_like(a) * total

    def f(x):
        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.ones(16).at[13].set(-1.0)
    expect(report_of(f, x), "sqrt", "sqrt-before-collective", shard={"i": 6})
    # Dropped before the psum: nothing reaches.
    assert report_of(f, jnp.ones(16).at[13].set(-9.0)).found is False


def test_nan_in_an_argument_is_reported_at_the_first_equation_using_it():
    def f(x):
        y = jnp.where(x > 0, x, 0.0)  # drops the argument's NaN
        return y * 2.0, x.sum()  # sum-of-arg

    x = jnp.array([1.0, jnp.nan])
    expect(report_of(f, x), "reduce_sum", "sum-of-arg")


# Each takes, moves or negates elements of the argument (index 1 holds the NaN)
# and keeps the NaN; the next equation computes with it. `jnp.where` and `jnp.pad`
# join it to constants known to be finite (a literal broadcast to an array).
_PICKS_OF_AN_ARGUMENT = {
    "slice": lambda x: x[1:3],
    "index": lambda x: x[1],
    "strided slice": lambda x: x[1::2],
    "dynamic_slice": lambda x: lax.dynamic_slice(x, (1,), (2,)),
    "gather": lambda x: x[jnp.array([1, 2])],
    "where with 0.0": lambda x: jnp.where(jnp.arange(4) > 0, x, 0.0),
    "pad": lambda x: jnp.pad(x, 1),
    "written into zeros": lambda x: lax.dynamic_update_slice(jnp.zeros(6), x, (1,)),
    "neg": lambda x: -x,
    "abs": jnp.abs,
    "sort": jnp.sort,
}


@pytest.mark.parametrize("pick", sorted(_PICKS_OF_AN_ARGUMENT))
def test_nan_in_an_argument_is_first_seen_where_it_is_computed_with_not_where_it_is_picked(pick):
    take = _PICKS_OF_AN_ARGUMENT[pick]
    x = jnp.array([1.0, jnp.nan, 3.0, 4.0])

    def f(x):
        return take(x) * 2.0  # computes-with-picked

    for report in ("reaching", "first"):
        expect(report_of(f, x, report=report), "mul", "computes-with-picked")
        # Only picked to the output: no equation computed with it.
        assert report_of(take, x, report=report).found is False
    # Picked away: nothing is reported.
    dropped = jnp.array([jnp.nan, 2.0, 3.0, 4.0])
    if pick in ("slice", "index", "strided slice", "dynamic_slice", "gather"):
        assert report_of(f, dropped).found is False
        assert report_of(f, dropped, report="first").found is False


def test_a_gather_that_fills_out_of_bounds_indices_with_nan_makes_it():
    def f(x):
        return jnp.take(x, jnp.array([1, 7]), mode="fill") * 2.0  # take-fills-nan

    for report in ("reaching", "first"):
        expect(report_of(f, jnp.ones(4), report=report), "gather", "take-fills-nan")


@pytest.mark.parametrize("report", ["reaching", "first"])
def test_nan_in_an_argument_is_not_blamed_on_an_equation_that_only_moves_it(report):
    def f(b, x):
        row = jnp.reshape(b, (1, -1))  # moves the argument
        return jnp.tanh(x @ jnp.ones((3, 3)) + row)  # computes-with-arg

    b = jnp.array([jnp.nan, 0.0, 0.0])
    expect(report_of(f, b, jnp.ones((2, 3)), report=report), "add", "computes-with-arg")

    def scanned(c0):
        def body(c, _):
            moved = c.reshape(2, 2).T.reshape(4)
            return moved * 2.0, None  # carried-arg

        return lax.scan(body, c0, None, length=3)[0]

    x = jnp.array([1.0, jnp.nan, 2.0, 3.0])
    expect(report_of(scanned, x, report=report), "mul", "carried-arg", iterations=(0,))

    def joined(a, b):
        return jnp.concatenate([a, b]) + 1.0  # joined-arg

    expect(report_of(joined, x, jnp.ones(2), report=report), "add", "joined-arg")
    # Only moved to the output: no equation computed with it, nothing is reported.
    assert report_of(lambda x: x.reshape(2, 2).T, x, report=report).found is False

    # Nor on one that stops its gradient, fences it or puts it on a device (lineax
    # stops the gradient of an operator's matrix).
    movers = {
        "stop_gradient": lax.stop_gradient,
        "optimization_barrier": lax.optimization_barrier,
        "device_put": jax.device_put,
    }
    for name, move in movers.items():

        def moved(x, move=move):
            return jnp.exp(move(x)) * 2.0  # exp-of-moved-arg

        found = report_of(moved, x, report=report)
        assert found.primitive == "exp", name
        expect(found, "exp", "exp-of-moved-arg")


@pytest.mark.parametrize("report", ["reaching", "first"])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_inf_in_a_shard_map_argument_is_not_blamed_on_the_pvary_jax_inserts(report, axis_type):
    from jax.sharding import AxisType

    kind = AxisType.Auto if axis_type == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))

    def body(x, w):
        return lax.psum(jnp.sin(x @ w), "model")  # sharded-matmul

    g = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(None, "model")), out_specs=P("data"))
    x = jax.device_put(jnp.ones((8, 4)).at[5, 0].set(jnp.inf), jax.NamedSharding(mesh, P("data")))
    w = jax.device_put(jnp.ones((4, 4)), jax.NamedSharding(mesh, P(None, "model")))
    with jax.set_mesh(mesh):
        found = report_of(g, x, w, report=report)
    expect(found, "dot_general", "sharded-matmul", kind="inf", shard={"data": 2, "model": 0})


@pytest.mark.parametrize("set_mesh", [True, False], ids=["set_mesh", "arrays-mesh"])
@pytest.mark.parametrize("report", ["reaching", "first"])
def test_scan_with_stacked_outputs_and_an_auto_axes_region_on_an_explicit_mesh(report, set_mesh):
    # On a mesh with Explicit axes, under `jax.set_mesh` or only through the
    # arguments' shardings: the origins a scan stacks row by row are typed for
    # the mesh, and so is the buffer they are written into; the shard and
    # iterations of a check made inside an `auto_axes` region (typed for the
    # region's mesh) are written outside it; nan_sites' table is typed for the
    # mesh of the checks added to it.
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    on = jax.NamedSharding(mesh, P())

    def f(a, b):
        def body(c, x):
            v = jax.sharding.auto_axes(lambda a: jnp.log(a), out_sharding=on)(a)  # log-in-region
            r = jnp.sin(c * x) + v
            return r, r

        c, ys = lax.scan(body, b, jnp.arange(1.0, 4.0)[:, None] * b[None, :])
        return c + ys.sum(0)

    a = jax.device_put(jnp.array([1.0, -1.0, 0.0, 2.0] * 4), on)
    b = jax.device_put(jnp.ones(16), on)
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        expect(report_of(f, a, b, report=report), "log", "log-in-region", iterations=(0,))
        _, sites = jax.jit(nan_sites(f))(a, b)
    assert [(s.primitive, s.kind, s.count, s.first_iteration) for s in sites] == [
        ("log", "nan", 3, (0,)),
        ("log", "inf", 3, (0,)),
    ]


@pytest.mark.parametrize("report", ["reaching", "first"])
def test_a_prng_key_made_from_a_fixed_seed_inside_the_function(report):
    # The key is a constant of the program (a key dtype, which NumPy cannot read).
    def f(x):
        noise = jax.random.normal(jax.random.PRNGKey(1), x.shape)
        other = jax.random.normal(jax.random.split(jax.random.key(2))[0], x.shape)
        return jnp.log(x + noise * 0.0 + other * 0.0)  # log-after-keys

    assert report_of(f, jnp.ones(3), report=report).found is False
    expect(report_of(f, -jnp.ones(3), report=report), "log", "log-after-keys")


def test_invalid_report_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'reaching', 'first'"):
        find_nans(jnp.sin, report="last")


def test_reaching_matches_first_when_nothing_is_discarded():
    def f(xs):
        def body(c, x):
            return c * 2.0 + jnp.log(x), jnp.sqrt(c)

        return lax.scan(body, 1.0, xs)

    for xs in (jnp.ones(5).at[3].set(-1.0), jnp.ones(5).at[0].set(0.0), jnp.ones(5)):
        assert summary(report_of(f, xs)) == summary(report_of(f, xs, report="first"))


def test_nan_in_one_shard_of_a_sharded_array(mesh8):
    # The finiteness check of a sharded value is combined across devices.
    def f(x):
        return jnp.log(x) * 2.0  # log-of-sharded

    x = jax.device_put(jnp.ones(16).at[13].set(-1.0), jax.NamedSharding(mesh8, P("i")))
    expect(report_of(f, x), "log", "log-of-sharded")


def test_values_made_from_nothing_are_checked():
    def empty_max(x):
        return lax.reduce_max(x[:0], axes=(0,)) + x.sum()  # max-of-nothing

    expect(report_of(empty_max, jnp.ones(3)), "reduce_max", "max-of-nothing", kind="inf")

    def fill(x, i):
        return x.at[i].get(mode="fill", fill_value=jnp.nan) * 2.0  # gather-fill

    expect(report_of(fill, jnp.ones(3), jnp.int32(7)), "gather", "gather-fill")


def test_scaling_by_a_small_constant_keeps_the_origin():
    # x * 0.5 cannot overflow, and NaN * 0 is NaN: the NaN made by the log is
    # still the one reported, not the multiplication.
    def f(x):
        y = jnp.log(x)  # log-then-scaled
        return y * 0.5, y * 0.0, y / 4.0

    expect(report_of(f, jnp.float32(-1.0)), "log", "log-then-scaled")

    def overflow(x):
        return x * 3.0e38  # overflowing-mul

    expect(report_of(overflow, jnp.float32(2.0)), "mul", "overflowing-mul", kind="inf")


def test_policy_for_a_library_primitive():
    from kups.effects import InterpreterPolicy
    from library_primitive import library_call

    def f(x):
        (y,) = library_call(lambda v: v * 2, x)
        return jnp.log(y - 10.0)

    way_out = r"library_call.*policy=InterpreterPolicy\.IGNORE to find_nans\(fn, policy=\.\.\.\)"
    for report_kind in ("reaching", "first"):
        with pytest.raises(NotImplementedError, match=way_out):
            find_nans(f, report=report_kind)(jnp.float32(1.0))
    out, report = find_nans(f, policy=InterpreterPolicy.IGNORE)(jnp.float32(1.0))
    assert np.isnan(out) and report.found and report.primitive == "log"
    with pytest.raises(TypeError, match="InterpreterPolicy"):
        find_nans(f, policy="ignore")


# ------------------------------------------------------------ kinds


@pytest.mark.parametrize("report", ["reaching", "first"])
def test_kinds_nan_only_skips_infs(report):
    def f(x):
        big = 1.0 / (x - 1.0)  # inf-not-watched
        return big + jnp.sqrt(x - 2.0)  # sqrt-nan-watched

    both = report_of(f, jnp.float32(1.0), report=report)
    expect(both, "div", "inf-not-watched", kind="inf")
    _, nan_only = find_nans(f, report=report, kinds=("nan",))(jnp.float32(1.0))
    expect(nan_only, "sqrt", "sqrt-nan-watched")
    _, jitted = jax.jit(find_nans(f, report=report, kinds=("nan",)))(jnp.float32(1.0))
    assert summary(jitted) == summary(nan_only)
    _, inf_only = find_nans(f, report=report, kinds=("inf",))(jnp.float32(1.0))
    if report == "first":
        expect(inf_only, "div", "inf-not-watched", kind="inf")
    else:
        # inf + nan is NaN: no Inf reaches the output.
        assert inf_only.found is False
    # Only Infs made: nothing to report for NaNs.
    _, quiet = find_nans(lambda x: 1.0 / x, report=report, kinds=("nan",))(jnp.float32(0.0))
    assert quiet.found is False


@pytest.mark.parametrize("report", ["reaching", "first"])
def test_kinds_inf_only_never_reports_a_nan(report):
    def f(x):
        return jnp.sqrt(x - 2.0)  # makes NaNs only

    _, inf_only = find_nans(f, report=report, kinds=("inf",))(jnp.ones(2))
    assert inf_only.found is False
    _, jitted = jax.jit(find_nans(f, report=report, kinds=("inf",)))(jnp.ones(2))
    assert jitted.found is False


def test_kinds_nan_only_follows_an_inf_that_becomes_a_nan():
    def f(x):
        big = jnp.exp(x)  # exp-overflows
        return jnp.sin(big) * 0.5  # sin-of-inf

    # exp(1000) is Inf (not watched); sin(Inf) is the NaN.
    _, report = find_nans(f, kinds=("nan",))(jnp.float32(1000.0))
    expect(report, "sin", "sin-of-inf")
    _, report = find_nans(f)(jnp.float32(1000.0))
    expect(report, "exp", "exp-overflows", kind="inf")


def test_kinds_is_checked():
    with pytest.raises(ValueError, match="kinds"):
        find_nans(jnp.log, kinds=("nans",))
    with pytest.raises(ValueError, match="kinds"):
        find_nans(jnp.log, kinds=())


# ------------------------------------------------------------ export


def test_jitted_report_exports_and_round_trips():
    def f(xs):
        return lax.scan(lambda c, x: (c + jnp.log(x), None), 0.0, xs)[0]  # log-exported

    xs = jnp.array([1.0, 2.0, -1.0])
    exported = jax.export.export(jax.jit(find_nans(f)))(xs)
    restored = jax.export.deserialize(exported.serialize())
    out, report = restored.call(xs)
    expected_out, expected = find_nans(f)(xs)
    np.testing.assert_array_equal(out, expected_out)
    assert summary(report) == summary(expected)
    expect(report, "log", "log-exported", iterations=[2])


def test_first_across_shards_outside_loops_between_two_loops(mesh42):
    # Shard (0, 0) fails in the first loop, at iteration 0; shard (0, 1) fails
    # outside loops, between the two loops: iteration () comes first. The check
    # outside loops keeps its own iteration when the second loop's body runs.
    def f(x):
        def body(a):
            b = lax.scan(lambda c, _: (jnp.sqrt(c), None), a, None, length=2)[0]
            d = jnp.log(b - 2.5)  # log-between-loops
            return lax.scan(lambda c, _: (c * 2.0, None), d, None, length=2)[0]

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    x = jnp.full((8, 4), 16.0).at[0, 0].set(-1.0).at[0, 2].set(9.0)
    expect(report_of(f, x, report="first"), "log", "log-between-loops", shard={"x": 0, "y": 1})


def test_first_across_shards_is_program_order_then_mesh_order(mesh42):
    def f(x):
        def body(a):
            b = jnp.log(a)  # log-early-check
            return jnp.sqrt(b - 1.0)  # sqrt-later-check

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    # Shard (1, 0) fails only the later check (sqrt of log(1) - 1); shard (2, 1)
    # fails the earlier one: its event comes first, though later in mesh order.
    x = jnp.full((8, 4), 9.0).at[2, 0].set(1.0).at[5, 3].set(-1.0)
    expect(report_of(f, x, report="first"), "log", "log-early-check", shard={"x": 2, "y": 1})
    # Two shards failing the same check: the first in mesh order.
    x = jnp.full((8, 4), 9.0).at[7, 3].set(-1.0).at[4, 0].set(-1.0)
    expect(report_of(f, x, report="first"), "log", "log-early-check", shard={"x": 2, "y": 0})
