"""A handler that counts `sin` gives exact counts through every control-flow
primitive: a scan body `length` times, a while body its dynamic trip count, a
cond only its taken branch; jit, checkpoint, custom_jvp, custom_vjp and
closed_call once per call; nested; eagerly, under `jax.jit` and under
differentiation. Every expected count is worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core.primitives import closed_call_p

from kups.effects import HandlerResult, Interpreter, default_dispatcher, reinterpret

X = jnp.array([0.3, -0.7, 1.1], jnp.float32)


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def counting(fn):
    return reinterpret(fn, Interpreter(default_dispatcher().register_handler("sin", count_sin)))


def closed_call(fn, *example):
    """`fn` staged as a `closed_call` equation."""
    closed = jax.make_jaxpr(fn)(*example)
    bind_params = closed_call_p.get_bind_params({"call_jaxpr": closed})

    def call(*args):
        (out,) = closed_call_p.bind(*args, **bind_params)
        return out

    return call


@jax.custom_jvp
def sin_custom_jvp(x):
    return jnp.sin(jnp.sin(x))  # two sins


@sin_custom_jvp.defjvp
def _sin_custom_jvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    return sin_custom_jvp(x), jnp.cos(jnp.sin(x)) * jnp.cos(x) * t


@jax.custom_vjp
def sin_custom_vjp(x):
    return jnp.sin(x) * 3.0  # one sin


def _sin_custom_vjp_fwd(x):
    return sin_custom_vjp(x), x


def _sin_custom_vjp_bwd(x, g):
    return (3.0 * jnp.cos(x) * g,)


sin_custom_vjp.defvjp(_sin_custom_vjp_fwd, _sin_custom_vjp_bwd)


def scan_sins(x, length=5, per_step=2, **kwargs):
    def body(c, _):
        for _ in range(per_step):
            c = jnp.sin(c)
        return c, None

    return lax.scan(body, x, None, length=length, **kwargs)[0]


def while_sins(x, limit):
    """Adds 1 to a counter until it reaches `limit`; one sin per trip."""

    def body(state):
        i, y = state
        return i + 1, jnp.sin(y)

    return lax.while_loop(lambda s: s[0] < limit, body, (jnp.int32(0), x))[1]


def cond_sins(x):
    # The true branch has three sins, the false branch one.
    return lax.cond(
        jnp.sum(x) > 0, lambda x: jnp.sin(jnp.sin(jnp.sin(x))), lambda x: jnp.sin(x) * 2.0, x
    )


def switch_sins(i, x):
    return lax.switch(i, [lambda x: x, jnp.sin, lambda x: jnp.sin(jnp.sin(x))], x)


def nested_scan_while_cond(x, limit):
    """scan (4 steps) > while (`limit` trips) > cond (taken: 2 sins or 1)."""

    def inner(state):
        i, y = state
        y = lax.cond(i % 2 == 0, lambda y: jnp.sin(jnp.sin(y)), jnp.sin, y)
        return i + 1, y

    def body(c, _):
        return lax.while_loop(lambda s: s[0] < limit, inner, (jnp.int32(0), c))[1], None

    return lax.scan(body, x, None, length=4)[0]


def nested_jit_checkpoint_custom(x):
    """jit > checkpoint > (custom_jvp: 2 sins, custom_vjp: 1 sin, closed_call: 1 sin)."""
    inner_call = closed_call(jnp.sin, X)

    @jax.checkpoint
    def remat_body(x):
        return sin_custom_jvp(x) + sin_custom_vjp(x) + inner_call(x)

    return jax.jit(remat_body)(x)


CASES = {
    "plain": (lambda x: jnp.sin(jnp.sin(x)) + jnp.cos(x), (X,), 2),
    "scan": (scan_sins, (X,), 5 * 2),
    "scan_reverse_unroll": (lambda x: scan_sins(x, 7, 1, reverse=True, unroll=3), (X,), 7),
    "scan_length_0": (lambda x: scan_sins(x, 0), (X,), 0),
    "while": (while_sins, (X, 6), 6),
    "while_zero_trip": (while_sins, (X, 0), 0),
    "fori_dynamic": (lambda x, n: lax.fori_loop(0, n, lambda i, c: jnp.sin(c), x), (X, 9), 9),
    "cond_true": (cond_sins, (X,), 3),
    "cond_false": (cond_sins, (-X,), 1),
    "switch_0": (switch_sins, (0, X), 0),
    "switch_1": (switch_sins, (1, X), 1),
    "switch_2": (switch_sins, (2, X), 2),
    "jit": (lambda x: jax.jit(jnp.sin)(x) + jax.jit(jnp.sin)(x * 2), (X,), 2),
    "checkpoint": (jax.checkpoint(lambda x: jnp.sin(jnp.sin(x))), (X,), 2),
    "custom_jvp": (sin_custom_jvp, (X,), 2),
    "custom_vjp": (sin_custom_vjp, (X,), 1),
    "closed_call": (closed_call(lambda x: jnp.sin(x) + jnp.sin(2 * x), X), (X,), 2),
    # 4 scan steps x (3 trips: cond taken with 2, 1, 2 sins) = 4 x 5.
    "nested_scan_while_cond": (nested_scan_while_cond, (X, 3), 4 * 5),
    "nested_jit_checkpoint_custom": (nested_jit_checkpoint_custom, (X,), 2 + 1 + 1),
    # scan (3) > jit > scan (2) > checkpoint > custom_jvp (2 sins).
    "nested_scan_jit_scan": (
        lambda x: (
            scan_sins(x, 3, 0)
            + lax.scan(
                lambda c, _: (
                    jax.jit(
                        lambda c: lax.scan(
                            lambda d, _: (jax.checkpoint(sin_custom_jvp)(d), None),
                            c,
                            None,
                            length=2,
                        )[0]
                    )(c),
                    None,
                ),
                x,
                None,
                length=3,
            )[0]
        ),
        (X,),
        3 * 2 * 2,
    ),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_exact_counts(name, jit):
    fn, args, expected = CASES[name]
    interpreted = counting(fn)
    if jit:
        interpreted = jax.jit(interpreted)
    out, ctx = interpreted(jnp.int32(0), *args)
    np.testing.assert_allclose(out, fn(*args), rtol=1e-5, atol=1e-6)
    assert int(ctx) == expected


def test_counts_start_from_the_given_context():
    fn, args, expected = CASES["nested_scan_while_cond"]
    _, ctx = jax.jit(counting(fn))(jnp.int32(1000), *args)
    assert int(ctx) == 1000 + expected


def test_while_count_follows_runtime_trip_count():
    """One compiled program, different trip counts: the count is dynamic."""
    interpreted = jax.jit(counting(while_sins))
    for limit in [0, 1, 4, 11]:
        _, ctx = interpreted(jnp.int32(0), X, jnp.int32(limit))
        assert int(ctx) == limit


def test_scan_inside_while_counts_product():
    def fn(x, trips):
        def body(state):
            i, y = state
            return i + 1, scan_sins(y, length=3, per_step=1)

        return lax.while_loop(lambda s: s[0] < trips, body, (jnp.int32(0), x))[1]

    interpreted = jax.jit(counting(fn))
    for trips in [0, 2, 5]:
        out, ctx = interpreted(jnp.int32(0), X, trips)
        np.testing.assert_allclose(out, fn(X, trips), rtol=1e-5)
        assert int(ctx) == 3 * trips


GRAD_CASES = [
    "plain",
    "scan",
    "scan_reverse_unroll",
    "cond_true",
    "cond_false",
    "jit",
    "checkpoint",
    "custom_jvp",
    "custom_vjp",
    "closed_call",
    "nested_jit_checkpoint_custom",
    "nested_scan_jit_scan",
]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_counts_under_grad(name):
    fn, args, expected = CASES[name]

    def loss(x):
        out, ctx = counting(fn)(jnp.int32(0), x, *args[1:])
        return jnp.sum(out), ctx

    grad, ctx = jax.grad(loss, has_aux=True)(args[0])
    np.testing.assert_allclose(
        grad, jax.grad(lambda x: jnp.sum(fn(x, *args[1:])))(args[0]), rtol=1e-5, atol=1e-6
    )
    # The context counts what ran forward, not the derivative's work.
    assert int(ctx) == expected


@pytest.mark.parametrize("name", ["while", "nested_scan_while_cond"])
def test_counts_under_jvp(name):
    fn, args, expected = CASES[name]

    def interpreted(x):
        return counting(fn)(jnp.int32(0), x, *args[1:])

    (out, ctx), (tangent, _) = jax.jvp(interpreted, (args[0],), (jnp.ones_like(args[0]),))
    want_out, want_tangent = jax.jvp(lambda x: fn(x, *args[1:]), (args[0],), (jnp.ones_like(X),))
    np.testing.assert_allclose(out, want_out, rtol=1e-5)
    np.testing.assert_allclose(tangent, want_tangent, rtol=1e-5)
    assert int(ctx) == expected


def test_counts_under_vmap():
    fn, args, expected = CASES["nested_scan_while_cond"]
    xs = jnp.stack([X, -X, 2 * X])
    out, ctx = jax.vmap(counting(fn), in_axes=(None, 0, None))(jnp.int32(0), xs, *args[1:])
    np.testing.assert_allclose(out, jax.vmap(fn, in_axes=(0, None))(xs, *args[1:]), rtol=1e-5)
    np.testing.assert_array_equal(ctx, jnp.full((3,), expected))


def accumulate_sin(interpreter, ctx, eqn, invals):
    """A float context: the sum of every `sin` output."""
    y = jnp.sin(invals[0])
    return HandlerResult(ctx + jnp.sum(y), [y])


@pytest.mark.parametrize(
    "name", ["plain", "scan_reverse_unroll", "cond_true", "jit", "checkpoint", "closed_call"]
)
def test_float_context_is_differentiable(name):
    """The context is an ordinary value: its derivative is the derivative of what
    the handler accumulated (d/dx sum(sin(x)) = cos(x) for one sin of x)."""
    fn = {
        "plain": jnp.sin,
        "scan_reverse_unroll": lambda x: lax.scan(
            lambda c, xi: (c + jnp.sin(xi), None), 0.0, x, reverse=True, unroll=2
        )[0],
        "cond_true": lambda x: lax.cond(jnp.sum(x) > -1e9, jnp.sin, jnp.cos, x),
        "jit": jax.jit(jnp.sin),
        "checkpoint": jax.checkpoint(jnp.sin),
        "closed_call": closed_call(jnp.sin, X),
    }[name]
    interpreted = reinterpret(
        fn, Interpreter(default_dispatcher().register_handler("sin", accumulate_sin))
    )
    grad = jax.grad(lambda x: interpreted(0.0, x)[1])(X)
    np.testing.assert_allclose(grad, jnp.cos(X), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: interpreted(0.0, x)[1]))(X)
    np.testing.assert_allclose(grad, jnp.cos(X), rtol=1e-6)


def test_side_effects_in_bodies_still_run():
    calls = []

    def fn(x):
        def body(c, xi):
            jax.debug.callback(lambda v: calls.append(float(v)), xi)
            return c + jnp.sin(xi), None

        total = lax.scan(body, 0.0, x)[0]
        lax.cond(total > 0, lambda: jax.debug.callback(lambda: calls.append("taken")), lambda: None)
        return total

    x = jnp.arange(4.0)
    for interpreted in (counting(fn), jax.jit(counting(fn))):
        calls.clear()
        out, ctx = interpreted(jnp.int32(0), x)
        jax.effects_barrier()
        np.testing.assert_allclose(out, jnp.sum(jnp.sin(x)), rtol=1e-6)
        assert calls == [0.0, 1.0, 2.0, 3.0, "taken"]
        assert int(ctx) == 4
