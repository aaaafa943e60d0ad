"""`default_while_handler`: the context as a carry through a dynamic number of
trips, zero-trip loops, initializers and updaters, the condition, and its
errors."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kups.effects import (
    HandlerResult,
    Interpreter,
    Uninitialized,
    default_dispatcher,
    default_while_handler,
    reinterpret,
)

LINES: dict[str, int] = {}


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def record_sin(interpreter, ctx, eqn, invals):
    """Counts `sin` and keeps its latest output in a new leaf `ctx["last"]`."""
    y = jnp.sin(invals[0])
    return HandlerResult({**ctx, "count": ctx["count"] + 1, "last": y}, [y])


def interpreter_with(sin_handler, **while_options):
    dispatcher = default_dispatcher().register_handler("sin", sin_handler)
    if while_options:
        dispatcher.register_handler(
            "while", functools.partial(default_while_handler, **while_options)
        )
    return Interpreter(dispatcher)


def grow(x, limit):
    """Doubles `x` and adds `sin(x)` while `x < limit`; returns `(x, trips)`."""

    def cond(state):
        return state[0] < limit

    def body(state):
        x, n = state
        return x * 2.0 + jnp.sin(x) * 0.0, n + 1

    LINES["while"] = _next_line()
    return lax.while_loop(cond, body, (x, jnp.int32(0)))


def trips_by_hand(x, limit):
    n = 0
    while x < limit:
        x, n = x * 2.0, n + 1
    return n


@pytest.mark.parametrize(("x0", "limit"), [(1.0, 100.0), (3.0, 4.0), (0.5, 1000.0)])
def test_counter_counts_dynamic_trips(x0, limit):
    expected_trips = trips_by_hand(x0, limit)
    (x, trips), ctx = reinterpret(grow, interpreter_with(count_sin))(0, jnp.float32(x0), limit)
    assert int(trips) == expected_trips
    assert int(ctx) == expected_trips
    assert float(x) == x0 * 2.0**expected_trips


def test_counter_under_jit_with_traced_bound():
    interpreted = jax.jit(reinterpret(grow, interpreter_with(count_sin)))
    for x0, limit in [(1.0, 100.0), (1.0, 1.5), (1.0, 5000.0)]:
        (_, trips), ctx = interpreted(jnp.int32(10), jnp.float32(x0), jnp.float32(limit))
        assert int(ctx) == 10 + trips_by_hand(x0, limit) == 10 + int(trips)


def test_fori_loop_with_dynamic_bounds():
    def fn(x, n):
        return lax.fori_loop(0, n, lambda i, c: c + jnp.sin(c * i), x)

    interpreted = jax.jit(reinterpret(fn, interpreter_with(count_sin)))
    for n in [0, 1, 7]:
        out, ctx = interpreted(0, jnp.float32(0.3), n)
        np.testing.assert_allclose(out, fn(jnp.float32(0.3), n), rtol=1e-6)
        assert int(ctx) == n


def test_context_is_a_true_carry():
    def handler(interpreter, ctx, eqn, invals):
        y = jnp.sin(invals[0])
        return HandlerResult(ctx * 3 + 1, [y])

    (_, trips), ctx = reinterpret(grow, interpreter_with(handler))(jnp.int32(2), 1.0, 20.0)
    expected = 2
    for _ in range(int(trips)):
        expected = expected * 3 + 1
    assert int(ctx) == expected


def test_consts_in_condition_and_body():
    def fn(x, limit, step):
        # `limit` is a const of the condition, `step` one of the body.
        return lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + step, jnp.sin(c[1])), x)

    x = (jnp.float32(0.0), jnp.array([0.2, 0.4]))
    args = (x, jnp.float32(2.0), jnp.float32(0.3))
    out, ctx = reinterpret(fn, interpreter_with(count_sin))(0, *args)
    expected = fn(*args)
    np.testing.assert_allclose(out[1], expected[1], rtol=1e-6)
    trips = 0
    value = 0.0
    while np.float32(value) < 2.0:
        value = np.float32(value) + np.float32(0.3)
        trips += 1
    assert int(ctx) == trips


# ---------------------------------------------------------------------------
# Zero trips, initializers and updaters.
# ---------------------------------------------------------------------------


def test_zero_trip_keeps_context():
    (x, trips), ctx = reinterpret(grow, interpreter_with(count_sin))(jnp.int32(5), 10.0, 1.0)
    assert int(trips) == 0 and int(ctx) == 5 and float(x) == 10.0


def test_body_adding_leaves_uses_initializer():
    calls = []

    def initializer(ctx_before, sentinel):
        calls.append(sentinel)
        return {**sentinel, "last": jnp.full(sentinel["last"].shape, -1.0)}

    interpreter = interpreter_with(record_sin, initializer=initializer)
    (x, trips), ctx = reinterpret(grow, interpreter)({"count": jnp.int32(0)}, 1.0, 50.0)
    (sentinel,) = calls
    assert isinstance(sentinel["last"], Uninitialized) and sentinel["last"].shape == ()
    assert int(sentinel["count"]) == 0
    assert int(ctx["count"]) == int(trips) == trips_by_hand(1.0, 50.0)
    # The last trip ran on x / 2.
    np.testing.assert_allclose(ctx["last"], np.sin(float(x) / 2.0), rtol=1e-6)


def test_zero_trip_returns_initializer_context():
    def initializer(ctx_before, sentinel):
        return {**sentinel, "count": jnp.int32(42), "last": jnp.float32(-7.0)}

    interpreter = interpreter_with(record_sin, initializer=initializer)
    (_, trips), ctx = reinterpret(grow, interpreter)({"count": jnp.int32(0)}, 10.0, 1.0)
    assert int(trips) == 0
    # No entry invented: exactly the initializer's context.
    assert set(ctx) == {"count", "last"}
    assert int(ctx["count"]) == 42 and float(ctx["last"]) == -7.0
    (_, trips), ctx = jax.jit(reinterpret(grow, interpreter))({"count": jnp.int32(0)}, 10.0, 1.0)
    assert int(ctx["count"]) == 42 and float(ctx["last"]) == -7.0


def test_updater_merges_each_trip():
    def initializer(ctx_before, sentinel):
        return {**sentinel, "last": jnp.float32(0.0)}

    def updater(carried, new):
        return {**new, "last": carried["last"] + new["last"]}

    interpreter = interpreter_with(record_sin, initializer=initializer, updater=updater)
    (_, trips), ctx = reinterpret(grow, interpreter)({"count": jnp.int32(0)}, 1.0, 40.0)
    xs = [2.0**k for k in range(int(trips))]
    np.testing.assert_allclose(ctx["last"], np.sum(np.sin(xs)), rtol=1e-5)


def test_missing_initializer_is_a_clear_error():
    with pytest.raises(ValueError, match="initializer") as info:
        reinterpret(grow, interpreter_with(record_sin))({"count": jnp.int32(0)}, 1.0, 5.0)
    message = str(info.value)
    assert "'while'" in message
    assert f"test_while.py:{LINES['while']}" in message
    assert "ctx['last']" in message
    assert "default_while_handler" in message


def test_initializer_leaving_uninitialized_is_a_clear_error():
    interpreter = interpreter_with(record_sin, initializer=lambda before, sentinel: sentinel)
    with pytest.raises(ValueError, match="Uninitialized") as info:
        reinterpret(grow, interpreter)({"count": jnp.int32(0)}, 1.0, 5.0)
    message = str(info.value)
    assert "'while'" in message and "ctx['last']" in message
    assert f"test_while.py:{LINES['while']}" in message


# ---------------------------------------------------------------------------
# The condition.
# ---------------------------------------------------------------------------


def sin_in_condition(x):
    def cond(state):
        return jnp.sin(state[0]) < 0.9  # `sin` runs once per test of the condition

    def body(state):
        x, n = state
        return x + jnp.sin(x) * 0.0 + 0.25, n + 1

    LINES["cond_while"] = _next_line()
    return lax.while_loop(cond, body, (x, jnp.int32(0)))


def test_condition_changing_context_is_a_clear_error():
    with pytest.raises(ValueError, match="condition") as info:
        reinterpret(sin_in_condition, interpreter_with(count_sin))(0, jnp.float32(0.0))
    message = str(info.value)
    assert "'while'" in message
    assert f"test_while.py:{LINES['cond_while']}" in message
    assert "thread_condition=True" in message


@pytest.mark.parametrize("x0", [0.0, 0.6, 1.5])
def test_thread_condition_counts_trips_plus_one(x0):
    trips = 0
    x = x0
    while np.sin(np.float32(x)) < 0.9:
        x = np.float32(x) + np.float32(0.25)
        trips += 1
    interpreter = interpreter_with(count_sin, thread_condition=True)
    (_, n), ctx = reinterpret(sin_in_condition, interpreter)(0, jnp.float32(x0))
    assert int(n) == trips
    # Once per body trip, and once per test of the condition (trips + 1).
    assert int(ctx) == trips + (trips + 1)
    (_, n), ctx = jax.jit(reinterpret(sin_in_condition, interpreter))(0, jnp.float32(x0))
    assert int(ctx) == 2 * trips + 1


def test_thread_condition_without_context_changes():
    interpreter = interpreter_with(count_sin, thread_condition=True)
    (x, trips), ctx = reinterpret(grow, interpreter)(0, 1.0, 30.0)
    assert int(ctx) == int(trips) == trips_by_hand(1.0, 30.0)
    assert float(x) == 32.0


@jax.jit
def jitted_below_three(state):
    return state[0] < 3


@jax.custom_vjp
def doubled(x):
    return x * 2


doubled.defvjp(lambda x: (doubled(x), None), lambda _, g: (g * 2,))


CONDITIONS_WITH_CONTROL_FLOW = {
    "jit": jitted_below_three,
    "custom_jvp": lambda s: jax.nn.relu(s[0]) < 3,
    "custom_vjp": lambda s: doubled(s[0]) < 6,
    "scan": lambda s: lax.scan(lambda c, _: (c, None), s[0], None, length=2)[0] < 3,
    "cond": lambda s: lax.cond(s[0] < 3, lambda: True, lambda: False),
    "checkpoint": lambda s: jax.checkpoint(lambda i: i < 3)(s[0]),
    "nested_jit": jax.jit(
        lambda s: jax.jit(lambda i: lax.cond(i < 3, lambda: True, lambda: False))(s[0])
    ),
    "while": lambda s: (
        lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0], c[1] + 1), (s[0], 0))[0] < 3
    ),
}


@pytest.mark.parametrize("name", list(CONDITIONS_WITH_CONTROL_FLOW))
def test_condition_with_control_flow_but_no_effect(name):
    """Control flow in the condition threads the context through without changing it:
    that is not a change of the context."""
    condition = CONDITIONS_WITH_CONTROL_FLOW[name]

    def fn(x):
        return lax.while_loop(condition, lambda s: (s[0] + 1, jnp.sin(s[1])), (0, x))[1]

    x = jnp.array([0.5, 1.0])
    identity = reinterpret(fn, Interpreter(default_dispatcher()))
    out, ctx = identity(jnp.int32(7), x)
    np.testing.assert_allclose(out, fn(x), rtol=1e-6)
    assert int(ctx) == 7
    counting = reinterpret(fn, interpreter_with(count_sin))
    for interpreted in (counting, jax.jit(counting)):
        out, ctx = interpreted(jnp.int32(0), x)
        np.testing.assert_allclose(out, jnp.sin(jnp.sin(jnp.sin(x))), rtol=1e-6)
        assert int(ctx) == 3


def test_condition_changing_context_inside_jit_is_still_an_error():
    @jax.jit
    def condition(state):
        return jnp.sin(state[0]) < 0.9

    def fn(x):
        return lax.while_loop(condition, lambda s: (s[0] + 0.5, s[1] * 2), (0.0, x))[1]

    with pytest.raises(ValueError, match="changes the context"):
        reinterpret(fn, interpreter_with(count_sin))(jnp.int32(0), jnp.ones(2))


# ---------------------------------------------------------------- batched predicate


def sin_in_condition_vmapped():
    """`sin_in_condition` under `vmap` over starting points that need different
    numbers of trips: the staged `while` has a batched predicate (`bool[3]`)."""
    return jax.vmap(sin_in_condition), jnp.array([0.0, 0.6, 1.5], jnp.float32)


def test_vmapped_loop_has_a_batched_predicate():
    f, xs = sin_in_condition_vmapped()
    (eqn,) = [e for e in jax.make_jaxpr(f)(xs).jaxpr.eqns if e.primitive.name == "while"]
    assert eqn.params["cond_jaxpr"].out_avals[0].shape == (3,)


def count_mul(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [lax.mul(*invals)])


@pytest.mark.parametrize(
    ("thread_condition", "name", "handler"),
    [(False, "mul", count_mul), (True, "sin", count_sin)],
)
def test_batched_predicate_matches_vmap_bit_for_bit(thread_condition, name, handler):
    # Each element stops at its own trip; the loop runs as long as the longest,
    # and the context counts the trips the loop ran (the longest one's).
    f, xs = sin_in_condition_vmapped()
    trips = [0, 0, 0]
    for i, x0 in enumerate([0.0, 0.6, 1.5]):
        x = np.float32(x0)
        while np.sin(x) < 0.9:
            x = x + np.float32(0.25)
            trips[i] += 1
    assert len(set(trips)) > 1
    dispatcher = default_dispatcher().register_handler(name, handler)
    if thread_condition:
        dispatcher.register_handler(
            "while", functools.partial(default_while_handler, thread_condition=True)
        )
    interpreter = Interpreter(dispatcher)
    for transform in (lambda g: g, jax.jit):
        (x, n), ctx = transform(reinterpret(f, interpreter))(0, xs)
        want_x, want_n = transform(f)(xs)
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(n, want_n)
        assert n.tolist() == trips
        # `mul` runs once per trip, in the body; `sin` once per trip in the body
        # and once per test of the condition (trips + 1).
        assert int(ctx) == (2 * max(trips) + 1 if thread_condition else max(trips))


def test_effects_on_a_loop_with_a_batched_predicate():
    # Every effect threads its context through a vmapped loop whose condition
    # depends on the data; before, carrying the context crashed in JAX's lowering.
    from kups.checks import check, checked
    from kups.debug import find_nans
    from kups.harvest import reap, sow
    from kups.instrument import count_primitives

    def f(x):
        def cond(state):
            check(state[0] < 100.0, "x stays below 100")
            return jnp.sin(state[0]) < 0.9

        def body(state):
            x = sow(state[0], tag="t", name="x", mode="clobber", init=-1.0)
            return x + 0.25, state[1] + 1

        return lax.while_loop(cond, body, (x, jnp.int32(0)))

    g = jax.vmap(f)
    xs = jnp.array([0.0, 0.6, 1.5], jnp.float32)
    want = g(xs)
    assert want[1].tolist() == [5, 3, 0]
    for transform in (lambda h: h, jax.jit):
        for wrap in (checked, find_nans, lambda h: find_nans(h, report="first"), count_primitives):
            out, result = transform(wrap(g))(xs)
            for got, expected in zip(out, want, strict=True):
                np.testing.assert_array_equal(got, expected)
            assert not getattr(result, "found", False)
        out, reaped = transform(reap(g, tag="t"))(xs)
        # The body ran five times for all three elements: an element that had
        # stopped was sown with its final value (see docs/sharp-bits.md); the
        # one that ran five trips, with its value before the last.
        final = np.asarray(want[0])
        np.testing.assert_array_equal(reaped["x"], [final[0] - np.float32(0.25), *final[1:]])
    counts = count_primitives(g)(xs)[1]
    assert counts["sin"] == 6  # the condition: five trips, plus the first test
