"""`kups.debug.nan_sites`, checked against the sites, counts, first iterations and
shards of each test program, worked out by hand (lines marked `# <marker>`)."""

import contextlib
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from kups.debug import NanSite, nan_sites
from kups.effects import equations_in

with open(__file__) as _file:
    _LINES = _file.read().splitlines()


def line_of(marker: str) -> str:
    lines = [i for i, text in enumerate(_LINES, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, f"marker {marker!r} on lines {lines}"
    return f"{os.path.basename(__file__)}:{lines[0]}"


def sites_of(fn, *args, **options) -> list[tuple]:
    """`(primitive, marker line, kind, count, first_iteration, first_shard)` of each
    site, eagerly and under jit (checked to agree); outputs checked against `fn`."""
    out, sites = nan_sites(fn, **options)(*args)
    jit_out, jit_sites = eqx.filter_jit(nan_sites(fn, **options))(*args)
    expected = fn(*args)
    for got in (out, jit_out):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    records = [
        (s.primitive, s.source, s.kind, s.count, s.first_iteration, s.first_shard) for s in sites
    ]
    assert records == [
        (s.primitive, s.source, s.kind, s.count, s.first_iteration, s.first_shard)
        for s in jit_sites
    ]
    assert len(sites) == len(records)
    assert all(isinstance(s, NanSite) and s.path.endswith("test_nan_sites.py") for s in sites)
    return records


def site(primitive, marker, kind="nan", count=1, iteration=(), shard=None):
    return (primitive, line_of(marker), kind, count, tuple(iteration), shard)


def test_every_site_in_program_order_and_both_kinds():
    def f(x):
        a = jnp.log(x)  # log-both
        b = 1.0 / (x - 2.0)  # div-inf
        c = a + b  # only-moves-them
        return jnp.sqrt(x - 3.0) + c  # sqrt-nan

    assert sites_of(f, jnp.array([-1.0, 0.0, 2.0])) == [
        site("log", "log-both", "nan"),
        site("log", "log-both", "inf"),
        site("div", "div-inf", "inf"),
        site("sqrt", "sqrt-nan", "nan"),
    ]
    assert sites_of(f, jnp.array([4.0, 5.0])) == []


def test_a_program_with_nothing_to_check_has_no_sites():
    # Identity, moves only, and a tuple of them: no equation is checked.
    for fn in (lambda x: x, lambda x: x.reshape(3, 1), lambda x: (x, -x)):
        assert sites_of(fn, jnp.ones(3)) == []
        _, sites = jax.vmap(nan_sites(fn))(jnp.ones((2, 3)))
        assert len(sites) == 0 and list(sites) == []


def test_kinds():
    def f(x):
        return jnp.log(x) + jnp.sqrt(x)  # log-and-sqrt

    x = jnp.array([-1.0, 0.0])
    assert sites_of(f, x, kinds=("nan",)) == [
        site("log", "log-and-sqrt", "nan"),
        site("sqrt", "log-and-sqrt", "nan"),
    ]
    assert sites_of(f, x, kinds=("inf",)) == [site("log", "log-and-sqrt", "inf")]


def test_scan_counts_iterations_and_reverse_gives_xs_index():
    def f(xs, reverse):
        def step(total, x):
            y = jnp.log(x)  # log-in-scan
            return total + jnp.where(x > 0, y, 0.0), None

        return lax.scan(step, 0.0, xs, reverse=reverse)[0]

    xs = jnp.array([1.0, -1.0, 0.0, -2.0, 3.0])
    assert sites_of(lambda xs: f(xs, False), xs) == [
        site("log", "log-in-scan", "nan", 2, [1]),
        site("log", "log-in-scan", "inf", 1, [2]),
    ]
    # Reversed, x[3] runs first; the first iteration is still named by its xs index.
    assert sites_of(lambda xs: f(xs, True), xs) == [
        site("log", "log-in-scan", "nan", 2, [3]),
        site("log", "log-in-scan", "inf", 1, [2]),
    ]


def test_a_nan_carried_by_a_loop_or_passed_through_a_jit_is_made_once():
    # The carry holds the NaN from iteration 2 on, and the jit's output from then:
    # only the sqrt made it; every use of the carry after it and the jit's body
    # and its caller only pass it on. The carry starts with a NaN in `start`.
    @jax.jit
    def scaled(v, w):
        return v * w + 1.0

    def f(xs, start):
        def step(carry, x):
            s, t = carry
            r = jnp.sqrt(x)  # sqrt-in-step
            s = scaled(s + r, 2.0) - 1.0
            return (s, t * 0.5), s.sum()

        return lax.scan(step, (jnp.zeros(3), start), xs)

    xs = jnp.array([[1.0] * 3, [4.0] * 3, [-1.0, 1.0, 1.0], [9.0] * 3])
    assert sites_of(f, xs, jnp.array([jnp.nan, 1.0])) == [
        site("sqrt", "sqrt-in-step", "nan", 1, [2]),
    ]


def test_nested_loops_while_and_cond():
    def f(x):
        def outer(i, total):
            def cond(c):
                return c[0] < 3

            def body(c):
                j, acc = c
                v = x[i] - j
                made = lax.cond(v < 0, jnp.log, lambda u: u, v)  # log-in-cond
                return j + 1, acc + jnp.where(v < 0, 0.0, made)

            return total + lax.while_loop(cond, body, (0, 0.0))[1]

        return lax.fori_loop(0, 2, outer, 0.0)

    # x[0] = 1.0: v = 1, 0, -1 (log(-1): NaN at (0, 2)); x[1] = 0.5: v = 0.5,
    # -0.5, -1.5 (NaN at (1, 1) and (1, 2)).
    assert sites_of(f, jnp.array([1.0, 0.5])) == [
        site("log", "log-in-cond", "nan", 3, [0, 2]),
    ]


def test_first_iterations_of_sites_in_nested_scans():
    # Each site keeps the iteration of its own loops: the inner log first made a
    # NaN at (2, 0), after the outer sqrt did at outer iteration 1.
    def f(xs):
        def outer(c, row):
            def inner(d, x):
                return d + jnp.where(x > 0, jnp.log(x), 0.0), None  # log-inner

            s = lax.scan(inner, 0.0, row)[0]
            t = jnp.sqrt(s)  # sqrt-outer
            return c + jnp.where(s >= 0.0, t, 0.0), None

        return lax.scan(outer, 0.0, xs)[0]

    xs = jnp.array([[2.0, 3.0], [0.5, 0.1], [-1.0, 4.0], [0.5, 0.5]])
    assert sites_of(f, xs) == [
        site("log", "log-inner", "nan", 1, [2, 0]),
        site("sqrt", "sqrt-outer", "nan", 2, [1]),
    ]


def test_remat_and_grad():
    def loss(x):
        h = jax.checkpoint(lambda u: jnp.sqrt(u))(x)  # sqrt-in-remat
        return jnp.where(x > 0, h, 0.0).sum()

    # The forward sqrt makes NaN once; under grad the remat recomputes it and its
    # derivative 0.5 / sqrt(x) makes it again (a div: a NaN over a NaN is not new).
    forward = sites_of(loss, jnp.array([1.0, -1.0]))
    assert forward == [site("sqrt", "sqrt-in-remat", "nan")]
    grads = sites_of(jax.grad(loss), jnp.array([1.0, -1.0]))
    assert grads[0] == site("sqrt", "sqrt-in-remat", "nan")
    assert all(record[2] == "nan" for record in grads)


def test_shard_map_counts_every_shard(mesh42):
    def f(x):
        def body(a):
            def step(c, i):
                return c + jnp.log(a - i), None  # log-in-shard-scan

            return lax.scan(step, jnp.zeros_like(a), jnp.arange(3.0))[0]

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    # Shard (1, 0) holds 1.5: log(1.5 - 2) NaN at iteration 2; shard (3, 1) holds
    # 0.5: NaN at iterations 1 and 2; shard (0, 1) holds 1.0: -inf at 1, then the
    # NaN of log(-1) at 2. The first NaN: iteration 1 on (3, 1).
    x = jnp.full((8, 4), 9.0).at[2, 0].set(1.5).at[7, 3].set(0.5).at[0, 2].set(1.0)
    assert sites_of(f, x) == [
        site("log", "log-in-shard-scan", "nan", 4, [1], {"x": 3, "y": 1}),
        site("log", "log-in-shard-scan", "inf", 1, [1], {"x": 0, "y": 1}),
    ]


_PERM = [(k, (k + 1) % 8) for k in range(8)]
_MOVING = {
    "ppermute": lambda b: lax.ppermute(b, "i", _PERM),
    "all_gather": lambda b: lax.all_gather(b, "i", tiled=True)[:2],
    "all_to_all": lambda b: lax.all_to_all(jnp.tile(b, (4, 1)), "i", 0, 0, tiled=True)[:2],
    "tile": lambda b: jnp.tile(b, (2, 1)),
}


@pytest.mark.parametrize("move", sorted(_MOVING))
def test_a_collective_that_moves_a_nan_between_shards_makes_none(mesh8, move):
    # The argument's NaN (shard 5), moved to other shards: no equation made it.
    # Made by sqrt on shard 5 and moved: sqrt only.
    from kups.checks import checked, nan_checks
    from kups.debug import find_nans

    def given(x):
        return jax.shard_map(_MOVING[move], mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    def made(x):
        def body(b):
            return _MOVING[move](jnp.sqrt(b))  # sqrt-on-one-shard

        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.arange(1.0, 33.0).reshape(16, 2)
    assert sites_of(given, x.at[10, 0].set(jnp.nan)) == []
    assert not jax.jit(find_nans(given))(x.at[10, 0].set(jnp.nan))[1].found
    assert not jax.jit(find_nans(given, report="first"))(x.at[10, 0].set(jnp.nan))[1].found
    assert jax.jit(checked(given, errors=nan_checks))(x.at[10, 0].set(jnp.nan))[1].get() is None
    assert sites_of(made, x.at[10, 0].set(-1.0)) == [
        site("sqrt", "sqrt-on-one-shard", shard={"i": 5})
    ]


@pytest.mark.parametrize("reduce", ["psum", "pmean", "psum_scatter"])
def test_a_collective_sum_of_another_shards_nan_makes_none(mesh8, reduce):
    # sqrt makes a NaN on shard 5; the sum hands it to every shard, and did not
    # make it there. checked's "from inputs without NaN" reads every shard's input.
    from kups.checks import checked, nan_checks

    op = {
        "psum": lambda v: lax.psum(v, "i"),
        "pmean": lambda v: lax.pmean(v, "i"),
        "psum_scatter": lambda v: jnp.tile(
            lax.psum_scatter(jnp.tile(v, (4, 1)), "i", scatter_dimension=0, tiled=True), (2, 1)
        )[:2],
    }[reduce]

    def made(x):
        def body(b):
            return op(jnp.sqrt(b))  # sqrt-before-the-sum

        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    def given(x):
        return jax.shard_map(op, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.arange(1.0, 33.0).reshape(16, 2)
    assert sites_of(made, x.at[10, 0].set(-1.0)) == [
        site("sqrt", "sqrt-before-the-sum", shard={"i": 5})
    ]
    assert jax.jit(checked(given, errors=nan_checks))(x.at[10, 0].set(jnp.nan))[1].get() is None
    error = jax.jit(checked(made, errors=nan_checks))(x.at[10, 0].set(-1.0))[1]
    assert error.get().startswith("'sqrt' produced a NaN")


@pytest.mark.parametrize("program", ["no-sites", "sites"])
def test_eager_shard_map_without_loops(mesh8, program):
    # Called without jit, a shard_map body runs op by op, each op compiled on
    # its own (for JAX 0.11, the report's pieces must hold no empty concatenate).
    def body(a):
        if program == "no-sites":
            return (a > 0).astype(jnp.int32)  # no floating output: an empty table
        return jnp.log(a)  # log-in-eager-body

    f = jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))
    x = jnp.arange(8.0) - 2.0
    out, sites = nan_sites(f)(x)
    np.testing.assert_array_equal(out, f(x))
    records = [
        (s.primitive, s.source, s.kind, s.count, s.first_iteration, s.first_shard) for s in sites
    ]
    if program == "no-sites":
        assert records == []
    else:
        assert records == [
            site("log", "log-in-eager-body", "nan", 2, [], {"i": 0}),
            site("log", "log-in-eager-body", "inf", 1, [], {"i": 2}),
        ]


@pytest.mark.parametrize("set_mesh", [True, False], ids=["set_mesh", "arrays-mesh"])
def test_auto_axes_region_of_a_program_on_an_explicit_mesh(set_mesh):
    # Inside the region, JAX runs under a mesh with other axis types: what the
    # walk reduces of the region's inputs (typed for the mesh outside) and the
    # checks it adds up outside must be retyped. Without `jax.set_mesh`, the
    # mesh is the arguments' and the table is typed for it.
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    on = jax.NamedSharding(mesh, P())

    def region(a, b):
        return jnp.log(a * b)  # log-in-region

    def f(a, b):
        c = jax.sharding.auto_axes(region, out_sharding=on)(a, b)
        return c, jnp.sqrt(b - 2.0)  # sqrt-after-region

    a = jax.device_put(jnp.array([1.0, -1.0, 0.0, 2.0] * 4), on)
    b = jax.device_put(jnp.ones(16), on)
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        assert sites_of(f, a, b) == [
            site("log", "log-in-region"),
            site("log", "log-in-region", "inf"),
            site("sqrt", "sqrt-after-region"),
        ]


def test_an_equation_that_only_moves_elements_is_not_checked_and_passes_them_on():
    # Reshapes, a transpose, a negation, a concatenation, a broadcast, a widening
    # cast and a jit around some of them move the sqrt's NaN: none of them made
    # it, and the log after them made none (its input held one) until the input
    # of the sqrt is positive and the log's own NaNs are its own.
    @jax.jit
    def moved(a, y):
        return jnp.concatenate([-a.reshape(2, 2).T.ravel(), y])

    def f(x, y):
        a = jnp.sqrt(x)  # sqrt-before-moves
        b = jnp.broadcast_to(moved(a, y).astype(jnp.float32), (3, 6))
        return jnp.log(b)  # log-after-moves

    y = jnp.array([1.0, 2.0])
    assert sites_of(f, jnp.array([-1.0, 1.0, 4.0, 9.0]), y) == [
        site("sqrt", "sqrt-before-moves"),
    ]
    assert sites_of(f, jnp.array([1.0, 1.0, 4.0, 9.0]), y) == [site("log", "log-after-moves")]
    for kinds in (("nan",), ("inf",), ("nan", "inf")):
        # One reduction per equation that may make one, none for the moves.
        jaxpr = jax.make_jaxpr(nan_sites(f, kinds=kinds))(jnp.ones(4), y)
        reductions = [e for e, _ in equations_in(jaxpr.jaxpr) if e.primitive.name == "reduce"]
        assert len(reductions) == 4, kinds  # the arguments x and y, the sqrt, the log


def test_a_cast_that_narrows_or_a_constant_joined_to_data_makes_one():
    def f(x):
        small = (x * 1e3).astype(jnp.float16)  # narrowing-cast
        wide = small.astype(jnp.float32) + 1.0
        return wide, jnp.concatenate([x, jnp.full(2, jnp.nan)])  # joins-constant-nan

    assert sites_of(f, jnp.array([1.0, 100.0])) == [
        site("convert_element_type", "narrowing-cast", "inf"),
        site("concatenate", "joins-constant-nan"),
    ]


def test_each_call_of_a_jitted_function_counts_its_own_sites():
    # The checks of a jitted function's body are recorded with the caller's.
    @jax.jit
    def g(v):
        return jnp.log(v) * 2.0  # log-in-jitted

    def f(xs):
        def step(total, x):
            return total + g(x).sum() + g(x - 3.0).sum(), jnp.sqrt(x)  # sqrt-beside-calls

        return lax.scan(step, 0.0, xs)

    xs = jnp.array([[1.0, 2.0], [-1.0, 4.0], [0.0, 5.0], [2.0, 3.0]])
    assert sites_of(f, xs) == [
        site("log", "log-in-jitted", "nan", 1, [1]),
        site("log", "log-in-jitted", "inf", 1, [2]),
        site("log", "log-in-jitted", "nan", 4, [0]),
        site("log", "log-in-jitted", "inf", 1, [3]),
        site("sqrt", "sqrt-beside-calls", "nan", 1, [1]),
    ]


def test_vmap_adds_up_the_elements():
    def f(x):
        return jnp.log(x)  # log-vmapped

    _, sites = jax.vmap(nan_sites(f))(jnp.array([-1.0, 1.0, -2.0, 0.0]))
    assert [(s.primitive, s.source, s.kind, s.count) for s in sites] == [
        ("log", line_of("log-vmapped"), "nan", 2),
        ("log", line_of("log-vmapped"), "inf", 1),
    ]


def test_constant_is_blamed_on_the_line_that_writes_it():
    def f(x):
        y = jnp.where(x > 0, x, jnp.nan)  # where-writes-nan
        return y * 2.0

    assert sites_of(f, jnp.array([1.0, -1.0])) == [site("select_n", "where-writes-nan")]


@pytest.mark.parametrize("call", ["none", "jit", "checkpoint", "checkpoint-policy"])
def test_a_constant_passed_into_a_call_is_made_where_the_call_writes_data_into_it(call):
    # `jax.checkpoint`'s primitive is named `remat2`: its body learns which of its
    # inputs are constants, as a `jit`'s does.
    def write(buf, x):
        return buf.at[:2].set(x[:2]) * 1.0  # writes-data-into-constant

    wrap = {
        "none": lambda g: g,
        "jit": jax.jit,
        "checkpoint": jax.checkpoint,
        "checkpoint-policy": lambda g: jax.checkpoint(
            g, policy=jax.checkpoint_policies.nothing_saveable
        ),
    }[call]

    def f(x):
        return wrap(write)(jnp.full((4,), jnp.inf), x)

    assert sites_of(f, jnp.ones(4)) == [site("scatter", "writes-data-into-constant", "inf")]


def test_a_constant_a_loop_starts_from_is_made_where_the_loop_combines_it_with_data():
    # A -inf to accumulate from, as blackjax's NUTS starts its log-sum-exp: the
    # first iteration's equation that combines it with data made the Inf, as
    # outside a loop, and as report="first" says. Also through a custom_jvp
    # function (`logaddexp`), and from a weakly typed -inf (whose cast to
    # float32 only moves it).
    from kups.debug import find_nans

    xs = jnp.array([0.0, 1.0, 2.0])

    def plain(xs):
        return lax.scan(lambda c, x: (c + x * 0.0, None), jnp.float32(-jnp.inf), xs)[0]  # acc

    def logsumexp(init):
        def f(xs):
            step = lambda c, x: (jnp.logaddexp(c, x), None)  # noqa: E731
            return lax.scan(step, init, xs)[0]

        return f

    assert sites_of(plain, xs) == [site("add", "acc", "inf", iteration=(0,))]
    assert find_nans(plain, report="first")(xs)[1].primitive == "add"
    outside = sites_of(lambda xs: jnp.logaddexp(jnp.float32(-jnp.inf), xs[0]), xs)
    for init in (jnp.float32(-jnp.inf), -jnp.inf):
        looped = sites_of(logsumexp(init), xs)
        assert [(p, k, n, i) for p, _, k, n, i, _ in looped] == [
            (p, k, n, (0,)) for p, _, k, n, _, _ in outside
        ]
        first = find_nans(logsumexp(init), report="first")(xs)[1]
        assert (first.primitive, first.iteration) == (looped[0][0], (0,))


def test_a_constant_a_while_loop_or_a_cond_starts_from_is_made_where_it_meets_data():
    # blackjax's NUTS carries its -inf log-sum-exp through while loops and passes
    # it into conds: the equation that first combines it with data made the
    # Inf, once (the next iterations inherit it), as for a scan and as
    # report="first" says.
    from kups.debug import find_nans

    xs = jnp.array([0.0, 1.0, 2.0])

    def while_loop(xs):
        def body(carry):
            i, acc = carry
            return i + 1, acc + xs[i]  # while-acc

        return lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.float32(-jnp.inf)))[1]

    def cond(xs):
        return lax.cond(xs[0] < 1.0, lambda a: a + xs, lambda a: a - xs, -jnp.inf)  # cond-acc

    def cond_in_while(xs):
        def body(carry):
            i, acc = carry
            acc = lax.cond(i > 0, lambda a: a * 2.0, lambda a: a + xs[i], acc)  # nested-acc
            return i + 1, acc

        return lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.float32(-jnp.inf)))[1]

    assert sites_of(while_loop, xs) == [site("add", "while-acc", "inf", iteration=(0,))]
    assert sites_of(cond, xs) == [site("add", "cond-acc", "inf")]
    assert sites_of(cond_in_while, xs) == [site("add", "nested-acc", "inf", iteration=(0,))]
    for fn, iteration in ((while_loop, (0,)), (cond, ()), (cond_in_while, (0,))):
        first = find_nans(fn, report="first")(xs)[1]
        assert (first.primitive, first.kind, first.iteration) == ("add", "inf", iteration)


def test_sites_returned_from_jit_and_read_outside():
    def f(x):
        return jnp.log(x)  # log-jitted

    _, sites = jax.jit(nan_sites(f))(jnp.float32(-1.0))
    leaves = jax.tree.leaves(sites)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)

    def inside(x):
        _, traced = nan_sites(f)(x)
        with pytest.raises(TypeError, match="concrete"):
            list(traced)
        return 0.0

    jax.jit(inside)(jnp.float32(1.0))
    assert "log" in sites._repr_html_()


def test_jitted_sites_export_and_round_trip():
    def f(xs):
        def step(carry, x):
            return carry + jnp.log(x), 1.0 / x  # log-and-div-exported

        return lax.scan(step, 0.0, xs)

    xs = jnp.array([1.0, 0.0, -1.0, -2.0])
    exported = jax.export.export(jax.jit(nan_sites(f)))(xs)
    restored = jax.export.deserialize(exported.serialize())
    expected_out, expected = nan_sites(f)(xs)
    for out, sites in (restored.call(xs), jax.jit(restored.call)(xs)):
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected_out), strict=True):
            np.testing.assert_array_equal(a, b)
        records = [(s.primitive, s.source, s.kind, s.count, s.first_iteration) for s in sites]
        assert records == [
            ("log", line_of("log-and-div-exported"), "nan", 2, (2,)),
            ("log", line_of("log-and-div-exported"), "inf", 1, (1,)),
            ("div", line_of("log-and-div-exported"), "inf", 1, (1,)),
        ]
        assert records == [
            (s.primitive, s.source, s.kind, s.count, s.first_iteration) for s in expected
        ]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="kinds"):
        nan_sites(jnp.log, kinds=("nans",))
    with pytest.raises(TypeError, match="callable"):
        nan_sites(jnp.log(1.0))
