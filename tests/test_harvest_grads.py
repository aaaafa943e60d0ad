"""`kups.harvest.reap_grads`: the gradient with respect to each sown value equals
what plain JAX gives with a zero perturbation added at the sow by hand and
`jax.grad` with respect to it, eagerly and jitted, through `scan`, `while_loop`,
`cond`, `remat`, `shard_map`, `nest` and under `vmap`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from kups.harvest import nest, reap, reap_grads, sow

XS = jnp.array([0.5, -1.0, 2.0, 0.25, 1.5], jnp.float32)
W = jnp.float32(0.7)


def close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.shape(a) == np.shape(e)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6)


def by_hand(loss, zeros, *args):
    """`loss(delta, *args)` adds `delta` at the sow by hand: its value and the
    gradient with respect to `delta` at zero, in plain JAX."""
    return jax.value_and_grad(loss)(zeros, *args)


def run(wrapped, jit, *args):
    return (jax.jit(wrapped) if jit else wrapped)(*args)


JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@JIT
def test_plain(jit):
    def loss(w, xs):
        h = sow(jnp.tanh(w * xs), tag="g", name="h")
        return jnp.sum(h**2 * xs)

    def loss_by_hand(delta, w, xs):
        h = jnp.tanh(w * xs) + delta
        return jnp.sum(h**2 * xs)

    out, grads = run(reap_grads(loss, tag="g"), jit, W, XS)
    value, grad = by_hand(loss_by_hand, jnp.zeros(5), W, XS)
    close((out, grads), (value, {"h": grad}))


@JIT
def test_append_in_scan_one_entry_per_iteration(jit):
    def loss(w, xs):
        def step(c, x):
            h = sow(jnp.sin(w * x + c), tag="g", name="h", mode="append")
            return c + h * h, None

        return lax.scan(step, 0.0, xs)[0]

    def loss_by_hand(deltas, w, xs):
        def step(c, x_delta):
            x, delta = x_delta
            h = jnp.sin(w * x + c) + delta
            return c + h * h, None

        return lax.scan(step, 0.0, (xs, deltas))[0]

    out, grads = run(reap_grads(loss, tag="g"), jit, W, XS)
    value, grad = by_hand(loss_by_hand, jnp.zeros(5), W, XS)
    close((out, grads), (value, {"h": grad}))
    assert grads["h"].shape == reap(loss, tag="g")(W, XS)[1]["h"].shape == (5,)


def clobber_loop(w, n):
    def body(i, c):
        return sow(jnp.sin(c) * w, tag="g", name="c", mode="clobber", init=0.0)

    return lax.fori_loop(0, n, body, 1.0) ** 2


def clobber_loop_by_hand(delta, w, n):
    return lax.fori_loop(0, n, lambda i, c: jnp.sin(c) * w + delta, 1.0) ** 2


@JIT
def test_clobber_in_a_static_fori_loop_sums_over_the_sows(jit):
    wrapped = reap_grads(clobber_loop, tag="g")
    out, grads = (jax.jit(wrapped, static_argnums=1) if jit else wrapped)(W, 4)
    value, grad = by_hand(clobber_loop_by_hand, jnp.float32(0.0), W, 4)
    close((out, grads), (value, {"c": grad}))
    assert grads["c"] != 0.0


def test_a_while_loop_fails_as_it_does_by_hand():
    # JAX has no reverse-mode derivative of a while_loop (fori_loop with traced
    # bounds): neither by hand nor through reap_grads.
    message = "Reverse-mode differentiation does not work for lax.while_loop"
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda w, n: by_hand(clobber_loop_by_hand, jnp.float32(0.0), w, n))(W, 4)
    with pytest.raises(ValueError, match=message):
        jax.jit(reap_grads(clobber_loop, tag="g"))(W, 4)
    # Forward through the loop, the reaped value is the last iteration's.
    _, sown = jax.jit(reap(clobber_loop, tag="g"))(W, 4)
    c = 1.0
    for _ in range(4):
        c = np.sin(np.float32(c)) * np.float32(W)
    np.testing.assert_allclose(sown["c"], c, rtol=1e-6)


@JIT
def test_cond_and_remat(jit):
    def loss(w, x):
        h = lax.cond(
            x > 0,
            lambda v: sow(jnp.sin(v), tag="g", name="h"),
            lambda v: sow(jnp.cos(v), tag="g", name="h"),
            w * x,
        )
        r = jax.checkpoint(lambda v: sow(jnp.exp(v) * v, tag="g", name="r"))(h)
        return r * h

    def loss_by_hand(deltas, w, x):
        h = lax.cond(x > 0, jnp.sin, jnp.cos, w * x) + deltas["h"]
        r = jax.checkpoint(lambda v: jnp.exp(v) * v + deltas["r"])(h)
        return r * h

    zeros = {"h": jnp.float32(0.0), "r": jnp.float32(0.0)}
    for x in [jnp.float32(1.3), jnp.float32(-0.4)]:
        out, grads = run(reap_grads(loss, tag="g"), jit, W, x)
        value, grad = by_hand(loss_by_hand, zeros, W, x)
        close((out, grads), (value, grad))


@JIT
def test_shard_map_one_entry_per_shard(jit, mesh8):
    def loss(w, x):
        def body(block):
            h = sow(jnp.tanh(w * block), tag="g", name="h")
            return h * h

        return jnp.sum(jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x))

    def loss_by_hand(deltas, w, x):
        def body(block, delta):
            h = jnp.tanh(w * block) + delta[0]
            return h * h

        sm = jax.shard_map(body, mesh=mesh8, in_specs=(P("i"), P("i")), out_specs=P("i"))
        return jnp.sum(sm(x, deltas))

    x = jnp.arange(16.0, dtype=jnp.float32) / 8
    out, grads = run(reap_grads(loss, tag="g"), jit, W, x)
    value, grad = by_hand(loss_by_hand, jnp.zeros((8, 2)), W, x)
    close((out, grads), (value, {"h": grad}))
    assert grads["h"].shape == reap(loss, tag="g")(W, x)[1]["h"].shape


def test_nest_scopes_has_aux_allowlist_and_vmap():
    def layer(x):
        return sow(jnp.tanh(x), tag="g", name="out")

    def model(w, x):
        y = nest(layer, scope="second")(nest(layer, scope="first")(w * x))
        return y * y, {"y": y}

    def by_hand_loss(deltas, w, x):
        a = jnp.tanh(w * x) + deltas["first"]["out"]
        y = jnp.tanh(a) + deltas["second"]["out"]
        return y * y

    zeros = {"first": {"out": jnp.float32(0.0)}, "second": {"out": jnp.float32(0.0)}}
    (loss, aux), grads = reap_grads(model, tag="g", has_aux=True)(W, 0.3)
    value, grad = by_hand(by_hand_loss, zeros, W, 0.3)
    close((loss, grads), (value, grad))
    np.testing.assert_allclose(aux["y"] ** 2, loss, rtol=1e-6)
    _, only_first = reap_grads(model, tag="g", has_aux=True, allowlist=["first"])(W, 0.3)
    close(only_first, {"first": grad["first"]})

    batched = jax.vmap(reap_grads(model, tag="g", has_aux=True), in_axes=(None, 0))
    (losses, _), grads = jax.jit(batched)(W, XS)
    for i, x in enumerate(XS):
        value, grad = by_hand(by_hand_loss, zeros, W, x)
        close((losses[i], jax.tree.map(lambda g, i=i: g[i], grads)), (value, grad))


def test_reap_grads_checks_its_arguments():
    with pytest.raises(TypeError, match="callable"):
        reap_grads(3, tag="g")
    with pytest.raises(TypeError, match="has_aux"):
        reap_grads(lambda x: x, tag="g", has_aux=1)
    with pytest.raises(TypeError, match="not hashable"):
        reap_grads(lambda x: x, tag=["g"])


def _custom_functions():
    """A `custom_jvp` and a `custom_vjp` function whose body sows its scale."""

    @jax.custom_jvp
    def by_jvp(x):
        return x * sow(jnp.float32(1.0), tag="knob", name="scale")

    by_jvp.defjvp(lambda primals, tangents: (by_jvp(primals[0]), tangents[0]))

    @jax.custom_vjp
    def by_vjp(x):
        return x * sow(jnp.float32(1.0), tag="knob", name="scale")

    by_vjp.defvjp(lambda x: (by_vjp(x), None), lambda _, ct: (ct,))
    return {"custom_jvp": by_jvp, "custom_vjp": by_vjp}


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_planted_value_read_inside_a_custom_derivative_is_not_differentiated_silently(kind, jit):
    from kups.harvest import plant

    fn = _custom_functions()[kind]

    def planted(scale, x):
        return plant(fn, tag="knob")({"scale": scale}, x)

    wrap = jax.jit if jit else (lambda f: f)
    scale, x = jnp.float32(5.0), jnp.float32(3.0)
    assert wrap(planted)(scale, x) == 15.0
    # With respect to the argument: the user's rule (which says 1).
    assert wrap(jax.grad(planted, argnums=1))(scale, x) == 1.0
    # With respect to the planted value: the rule does not say; plain JAX refuses
    # a differentiated value closed over the same way. Not a silent zero.
    with pytest.raises(ValueError, match=f"differentiating a {kind} function .*`plant`"):
        wrap(jax.grad(planted))(scale, x)
    stopped = lambda s, x: planted(lax.stop_gradient(s), x)  # noqa: E731
    assert wrap(jax.grad(stopped))(scale, x) == 0.0
    with pytest.raises(ValueError, match=f"differentiating a {kind} function"):
        reap_grads(lambda x: fn(x) * 2.0, tag="knob")(x)


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_planted_value_a_custom_derivative_only_passes_on_is_differentiated(kind, jit):
    # The custom function's body sows a name that is not planted and calls
    # `jax.nn.relu` (a custom_jvp of its own): kups threads the context through
    # both, but the function's outputs are not computed from the planted value,
    # so the derivative with respect to it is known (the context's path only).
    from kups.harvest import plant

    if kind == "custom_jvp":

        @jax.custom_jvp
        def inner(x):
            return jax.nn.relu(sow(x, tag="t", name="unplanted", mode="clobber")) * 2.0

        inner.defjvp(lambda p, t: (inner(p[0]), t[0] * 2.0))
    else:

        @jax.custom_vjp
        def inner(x):
            return jax.nn.relu(sow(x, tag="t", name="unplanted", mode="clobber")) * 2.0

        inner.defvjp(lambda x: (inner(x), None), lambda _, ct: (ct * 2.0,))

    def f(x):
        k = sow(x * 3.0, tag="t", name="k", mode="clobber")
        return inner(x) + k * k

    def planted(k, x):
        return plant(f, tag="t")({"k": k}, x)

    wrap = jax.jit if jit else (lambda f: f)
    k, x = jnp.float32(2.0), jnp.float32(0.5)
    assert wrap(jax.grad(planted))(k, x) == 4.0  # d(k * k)/dk
    assert wrap(jax.grad(planted, argnums=1))(k, x) == 2.0  # the rule's; k is planted
    assert wrap(reap_grads(f, tag="t", allowlist=["k"]))(x)[1] == {"k": 3.0}  # 2k at k = 3x


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_custom_derivative_that_reads_no_differentiated_context_value_is_left_alone(jit):
    # The context enters the custom_jvp's loop (a sow inside), but its outputs
    # read none of it: the value sown before, differentiated, is no reason to refuse.
    @jax.custom_jvp
    def g(x):
        def step(c, _):
            c = c * 1.5
            return c, sow(c, tag="t", name="trajectory", mode="append")

        return lax.scan(step, x, length=3)[0]

    g.defjvp(lambda primals, tangents: (g(primals[0]), 2.0 * tangents[0]))

    def f(x):
        return g(sow(x, tag="t", name="a", mode="clobber"))

    loss = lambda x: reap(f, tag="t")(x)[0]  # noqa: E731
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    assert grad(jnp.float32(1.0)) == jax.grad(f)(jnp.float32(1.0)) == 2.0


def test_a_planted_custom_vjp_in_an_eager_shard_map_runs(mesh8):
    # An eager shard_map runs no custom_vjp declared with symbolic zeros: there
    # the planted value is not watched, and the function runs as before.
    from kups.harvest import plant

    by_vjp = _custom_functions()["custom_vjp"]

    def body(x):
        return plant(by_vjp, tag="knob")({"scale": jnp.float32(5.0)}, x)

    mapped = jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))
    x = jnp.arange(8.0)
    for fn in (mapped, jax.jit(mapped)):
        np.testing.assert_array_equal(fn(x), 5.0 * x)
        np.testing.assert_array_equal(jax.grad(lambda x, fn=fn: fn(x).sum())(x), jnp.ones(8))
