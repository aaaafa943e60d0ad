"""`kups.harvest` where Oryx's harvest sets the expectation: tags of any hashable
type, `sow_cond`, `plant` keeping `reap`'s control-flow rules, and sows inside a
`custom_jvp` rule under an outer `jvp`.

Expected values come from plain JAX or are computed by hand, never from kups.
"""

import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kups.harvest import harvest, nest, plant, reap, sow, sow_cond

XS = jnp.array([0.5, -1.0, 2.0, -0.25, 1.5], jnp.float32)


class Kind(enum.Enum):
    ACTIVATION = 1
    LOSS = 2


def raises(exception, *fragments):
    return pytest.raises(
        exception, match="(?s)" + ".*".join(map(__import__("re").escape, fragments))
    )


# ---------------------------------------------------------------- tags


@pytest.mark.parametrize("tag", [7, 2.5, ("layer", 3), Kind.ACTIVATION, "plain"])
def test_any_hashable_tag_reaps_plants_and_harvests(tag):
    other = Kind.LOSS if tag != Kind.LOSS else "other"

    def f(x):
        y = sow(jnp.sin(x), tag=tag, name="y")
        z = sow(y * 3.0, tag=other, name="z")
        return z + 1.0

    x = jnp.float32(0.3)
    out, sown = jax.jit(reap(f, tag=tag))(x)
    np.testing.assert_array_equal(out, jnp.sin(x) * 3.0 + 1.0)
    assert list(sown) == ["y"]
    np.testing.assert_array_equal(sown["y"], jnp.sin(x))
    np.testing.assert_array_equal(plant(f, tag=tag)({"y": 2.0}, x), 7.0)
    out, reaped = harvest(f, tag=tag)({"y": 1.0}, x)
    assert out == 4.0 and reaped == {}
    _, scoped = reap(nest(f, scope="s"), tag=tag)(x)
    np.testing.assert_array_equal(scoped["s"]["y"], jnp.sin(x))


def test_tags_are_compared_by_equality():
    def f(x):
        sow(x, tag=("a", 1), name="first")
        sow(x + 1.0, tag=("a", 2), name="second")
        return x

    _, sown = reap(f, tag=("a", 1))(jnp.float32(1.0))
    assert list(sown) == ["first"]
    _, sown = reap(f, tag=("a", 2))(jnp.float32(1.0))
    assert list(sown) == ["second"] and sown["second"] == 2.0


def test_enum_tag_inside_scan():
    def f(xs):
        def step(c, x):
            return c + sow(x * x, tag=Kind.ACTIVATION, name="sq", mode="append"), None

        return lax.scan(step, 0.0, xs)[0]

    out, sown = jax.jit(reap(f, tag=Kind.ACTIVATION))(XS)
    np.testing.assert_allclose(out, jnp.sum(XS * XS), rtol=1e-6)
    np.testing.assert_array_equal(sown["sq"], XS * XS)


# ---------------------------------------------------------------- sow_cond


def last_negative(xs, init=0.0):
    def step(carry, x):
        sow_cond(x * 10.0, x < 0, tag="t", name="last", init=init)
        return carry + x, None

    return lax.scan(step, 0.0, xs)[0]


def by_hand_last(xs, pred, default):
    """The value of the last iteration where `pred` held, by plain Python."""
    value = default
    for x in np.asarray(xs):
        if pred(x):
            value = x * 10.0
    return np.float32(value)


@pytest.mark.parametrize("jit", [False, True])
def test_sow_cond_in_scan_keeps_the_last_value_where_pred_held(jit):
    wrapped = reap(last_negative, tag="t")
    wrapped = jax.jit(wrapped) if jit else wrapped
    out, sown = wrapped(XS)
    np.testing.assert_allclose(out, jnp.sum(XS), rtol=1e-6)
    np.testing.assert_array_equal(sown["last"], by_hand_last(XS, lambda x: x < 0, 0.0))
    # pred never holds: the init.
    _, sown = wrapped(jnp.abs(XS))
    np.testing.assert_array_equal(sown["last"], 0.0)


def test_sow_cond_in_reversed_scan_keeps_the_last_iteration_to_run():
    def f(xs):
        def step(c, x):
            sow_cond(x * 10.0, x < 0, tag="t", name="last", init=-7.0)
            return c, None

        return lax.scan(step, 0.0, xs, reverse=True)[0]

    _, sown = reap(f, tag="t")(XS)
    np.testing.assert_array_equal(sown["last"], by_hand_last(XS[::-1], lambda x: x < 0, -7.0))


def test_sow_cond_in_while_and_fori_loop():
    def f(x):
        def body(carry):
            i, v = carry
            sow_cond(v, v > 3.0, tag="t", name="big", init=-1.0)
            return i + 1, v * 1.5

        return lax.while_loop(lambda c: c[0] < 6, body, (0, x))[1]

    for x in [1.0, 5.0, 0.1]:
        out, sown = jax.jit(reap(f, tag="t"))(jnp.float32(x))
        values = [np.float32(x) * np.float32(1.5) ** k for k in range(6)]
        expected = [v for v in values if v > 3.0]
        np.testing.assert_allclose(out, jax.jit(f)(jnp.float32(x)))
        np.testing.assert_allclose(sown["big"], expected[-1] if expected else -1.0, rtol=1e-6)


def test_sow_cond_after_a_clobber_sow_needs_no_init():
    def f(xs):
        sow(jnp.float32(100.0), tag="t", name="last", mode="clobber")

        def step(c, x):
            sow_cond(x * 10.0, x < 0, tag="t", name="last")
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    np.testing.assert_array_equal(reap(f, tag="t")(jnp.abs(XS))[1]["last"], 100.0)
    np.testing.assert_array_equal(
        reap(f, tag="t")(XS)[1]["last"], by_hand_last(XS, lambda x: x < 0, 0)
    )


def test_sow_cond_outside_a_loop_and_in_cond():
    def f(x):
        return sow_cond(x, x > 0, tag="t", name="pos", init=0.0) * 2.0

    for x in [2.0, -2.0]:
        out, sown = jax.jit(reap(f, tag="t"))(jnp.float32(x))
        assert out == 2.0 * x and sown["pos"] == max(x, 0.0)

    def g(x):
        return lax.cond(
            x > 0, lambda v: sow_cond(v, v > 1, tag="t", name="c", init=5.0), lambda v: v, x
        )

    assert reap(g, tag="t")(jnp.float32(3.0))[1]["c"] == 3.0
    assert reap(g, tag="t")(jnp.float32(0.5))[1]["c"] == 5.0
    assert reap(g, tag="t")(jnp.float32(-1.0))[1]["c"] == 5.0


def test_sow_cond_without_init_in_a_loop_is_an_error():
    with raises(
        ValueError, "name 'last'", "sow_cond", "inside the scan", "pred may never hold", "init="
    ):
        reap(last_negative, tag="t")(XS, None)

    def outside(x):
        return sow_cond(x, x > 0, tag="t", name="pos")

    with raises(ValueError, "sow_cond", "no value before", "init="):
        reap(outside, tag="t")(1.0)


def test_sow_cond_checks_pred():
    with raises(TypeError, "boolean scalar", "jnp.any"):
        sow_cond(XS, XS > 0, tag="t", name="x", init=0.0)


def test_sow_cond_outside_reap_is_the_identity_and_differentiates():
    np.testing.assert_array_equal(jax.jit(last_negative)(XS), jnp.sum(XS))
    grad = jax.grad(lambda xs: reap(last_negative, tag="t")(xs)[1]["last"])(XS)
    expected = np.zeros(5, np.float32)
    expected[3] = 10.0  # the last negative entry
    np.testing.assert_array_equal(grad, expected)


def test_plant_sow_cond_replaces_where_pred_holds():
    def f(x):
        return sow_cond(x, x > 0, tag="t", name="pos", init=0.0) + 1.0

    assert plant(f, tag="t")({"pos": 10.0}, jnp.float32(2.0)) == 11.0
    assert plant(f, tag="t")({"pos": 10.0}, jnp.float32(-2.0)) == -1.0
    out, sown = reap(plant(f, tag="t"), tag="t")({"pos": 10.0}, jnp.float32(2.0))
    assert out == 11.0 and sown["pos"] == 10.0


# ---------------------------------------------------------------- plant keeps reap's rules


def strict_in_while(x):
    return lax.while_loop(lambda v: v < 10.0, lambda v: sow(v, tag="t", name="x") * 2.0, x)


def one_branch_sows(x):
    return lax.cond(x > 0, lambda v: sow(v, tag="t", name="x"), lambda v: v, x)


def strict_in_scan(xs):
    return lax.scan(lambda c, x: (c + sow(x, tag="t", name="x"), None), 0.0, xs)[0]


@pytest.mark.parametrize(
    ("fn", "arg", "fragments"),
    [
        (strict_in_while, jnp.float32(1.0), ("mode='strict'", "inside the while_loop")),
        (one_branch_sows, jnp.float32(1.0), ("sown in branch 1", "but not in branch 0")),
        (strict_in_scan, XS, ("mode='strict'", "inside the scan")),
    ],
)
def test_plant_gives_the_error_reap_gives(fn, arg, fragments):
    with pytest.raises(ValueError) as reaped:
        reap(fn, tag="t")(arg)
    with pytest.raises(ValueError) as planted:
        plant(fn, tag="t")({"x": jnp.float32(4.0)}, arg)
    assert str(planted.value) == str(reaped.value)
    assert all(fragment in str(planted.value) for fragment in fragments)


def test_plant_of_a_name_sown_before_the_cond_is_fine():
    def f(x):
        x = sow(x, tag="t", name="x", mode="clobber")
        return lax.cond(
            x > 0, lambda v: sow(v * 2.0, tag="t", name="x", mode="clobber"), lambda v: v, x
        )

    assert plant(f, tag="t")({"x": jnp.float32(4.0)}, jnp.float32(-1.0)) == 4.0


# ---------------------------------------------------------------- custom_jvp rules


@jax.custom_jvp
def soft(x):
    return jnp.tanh(x)


@soft.defjvp
def soft_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = sow(jnp.tanh(x), tag="t", name="in_rule")
    return y, (1.0 - y * y) * t


def uses_soft(x):
    return soft(x) * 2.0


@pytest.mark.parametrize("jit", [False, True])
def test_a_sow_in_a_custom_jvp_rule_under_an_outer_jvp_reaps_the_primal_value(jit):
    def run(x, t):
        return jax.jvp(reap(uses_soft, tag="t"), (x,), (t,))

    run = jax.jit(run) if jit else run
    x, t = jnp.float32(0.7), jnp.float32(1.0)
    (out, sown), (out_dot, sown_dot) = run(x, t)
    plain_out, plain_dot = jax.jvp(uses_soft, (x,), (t,))
    np.testing.assert_allclose(out, plain_out, rtol=1e-6)
    np.testing.assert_allclose(out_dot, plain_dot, rtol=1e-6)
    np.testing.assert_allclose(sown["in_rule"], jnp.tanh(x), rtol=1e-6)
    assert sown_dot["in_rule"] == 0.0  # the reaped value's tangent is zero
    # Without a jvp JAX does not run the rule, and neither does reap.
    assert reap(uses_soft, tag="t")(x)[1] == {}


def test_a_sow_in_a_custom_jvp_rule_under_grad_outside_reap():
    def loss(x):
        out, sown = reap(uses_soft, tag="t")(x)
        return out + 0.0 * sown.get("in_rule", 0.0)

    np.testing.assert_allclose(jax.grad(loss)(0.7), jax.grad(uses_soft)(0.7), rtol=1e-6)


def test_sow_cond_in_a_scan_inside_shard_map(mesh8):
    from jax.sharding import PartitionSpec as P

    def f(x):
        def body(block):
            def step(c, v):
                sow_cond(v, v > 0.5, tag="t", name="last", init=-1.0)
                return c + v, None

            return lax.scan(step, jnp.zeros_like(block[0]), block)[0][None]

        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.linspace(0.0, 1.0, 16, dtype=jnp.float32)
    out, sown = jax.jit(reap(f, tag="t"))(x)
    np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-6)
    blocks = np.asarray(x).reshape(8, 2)
    expected = [([v for v in block if v > 0.5] or [-1.0])[-1] for block in blocks]
    np.testing.assert_allclose(sown["last"], expected, rtol=1e-6)


def test_sow_cond_under_vmap():
    def f(x):
        return sow_cond(x * 2.0, x > 0.5, tag="t", name="a", init=0.0)

    x = jnp.linspace(0.0, 1.0, 5, dtype=jnp.float32)
    _, sown = jax.vmap(reap(f, tag="t"))(x)
    np.testing.assert_allclose(sown["a"], np.where(np.asarray(x) > 0.5, 2 * np.asarray(x), 0.0))
