"""`kups.effects.toolkit`: the position, source line, first event and report base
that effects share, exercised through a small effect built on them only."""

import functools
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kups.effects
from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    define_effect,
    equations_in,
    reinterpret,
)
from kups.effects.toolkit import (
    Event,
    Position,
    Report,
    event_order,
    first_across_shards,
    first_index,
    hide_frames,
    reduce_shards,
    source_of,
    track_position,
)

_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def at(marker: str) -> str:
    lines = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, marker
    return f"test_toolkit.py:{lines[0]}"


# A checkify-class effect written with the toolkit only.
_flag_p = define_effect("test_toolkit_flag")
_SITES: dict[tuple, int] = {}
_DEPTH = 4


@hide_frames
def flag(pred, msg):
    _flag_p.bind(jnp.asarray(pred), msg=msg)


def _padded(values):
    return jnp.full(_DEPTH, -1, jnp.int32).at[: values.shape[0]].set(values)


class Flagged(Report, eqx.Module):
    position: Position
    site: jax.Array
    loops: jax.Array
    coords: jax.Array

    def first_event(self):
        if self.site < 0:
            return None
        msg, source, depth, axes = list(_SITES)[int(self.site)]
        loops, coords = np.asarray(self.loops), np.asarray(self.coords)
        shard = dict(zip(axes, coords.tolist(), strict=False)) if axes else None
        return Event(msg, "flag", source, tuple(loops[:depth].tolist()), shard)


_RECORDED: list[str] = []


def _record(interpreter, ctx, eqn, invals):
    _RECORDED.append(eqn.params["msg"])
    position = ctx.position
    key = (eqn.params["msg"], source_of(eqn, position.enclosing), position.depth)
    site = _SITES.setdefault((*key, position.shard_axes), len(_SITES))
    new = jnp.logical_not(invals[0]) & (ctx.site < 0)
    shard = position.shard if position.shard is not None else jnp.zeros(0, jnp.int32)
    return HandlerResult(
        Flagged(
            position,
            jnp.where(new, site, ctx.site),
            jnp.where(new, _padded(position.iteration), ctx.loops),
            jnp.where(new, _padded(shard), ctx.coords),
        ),
        list(invals),
    )


def _first_shard(ctx):
    (site, loops, coords), _ = first_across_shards(
        (ctx.site, ctx.loops, ctx.coords),
        happened=ctx.site >= 0,
        order=event_order(ctx.loops, ctx.site, _DEPTH),
        position=ctx.position,
    )
    return Flagged(ctx.position, site, loops, coords)


def flagged(fn):
    dispatcher = default_dispatcher().register_handler(_flag_p, _record)
    for name in ("scan", "while", "cond", "shard_map", "jit"):
        tracked = track_position(dispatcher.handlers[name], varying=True)
        options = {"reduce_ctx": _first_shard} if name == "shard_map" else {}
        dispatcher.register_handler(name, functools.partial(tracked, **options))
    empty = jnp.full(_DEPTH, -1, jnp.int32)
    start = Flagged(Position(), jnp.int32(-1), empty, empty)
    return lambda *args: reinterpret(fn, Interpreter(dispatcher))(start, *args)


def test_toolkit_is_public_from_kups_effects():
    for name in kups.effects.toolkit.__all__:
        assert getattr(kups.effects, name) is getattr(kups.effects.toolkit, name)
        assert name in kups.effects.__all__
        assert getattr(kups.effects.toolkit, name).__doc__


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_scan_iteration_is_the_index_of_xs(jit, reverse):
    def f(xs):
        def step(carry, x):
            flag(x != 7.0, "seven")  # seven
            return carry + x, carry

        return lax.scan(step, 0.0, xs, reverse=reverse)

    xs = jnp.array([1.0, 7.0, 2.0, 3.0, 7.0])
    run = jax.jit(flagged(f)) if jit else flagged(f)
    out, report = run(xs)
    expected = f(xs)
    np.testing.assert_array_equal(out[0], expected[0])
    np.testing.assert_array_equal(out[1], expected[1])
    # The first failure in execution order: xs[1] forward, xs[4] reversed.
    assert report.iteration == ((4,) if reverse else (1,))
    assert report.source == at("seven")
    assert report.shard is None and report.primitive == "flag"


def test_nested_loops_outermost_first_and_while_trip_number():
    def f(n):
        def outer(i, total):
            def cond(state):
                return state[0] < n

            def body(state):
                j, acc = state
                flag(i * 10 + j != 23, "twenty-three")
                return j + 1, acc + j

            return total + lax.while_loop(cond, body, (0, 0))[1]

        return lax.fori_loop(0, 5, outer, 0)

    out, report = jax.jit(flagged(f))(6)
    assert out == f(6)
    assert report.iteration == (2, 3)
    assert report.message == "twenty-three"


def test_outside_loops_iteration_is_empty_and_nothing_is_none():
    _, report = flagged(lambda x: flag(x > 0, "negative"))(-1.0)
    assert report.iteration == () and report.shard is None
    _, report = flagged(lambda x: flag(x > 0, "negative"))(1.0)
    assert report.message is None and report.iteration is None and report.source is None
    assert repr(report) == "Flagged(None)"


def _mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)


@pytest.mark.parametrize("into", ["sharded", "replicated"])
def test_track_position_fills_in_the_position_of_a_context_spec_given_by_leaf(into):
    # The natural spec, `P()` for the whole Position, is given to each of its
    # leaves, on the way in and on the way out of the shard_map.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))

    def program(x):
        return jax.shard_map(jnp.sin, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)

    def record(interpreter, ctx, eqn, invals):
        outvals = default_primitive_handler(interpreter, ctx, eqn, invals).outvals
        return HandlerResult({**ctx, "s": ctx["s"] + jnp.sum(invals[0])}, outvals)

    dispatcher = default_dispatcher().register_handler("sin", record)
    by_leaf = {"position": P(), "s": P("x")}
    if into == "sharded":  # one entry per shard, in and out
        options = {"declare_ctx_in_specs": lambda ctx: by_leaf}
        start = jnp.zeros(8)
    else:  # a scalar that leaves with one entry per shard
        options = {"reduce_ctx": lambda ctx: {**ctx, "s": ctx["s"][None]}}
        start = jnp.float32(0)
    options["declare_ctx_out_specs"] = lambda ctx: by_leaf
    tracked = track_position(dispatcher.handlers["shard_map"])
    dispatcher.register_handler("shard_map", functools.partial(tracked, **options))
    _, ctx = jax.jit(reinterpret(program, Interpreter(dispatcher)))(
        {"position": Position(), "s": start}, jnp.arange(8.0)
    )
    np.testing.assert_array_equal(ctx["s"], np.arange(8.0))


def test_first_in_program_order_beats_first_shard():
    """Shard 5 fails an earlier flag, shard 2 a later one: shard 5's is first."""
    mesh = _mesh()

    def body(block):
        index = lax.axis_index("x") * 2 + lax.axis_index("y")
        flag(index != 5, "earlier")  # earlier
        flag(index != 2, "later")
        return block

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("x", "y")))
    _, report = jax.jit(flagged(f))(x)
    assert (report.message, report.shard, report.source) == (
        "earlier",
        {"x": 2, "y": 1},
        at("earlier"),
    )


def test_earlier_iteration_beats_earlier_site_and_shard():
    mesh = _mesh()

    def body(block):
        index = lax.axis_index("x") * 2 + lax.axis_index("y")

        def step(carry, i):
            flag((index != 1) | (i != 3), "one")
            flag((index != 6) | (i != 2), "six")
            return carry, None

        lax.scan(step, 0, jnp.arange(5))
        return block

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("x", "y")))
    _, report = jax.jit(flagged(f))(x)
    assert (report.message, report.iteration, report.shard) == ("six", (2,), {"x": 3, "y": 0})


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_shard_map_inside_scan_and_nested_shard_map(axis_type):
    mesh = _mesh(axis_type)

    def step(carry, x):
        def body(block):
            flag(jnp.all(block < 20), "big")  # big
            return block * 2

        y = jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)
        return carry + y.sum(), None

    def f(xs):
        return lax.scan(step, 0.0, xs)[0]

    xs = jnp.arange(3 * 8 * 4, dtype=jnp.float32).reshape(3, 8, 4) / 3
    xs = jax.device_put(xs, NamedSharding(mesh, P(None, "x", "y")))
    out, report = jax.jit(flagged(f))(xs)
    np.testing.assert_array_equal(out, jax.jit(f)(xs))
    # xs[1] holds 32/3 .. 63/3; 20 is first reached at row 6, shard x=3, y=0.
    assert (report.iteration, report.shard, report.source) == ((1,), {"x": 3, "y": 0}, at("big"))


def test_source_falls_back_to_the_enclosing_line():
    def inner(x):
        return x * 2

    jaxpr = jax.make_jaxpr(lambda x: jax.jit(inner)(x))(1.0)  # enclosing
    (call,) = jaxpr.eqns
    assert source_of(call) == at("enclosing")
    assert source_of(call.params["jaxpr"].eqns[0], "outer.py:3") != "outer.py:3"
    constant_eqn = jax.make_jaxpr(lambda x: x)(1.0).eqns
    assert constant_eqn == []


def test_source_of_without_user_frame_is_enclosing():
    jaxpr = jax.make_jaxpr(lambda x: jnp.floor_divide(x, 3))(7)
    inner = next(e for e in jaxpr.eqns if "jaxpr" in e.params).params["jaxpr"]
    eqns = [e for e in inner.eqns if source_of(e) is None]
    if eqns:  # JAX keeps no user frame inside the jitted body of floor_divide
        assert source_of(eqns[0], "model.py:4") == "model.py:4"


def test_hide_frames_names_the_caller():
    def f(x):
        flag(x > 0, "positive")  # caller
        return x

    jaxpr = jax.make_jaxpr(f)(1.0)
    eqn = next(e for e in jaxpr.eqns if e.primitive is _flag_p)
    assert source_of(eqn) == at("caller")
    with pytest.raises(TypeError, match="Python function"):
        hide_frames(len)


def test_first_index_and_event_order():
    assert first_index(np.array([[False, True], [True, True]])) == (0, 1)
    assert first_index(np.zeros((2, 3), bool)) is None
    key = event_order(jnp.array([1], jnp.int32), 2, depth=2)
    assert key.tolist() == [1, -1, 2]


def test_report_guards_traced_reads_and_renders():
    x = jnp.arange(3.0)

    def f(xs):
        def step(c, x):
            flag(x < 2, "two")
            return c, None

        return lax.scan(step, 0, xs)[0]

    def inside(xs):
        _, report = flagged(f)(xs)
        with pytest.raises(TypeError, match="needs a concrete report"):
            _ = report.iteration
        assert repr(report) == "Flagged(<traced>)"
        return report

    report = jax.jit(inside)(x)
    assert repr(report) == f"Flagged('two at iteration 2 ({report.source})')"
    table = report._repr_html_()
    assert "<table" in table and "<th>iteration</th><td>(2,)</td>" in table


def test_vmapped_report_reads_the_first_element_with_first_index():
    def f(x):
        flag(x < 2, "two")
        return x

    _, report = jax.vmap(flagged(f))(jnp.array([0.0, 3.0, 5.0]))
    assert first_index(report.site >= 0) == (1,)


def test_a_function_called_from_two_lines_is_interpreted_once():
    positive = jax.jit(lambda x: (flag(x > 0, "called twice"), x)[1])

    def f(x):
        y = positive(x)
        return positive(y * 2)

    before = _RECORDED.count("called twice")
    out, report = jax.jit(flagged(f))(-1.0)
    assert out == f(-1.0) and report.message == "called twice"
    # The position's fallback line is part of the context's structure; it stays
    # the same where nothing inside needs it, so the body cache serves both calls.
    assert _RECORDED.count("called twice") - before == 1


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("op", ["sum", "min", "max"])
def test_reduce_shards_over_all_manual_axes_in_one_round(op, check_vma):
    mesh = _mesh(AxisType.Auto)
    numpy_op = {"sum": np.sum, "min": np.min, "max": np.max}[op]

    def body(block, column):
        # `block` varies over both axes, `column` over "y" only, `one` over none.
        one = jnp.float32(1.0)
        return jnp.stack(
            [reduce_shards(v, ("x", "y"), op=op) for v in (block.sum(), column.sum(), one)]
        )[None]

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("x", "y"), P("y")), out_specs=P(), check_vma=check_vma
        )
    )
    x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) ** 2
    column = jnp.arange(4, dtype=jnp.float32) * 3 + 1
    out = np.asarray(f(x, column))[0]
    blocks = np.asarray(x).reshape(4, 2, 2, 2).transpose(0, 2, 1, 3).sum((2, 3))
    shards_x = mesh.shape["x"]
    columns = np.tile(np.asarray(column).reshape(2, 2).sum(1), (shards_x, 1))
    ones = np.ones((shards_x, 2), np.float32)
    np.testing.assert_array_equal(out, [numpy_op(v) for v in (blocks, columns, ones)])
    jaxpr = str(jax.make_jaxpr(f)(x, column))
    # One collective per value, over both axes at once.
    collective = {"sum": "psum", "min": "pmin", "max": "pmax"}[op]
    # (psum appears as psum_invariant under check_vma.)
    rounds = [line for line in jaxpr.splitlines() if f"= {collective}" in line]
    assert len(rounds) == 3 and all("axes=('x', 'y')" in line for line in rounds), jaxpr
    assert reduce_shards(jnp.zeros((0,)), ()).shape == (0,)
    with pytest.raises(ValueError, match="op is one of"):
        reduce_shards(jnp.float32(1.0), ("x",), op="mean")


def _not_into_conds(eqn):
    return eqn.primitive.name != "cond"


def test_equations_in_lists_what_runs_with_the_control_flow_around_it():
    def f(x):
        def body(i, c):
            return lax.cond(c > 0, jnp.sin, jnp.cos, c) * 2.0

        return jnp.exp(lax.fori_loop(0, 3, body, x))

    closed = jax.make_jaxpr(f)(1.0)
    listed = [
        (eqn.primitive.name, tuple(e.primitive.name for e in around))
        for eqn, around in equations_in(closed)
    ]
    # Program order: the loop's body (its counter too), then exp after it.
    assert ("sin", ("scan", "cond")) in listed and ("cos", ("scan", "cond")) in listed
    assert listed.index(("sin", ("scan", "cond"))) < listed.index(("mul", ("scan",)))
    assert listed[-1] == ("exp", ())
    assert equations_in(closed) is equations_in(closed.jaxpr)  # cached per jaxpr
    # `enter` refuses the cond: it is listed itself, its branches are not.
    refused = [
        (eqn.primitive.name, tuple(e.primitive.name for e in around))
        for eqn, around in equations_in(closed, enter=_not_into_conds)
    ]
    assert ("cond", ("scan",)) in refused
    assert not any(name in ("sin", "cos") for name, _ in refused)
