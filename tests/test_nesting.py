"""Nesting control flow does not multiply the work: the handler of an inner
equation is called a constant number of times per trace whatever the depth
(not `2**d`), with a context of stable structure and with one whose innermost
body adds a leaf (so every loop level needs its initializer)."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from kups.effects import (
    HandlerResult,
    Interpreter,
    Uninitialized,
    default_dispatcher,
    default_scan_handler,
    default_while_handler,
    reinterpret,
)

DEPTHS = range(1, 7)
X = jnp.ones(3, jnp.float32)
TRIPS = 2  # every loop level runs twice


def wrap(kind, inner):
    """One level of control flow of `kind` around `inner`."""
    if kind == "scan":
        return lambda x: lax.scan(lambda c, _: (inner(c), None), x, None, length=TRIPS)[0]
    if kind == "while":
        return lambda x: lax.while_loop(
            lambda s: s[0] < TRIPS, lambda s: (s[0] + 1, inner(s[1])), (jnp.int32(0), x)
        )[1]
    if kind == "cond":
        # The predicate is always true; the other branch calls `sin` too, so that
        # it adds the same context leaf as the nested one.
        return lambda x: lax.cond(jnp.sum(x) > -1e9, inner, lambda y: jnp.sin(y) * 2.0, x)
    if kind == "jit":
        return jax.jit(inner)
    raise ValueError(kind)


MIXED = ["scan", "while", "cond", "jit", "scan", "while"]


def kinds_at(kind, depth):
    return MIXED[:depth] if kind == "mixed" else [kind] * depth


def nested(kinds):
    fn = jnp.sin
    for kind in reversed(kinds):
        fn = wrap(kind, fn)
    return fn


def expected_count(kinds):
    """How many `sin` run: the innermost one, times two for every loop level."""
    return TRIPS ** sum(kind in ("scan", "while") for kind in kinds)


def zeros_for_new_leaves(ctx_before, sentinel):
    return jax.tree.map(
        lambda leaf: jnp.zeros(leaf.shape, leaf.dtype) if isinstance(leaf, Uninitialized) else leaf,
        sentinel,
        is_leaf=lambda leaf: isinstance(leaf, Uninitialized),
    )


class Probe:
    """A `sin` handler that counts its calls per equation, and an interpreter."""

    def __init__(self, adds_leaf, static=None, **while_options):
        self.visits = collections.Counter()
        self.initializer_calls = 0
        self.adds_leaf = adds_leaf
        dispatcher = default_dispatcher().register_handler("sin", self.handler)
        if adds_leaf:
            dispatcher.register_handler(
                "scan", functools.partial(default_scan_handler, initializer=self.initializer)
            )
            dispatcher.register_handler(
                "while",
                functools.partial(
                    default_while_handler, initializer=self.initializer, **while_options
                ),
            )
        elif while_options:
            dispatcher.register_handler(
                "while", functools.partial(default_while_handler, **while_options)
            )
        self.interpreter = Interpreter(dispatcher)
        self.ctx = {"count": jnp.int32(0)} if static is None else {"count": 0, "meta": static}

    def handler(self, interpreter, ctx, eqn, invals):
        self.visits[id(eqn)] += 1
        y = jnp.sin(invals[0])
        new = {**ctx, "count": ctx["count"] + 1}
        if self.adds_leaf:
            new["last"] = y
        return HandlerResult(new, [y])

    def initializer(self, ctx_before, sentinel):
        self.initializer_calls += 1
        return zeros_for_new_leaves(ctx_before, sentinel)

    def trace(self, fn):
        """Traces the interpreted `fn` once; returns (max visits of one equation,
        total visits)."""
        self.visits.clear()
        interpreted = reinterpret(fn, self.interpreter)
        jax.make_jaxpr(lambda x: interpreted(self.ctx, x)[0])(X)
        return max(self.visits.values()), sum(self.visits.values())


def count_sin_eqns(fn):
    def walk(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            total += eqn.primitive.name == "sin"
            total += sum(walk(sub) for sub in jaxprs_in_params(eqn.params))
        return total

    return walk(jax.make_jaxpr(fn)(X).jaxpr)


def measure(kind, adds_leaf, **options):
    probe = Probe(adds_leaf, **options)
    per_eqn, totals, initializer_calls = [], [], []
    for depth in DEPTHS:
        probe.initializer_calls = 0
        most, total = probe.trace(nested(kinds_at(kind, depth)))
        per_eqn.append(most)
        totals.append(total)
        initializer_calls.append(probe.initializer_calls)
    return probe, per_eqn, totals, initializer_calls


# Visits of one equation per trace, measured on JAX 0.10.2 for depths 1..6.
EXPECTED_VISITS = {False: 1, True: 2}


@pytest.mark.parametrize("adds_leaf", [False, True], ids=["stable", "new_leaf"])
@pytest.mark.parametrize("kind", ["scan", "while", "cond", "jit", "mixed"])
def test_visits_do_not_grow_with_depth(kind, adds_leaf):
    probe, per_eqn, totals, initializer_calls = measure(kind, adds_leaf)
    # Constant in the depth: a loop body is traced at most twice (once to find the
    # new leaves, once with the initializer's context), whatever is around it.
    expected = 1 if kind in ("cond", "jit") else EXPECTED_VISITS[adds_leaf]
    assert per_eqn == [expected] * len(DEPTHS), per_eqn
    for depth, total in zip(DEPTHS, totals, strict=True):
        assert total <= expected * count_sin_eqns(nested(kinds_at(kind, depth))), totals
    if adds_leaf:
        # One initializer call per loop level, not per trace of an enclosing body.
        loops = [sum(k in ("scan", "while") for k in kinds_at(kind, d)) for d in DEPTHS]
        assert initializer_calls == loops
    # The deepest program computes what plain JAX does, and counts every run sin.
    kinds = kinds_at(kind, DEPTHS[-1])
    out, ctx = jax.jit(reinterpret(nested(kinds), probe.interpreter))(probe.ctx, X)
    np.testing.assert_allclose(out, nested(kinds)(X), rtol=1e-6)
    assert int(ctx["count"]) == expected_count(kinds)
    if adds_leaf:
        assert ctx["last"].shape == X.shape


@pytest.mark.parametrize("adds_leaf", [False, True], ids=["stable", "new_leaf"])
def test_visits_eager_match_traced(adds_leaf):
    """Eager interpretation traces each body as often as `make_jaxpr` does."""
    probe = Probe(adds_leaf)
    for depth in (1, 4):
        fn = nested(kinds_at("mixed", depth))
        most, total = probe.trace(fn)
        probe.visits.clear()
        out, ctx = reinterpret(fn, probe.interpreter)(probe.ctx, X)
        assert (max(probe.visits.values()), sum(probe.visits.values())) == (most, total)
        np.testing.assert_allclose(out, fn(X), rtol=1e-6)
        assert int(ctx["count"]) == expected_count(kinds_at("mixed", depth))


def sin_in_condition(inner):
    """A while loop whose condition calls `sin` (2 trips: sin(0), sin(1) < 0.85)."""
    return lambda x: lax.while_loop(
        lambda s: jnp.sin(s[0]) < 0.85, lambda s: (s[0] + 1.0, inner(s[1])), (0.0, x)
    )[1]


def test_thread_condition_visits_do_not_grow():
    probe = Probe(adds_leaf=False, thread_condition=True)
    per_eqn = []
    fn = jnp.sin
    for _ in DEPTHS:
        fn = sin_in_condition(fn)
        per_eqn.append(probe.trace(fn)[0])
    assert per_eqn == [per_eqn[0]] * len(DEPTHS) and per_eqn[0] <= 2, per_eqn
    # Depth 6: the body's sin runs 2**6 times; each level's condition 3 times per
    # run of that level (trips + 1).
    out, ctx = jax.jit(reinterpret(fn, probe.interpreter))(probe.ctx, X)
    np.testing.assert_allclose(out, fn(X), rtol=1e-6)
    runs_of_level = [2**k for k in range(6)]  # level 0 is the outermost
    assert int(ctx["count"]) == 2**6 + sum(3 * r for r in runs_of_level)


class Unhashable:
    """A static context leaf that cannot be a cache key."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return isinstance(other, Unhashable)


def test_unhashable_static_leaf_still_not_exponential():
    """Without a hashable context the body cache is off; the work must still not
    double at every level."""
    probe = Probe(adds_leaf=True, static=Unhashable())
    totals = [probe.trace(nested(["scan"] * depth))[1] for depth in DEPTHS]
    assert all(total <= depth + 1 for depth, total in zip(DEPTHS, totals, strict=True)), totals
    _out, ctx = reinterpret(nested(["scan"] * 3), probe.interpreter)(probe.ctx, X)
    assert isinstance(ctx["meta"], Unhashable) and int(ctx["count"]) == 8


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("loop", ["scan", "while"])
def test_a_leaf_first_made_under_a_shard_map_inside_a_loop_is_traced_twice(axis_type, loop):
    # The context starts empty and the innermost loop's initializer makes the
    # leaf, a concrete array whose aval has no mesh; the outer loop's second trace
    # carries it into the (partial-manual) shard_map, where it gains one. JAX's
    # type check ignores that difference, and so does the body cache.
    mesh = jax.make_mesh((2, 2), ("i", "j"), axis_types=(axis_type,) * 2)
    visits = []

    def count(interpreter, ctx, eqn, invals):
        visits.append(eqn)
        total = ctx["count"] + 1 if "count" in ctx else jnp.int32(1)
        return HandlerResult({**ctx, "count": total}, [jnp.sin(invals[0])])

    dispatcher = default_dispatcher().register_handler("sin", count)
    dispatcher.register_handler(
        "scan", functools.partial(default_scan_handler, initializer=zeros_for_new_leaves)
    )
    dispatcher.register_handler(
        "while", functools.partial(default_while_handler, initializer=zeros_for_new_leaves)
    )
    sharded = jax.shard_map(
        wrap(loop, jnp.sin), mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"j"}
    )
    fn = wrap("scan", wrap(loop, sharded))
    interpreted = reinterpret(fn, Interpreter(dispatcher))
    with jax.set_mesh(mesh):
        jax.make_jaxpr(interpreted)({}, X)
    assert len(visits) == 2
    out, ctx = jax.jit(interpreted)({}, X)
    np.testing.assert_array_equal(out, jax.jit(fn)(X))
    assert int(ctx["count"]) == TRIPS**3


def _traces_to_jaxpr(fn, *args):
    """How many jaxprs JAX traces (its tracing-cache misses, as its own tests count
    them) while `fn` is jitted, run, and run again on the same types."""
    from jax._src import test_util as jtu  # JAX's counter of `trace_to_jaxpr` events

    jitted = jax.jit(fn)
    with jtu.count_jit_tracing_cache_miss() as count:
        jitted(*args)
        jitted(*args)
    return count()


def _identity(fn):
    return lambda *args: reinterpret(fn, Interpreter(default_dispatcher()))(None, *args)[0]


def _program(kind, mesh):
    """A fresh program (nothing of it in JAX's caches) whose body holds `kind`."""

    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x)

    cj.defjvp(lambda p, t: (cj(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def cv(x):
        return jnp.sin(x)

    cv.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))
    if kind == "shard_map":
        inner = jax.shard_map(
            lambda x: x * 2.0, mesh=mesh.abstract_mesh, in_specs=P("i"), out_specs=P("i")
        )
    else:
        inner = {"custom_jvp": cj, "custom_vjp": cv, "jit": jax.jit(lambda x: x * 2.0)}[kind]
    return lambda x: lax.sin(inner(x))


@pytest.mark.parametrize("kind", ["shard_map", "custom_jvp", "custom_vjp", "jit"])
def test_an_untouched_equation_is_not_traced_again(kind):
    # The identity traces as many jaxprs as JAX: its own trace of the program is
    # not a `jit` trace, and an equation no handler touches is staged as it is,
    # not bound (which would trace a shard_map's or custom rule's body again).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("i",), axis_types=(AxisType.Auto,))
    x = jax.device_put(np.arange(8.0, dtype=np.float32), jax.NamedSharding(mesh, P()))
    _traces_to_jaxpr(_identity(_program(kind, mesh)), x)  # JAX's one-time traces
    plain = _traces_to_jaxpr(_program(kind, mesh), x)
    assert _traces_to_jaxpr(_identity(_program(kind, mesh)), x) == plain
    f = _program(kind, mesh)
    np.testing.assert_array_equal(jax.jit(_identity(f))(x), jax.jit(f)(x))
