"""`kups.harvest`: `sow`, `reap` and `plant` through every control-flow primitive,
under transformations and inside `shard_map`, and every mistake as a clear error.

Expected values come from plain JAX (the same program without harvest, or a
scan's own stacked outputs) or are computed by hand; never from kups itself.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from kups.harvest import MODES, plant, reap, sow

XS = jnp.array([0.5, -1.0, 2.0, 0.25, 1.5], jnp.float32)


def _marker_lines() -> dict[str, int]:
    """Line numbers of the `# <NAME>` markers in this file, to check that error
    messages point at the user's lines."""
    lines = {}
    with open(__file__) as source:
        for number, text in enumerate(source, start=1):
            match = re.search(r"# <(\w+)>$", text)
            if match:
                lines[match.group(1)] = number
    return lines


LINES = _marker_lines()


def at(marker: str) -> str:
    """How an error message names the line of `marker` in this file."""
    return f"test_harvest.py:{LINES[marker]}"


def assert_tree_close(actual, expected):
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)
        assert np.shape(a) == np.shape(e)


def raises(exception, *fragments):
    """`pytest.raises` whose message must contain every fragment."""

    class _Check:
        def __enter__(self):
            self.context = pytest.raises(exception)
            self.info = self.context.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.context.__exit__(*exc)
            message = str(self.info.value)
            for fragment in fragments:
                assert fragment in message, f"{fragment!r} not in:\n{message}"
            return handled

    return _Check()


# ---------------------------------------------------------------- sow alone


def with_sow(x):
    y = sow(jnp.sin(x), tag="t", name="y")
    z = sow({"a": y * 2.0, "b": (x, y + 1.0)}, tag="t", name="z", mode="clobber")
    return z["a"] + z["b"][1]


def without_sow(x):
    y = jnp.sin(x)
    return y * 2.0 + (y + 1.0)


def test_sow_is_the_identity_outside_reap_and_plant():
    x = jnp.float32(0.7)
    expected = without_sow(x)
    assert_tree_close(with_sow(x), expected)
    assert_tree_close(jax.jit(with_sow)(x), expected)
    assert_tree_close(jax.grad(with_sow)(x), jax.grad(without_sow)(x))
    assert_tree_close(jax.vmap(with_sow)(XS), jax.vmap(without_sow)(XS))
    scanned = lax.scan(lambda c, x: (c + with_sow(x), None), 0.0, XS)[0]
    assert_tree_close(scanned, lax.scan(lambda c, x: (c + without_sow(x), None), 0.0, XS)[0])


def test_sow_rejects_unknown_mode():
    with raises(ValueError, "mode='last'", "'strict'", "'append'", "'clobber'"):
        sow(1.0, tag="t", name="y", mode="last")
    assert MODES == ("strict", "append", "clobber")


@pytest.mark.parametrize("field", ["tag", "name"])
def test_sow_rejects_tag_or_name_that_is_not_a_string(field):
    kwargs = {"tag": "t", "name": "y", field: 3}
    with raises(TypeError, f"The {field} of a sown value must be a non-empty string"):
        sow(1.0, **kwargs)


def test_sow_rejects_non_array_leaves():
    with raises(TypeError, "pytree of arrays", "str"):
        sow({"a": "text"}, tag="t", name="y")


# ---------------------------------------------------------------- reap, straight-line


def test_reap_returns_output_and_sown_values():
    x = jnp.float32(0.7)
    out, sown = reap(with_sow, tag="t")(x)
    y = jnp.sin(x)
    assert_tree_close(out, without_sow(x))
    assert_tree_close(sown, {"y": y, "z": {"a": y * 2.0, "b": (x, y + 1.0)}})


def test_reap_jitted_and_with_jit_inside():
    x = jnp.float32(0.7)
    y = jnp.sin(x)
    expected = {"y": y, "z": {"a": y * 2.0, "b": (x, y + 1.0)}}
    assert_tree_close(jax.jit(reap(with_sow, tag="t"))(x)[1], expected)
    assert_tree_close(reap(jax.jit(with_sow), tag="t")(x)[1], expected)


def test_reap_static_arguments_and_empty_result():
    def f(x, scale, activation):
        return activation(sow(x * scale, tag="t", name="scaled"))

    out, sown = reap(f, tag="t")(jnp.float32(2.0), 3.0, jnp.tanh)
    assert_tree_close(sown, {"scaled": jnp.float32(6.0)})
    assert_tree_close(out, jnp.tanh(6.0))
    assert reap(f, tag="other")(jnp.float32(2.0), 3.0, jnp.tanh)[1] == {}


def test_reap_clobber_keeps_last_value_even_with_another_shape():
    def f(x):
        sow(x, tag="t", name="v", mode="clobber")
        sow(jnp.stack([x, 2 * x]), tag="t", name="v", mode="clobber")
        return x

    assert_tree_close(reap(f, tag="t")(jnp.float32(1.5))[1], {"v": jnp.array([1.5, 3.0])})


def test_reap_sows_of_other_tags_pass_through():
    def f(x):
        a = sow(x * 2.0, tag="u", name="a")
        b = sow(x * 3.0, tag="t", name="b")
        return a + b

    x = jnp.float32(1.0)
    (out, inner), outer = reap(reap(f, tag="t"), tag="u")(x)
    assert_tree_close((out, inner, outer), (jnp.float32(5.0), {"b": 3.0}, {"a": 2.0}))
    # Sows of the reaped tag are consumed: an enclosing reap of it sees nothing.
    assert reap(reap(f, tag="t"), tag="t")(x)[1] == {}


def test_reap_sows_of_other_tags_pass_through_control_flow():
    def f(xs, pred):
        def step(carry, x):
            sow(x * 2.0, tag="u", name="doubled", mode="append")
            sow(x * 3.0, tag="t", name="tripled", mode="append")
            return carry + x, None

        total = lax.scan(step, jnp.float32(0.0), xs)[0]
        return lax.cond(
            pred,
            lambda x: sow(x, tag="u", name="branch"),
            lambda x: sow(-x, tag="u", name="branch"),
            total,
        )

    (out, inner), outer = jax.jit(reap(reap(f, tag="t"), tag="u"))(XS, False)
    total = np.sum(XS)
    assert_tree_close((out, inner), (-total, {"tripled": XS * 3.0}))
    assert_tree_close(outer, {"branch": -total, "doubled": XS * 2.0})


def test_reap_strict_name_sown_twice_names_both_lines():
    def f(x):
        sow(x, tag="t", name="y")  # <STRICT_FIRST>
        return sow(x * 2.0, tag="t", name="y")  # <STRICT_SECOND>

    with raises(
        ValueError,
        "name 'y' of tag 't'",
        "sown twice with mode='strict'",
        at("STRICT_FIRST"),
        at("STRICT_SECOND"),
        "mode='clobber'",
    ):
        reap(f, tag="t")(jnp.float32(1.0))


def test_reap_strict_name_sown_twice_across_a_jit_boundary():
    def f(x):
        sow(x, tag="t", name="y")
        return jax.jit(lambda x: sow(x * 2.0, tag="t", name="y"))(x)

    with raises(ValueError, "sown twice with mode='strict'"):
        reap(f, tag="t")(jnp.float32(1.0))


def test_reap_one_name_with_two_modes_is_an_error():
    def f(x):
        sow(x, tag="t", name="y", mode="clobber")  # <MODE_FIRST>
        return sow(x, tag="t", name="y", mode="strict")  # <MODE_SECOND>

    with raises(ValueError, "mode='clobber'", "mode='strict'", at("MODE_FIRST"), at("MODE_SECOND")):
        reap(f, tag="t")(jnp.float32(1.0))


def test_reap_append_outside_a_scan_is_sown_once():
    def once(x):
        return sow(x, tag="t", name="y", mode="append")

    assert_tree_close(reap(once, tag="t")(jnp.float32(2.0))[1], {"y": jnp.float32(2.0)})

    def twice(x):
        sow(x, tag="t", name="y", mode="append")
        return sow(x, tag="t", name="y", mode="append")

    with raises(ValueError, "sown twice with mode='append'", "nowhere to go"):
        reap(twice, tag="t")(jnp.float32(2.0))

    def in_two_scans(xs):
        return running_sum(running_sum(xs)[1])

    with raises(ValueError, "sown twice with mode='append'", "in another scan"):
        reap(in_two_scans, tag="t")(XS)


def test_reap_checks_its_arguments():
    with raises(TypeError, "non-empty string"):
        reap(with_sow, tag="")
    with raises(TypeError, "callable"):
        reap(3, tag="t")


# ---------------------------------------------------------------- reap, scan


def running_sum(xs, *, reverse=False, mode="append", unroll=1, start=0.0):
    """Sows the running sum; the scan also returns it as its stacked output."""

    def step(total, x):
        total = total + x
        sow(total, tag="t", name="total", mode=mode)
        return total, total

    return lax.scan(step, jnp.float32(start), xs, reverse=reverse, unroll=unroll)


@pytest.mark.parametrize("reverse", [False, True])
def test_reap_append_in_scan_is_aligned_with_the_scan_outputs(reverse):
    (_, ys), sown = reap(running_sum, tag="t")(XS, reverse=reverse)
    assert_tree_close(sown["total"], ys)
    expected = np.cumsum(XS[::-1])[::-1] if reverse else np.cumsum(XS)
    assert_tree_close(sown["total"], expected)


def test_reap_append_in_scan_with_unroll_under_jit():
    _, sown = jax.jit(reap(running_sum, tag="t"), static_argnames="unroll")(XS, unroll=2)
    assert_tree_close(sown["total"], np.cumsum(XS))


@pytest.mark.parametrize("reverse", [False, True])
def test_reap_clobber_first_sown_in_scan_is_the_last_iteration_that_ran(reverse):
    (_, ys), sown = reap(running_sum, tag="t")(XS, reverse=reverse, mode="clobber")
    # The last iteration to run handles xs[-1], or xs[0] when reversed.
    assert_tree_close(sown["total"], ys[0] if reverse else ys[-1])


def test_reap_clobber_sown_before_and_inside_scan_is_carried():
    def f(xs):
        sow(jnp.float32(-1.0), tag="t", name="total", mode="clobber")
        return running_sum(xs, mode="clobber")

    assert_tree_close(reap(f, tag="t")(XS)[1]["total"], np.sum(XS))
    assert_tree_close(reap(f, tag="t")(XS[:0])[1]["total"], jnp.float32(-1.0))


def test_reap_zero_length_scan():
    empty = XS[:0]
    assert_tree_close(reap(running_sum, tag="t")(empty)[1], {"total": np.zeros(0, np.float32)})
    # A clobber name first sown in a scan that never runs has no value.
    assert reap(running_sum, tag="t")(empty, mode="clobber")[1] == {}


def test_reap_mixed_modes_in_one_scan_body():
    def f(xs):
        sow(xs.sum(), tag="t", name="before")

        def step(carry, x):
            sow(x * 2.0, tag="t", name="doubled", mode="append")
            sow(carry + x, tag="t", name="last", mode="clobber")
            sow(-x, tag="t", name="negated", mode="append")
            return carry + x, None

        return lax.scan(step, jnp.float32(0.0), xs)[0]

    _, sown = reap(f, tag="t")(XS)
    expected = {
        "before": np.sum(XS),
        "doubled": XS * 2.0,
        "last": np.sum(XS),
        "negated": -XS,
    }
    assert_tree_close(sown, expected)


def nested_scans(xss, *, mode="append"):
    def outer(carry, xs):
        def inner(carry, x):
            carry = carry + x
            sow(carry, tag="t", name="inner", mode=mode)
            return carry, carry

        carry, ys = lax.scan(inner, carry, xs)
        return carry, ys

    return lax.scan(outer, jnp.float32(0.0), xss)


def test_reap_nested_scans_stack_outer_then_inner():
    xss = jnp.arange(12.0).reshape(3, 4)
    (_, ys), sown = reap(nested_scans, tag="t")(xss)
    assert sown["inner"].shape == (3, 4)
    assert_tree_close(sown["inner"], ys)
    assert_tree_close(sown["inner"], np.cumsum(np.arange(12.0)).reshape(3, 4))


def test_reap_nested_scans_clobber_is_the_very_last_value():
    xss = jnp.arange(12.0).reshape(3, 4)
    _, sown = reap(nested_scans, tag="t")(xss, mode="clobber")
    assert_tree_close(sown["inner"], jnp.float32(66.0))


def test_reap_strict_inside_scan_is_an_error():
    def f(xs):
        def step(carry, x):
            return carry + sow(x, tag="t", name="x"), None  # <STRICT_IN_SCAN>

        return lax.scan(step, jnp.float32(0.0), xs)[0]  # <SCAN_OF_STRICT>

    with raises(
        ValueError,
        "name 'x' of tag 't'",
        "mode='strict'",
        at("STRICT_IN_SCAN"),
        at("SCAN_OF_STRICT"),
        "mode='append'",
        "mode='clobber'",
    ):
        reap(f, tag="t")(XS)


def test_reap_fori_loop_with_static_bounds_and_lax_map():
    def f(x):
        def body(i, x):
            sow(x, tag="t", name="x", mode="append")
            return x * 2.0

        return lax.fori_loop(0, 4, body, x)

    out, sown = reap(f, tag="t")(jnp.float32(1.5))
    assert_tree_close((out, sown["x"]), (jnp.float32(24.0), jnp.array([1.5, 3.0, 6.0, 12.0])))

    mapped = reap(
        lambda xs: lax.map(lambda x: sow(x**2, tag="t", name="sq", mode="append"), xs), tag="t"
    )
    assert_tree_close(mapped(XS)[1], {"sq": XS**2})


def test_reap_scan_inside_cond_inside_scan():
    def f(xss, flags):
        def step(carry, inputs):
            xs, flag = inputs

            def sum_of(xs):
                return running_sum(xs)[0]

            def twice_sum(xs):
                return 2.0 * running_sum(xs)[0]

            return carry, lax.cond(flag, sum_of, twice_sum, xs)

        return lax.scan(step, jnp.float32(0.0), (xss, flags))[1]

    xss = jnp.arange(6.0).reshape(2, 3)
    flags = jnp.array([True, False])
    out, sown = jax.jit(reap(f, tag="t"))(xss, flags)
    assert_tree_close(out, jnp.array([3.0, 24.0]))
    assert_tree_close(sown["total"], np.cumsum(np.arange(6.0).reshape(2, 3), axis=1))


# ---------------------------------------------------------------- reap, while


def doubling_while(x, trips, *, initial=True, mode="clobber"):
    if initial:
        sow(jnp.float32(-1.0), tag="t", name="x", mode="clobber")

    def body(state):
        i, x = state
        sow(x, tag="t", name="x", mode=mode)  # <WHILE_SOW>
        return i + 1, x * 2.0

    return lax.while_loop(lambda state: state[0] < trips, body, (0, x))  # <WHILE_LOOP>


@pytest.mark.parametrize(("trips", "expected"), [(3, 4.0), (1, 1.0), (0, -1.0)])
def test_reap_clobber_in_while_is_the_last_trip_or_the_value_before(trips, expected):
    reaped = jax.jit(reap(doubling_while, tag="t"))
    (_, x), sown = reaped(jnp.float32(1.0), trips)
    assert_tree_close((x, sown["x"]), (jnp.float32(2.0**trips), jnp.float32(expected)))


def test_reap_clobber_first_sown_in_while_is_an_error():
    with raises(
        ValueError,
        "name 'x' of tag 't'",
        "first sown",
        at("WHILE_SOW"),
        at("WHILE_LOOP"),
        "zero times",
        "initial value",
    ):
        reap(doubling_while, tag="t")(jnp.float32(1.0), 3, initial=False)


@pytest.mark.parametrize("mode", ["append", "strict"])
def test_reap_append_or_strict_in_while_is_an_error(mode):
    with raises(ValueError, f"mode='{mode}'", at("WHILE_SOW"), at("WHILE_LOOP")):
        reap(doubling_while, tag="t")(jnp.float32(1.0), 3, initial=False, mode=mode)


def test_reap_append_in_fori_loop_with_traced_bounds_is_an_error():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, x: sow(x, tag="t", name="x", mode="append"), x)

    with raises(ValueError, "mode='append'", "while_loop", "use a scan"):
        jax.jit(reap(f, tag="t"))(jnp.float32(1.0), 3)


def test_reap_clobber_in_while_with_another_shape_is_an_error():
    def f(x):
        sow(x, tag="t", name="x", mode="clobber")

        def body(state):
            sow(jnp.stack([state, state]), tag="t", name="x", mode="clobber")
            return state + 1.0

        return lax.while_loop(lambda s: s < 3.0, body, x)

    with raises(ValueError, "kups.harvest", "['x']", "shape or dtype"):
        reap(f, tag="t")(jnp.float32(0.0))


def test_reap_clobber_in_while_condition():
    def f(x, trips):
        sow(jnp.float32(-1.0), tag="t", name="seen", mode="clobber")

        def cond(state):
            sow(state[1], tag="t", name="seen", mode="clobber")
            return state[0] < trips

        return lax.while_loop(cond, lambda s: (s[0] + 1, s[1] * 2.0), (0, x))

    # The condition runs once more than the body: last on x * 2**trips.
    for trips in (0, 3):
        assert_tree_close(reap(f, tag="t")(jnp.float32(1.0), trips)[1]["seen"], 2.0**trips)


# ---------------------------------------------------------------- reap, cond and switch


def branchy(index, x):
    return lax.switch(
        index,
        [
            lambda x: sow(x * 1.0, tag="t", name="v") + 10.0,
            lambda x: sow(x * 2.0, tag="t", name="v") + 20.0,
            lambda x: sow(x * 3.0, tag="t", name="v") + 30.0,
        ],
        x,
    )


@pytest.mark.parametrize("index", [0, 1, 2])
def test_reap_switch_keeps_the_taken_branch(index):
    x = jnp.float32(1.5)
    out, sown = jax.jit(reap(branchy, tag="t"))(index, x)
    assert_tree_close((out, sown["v"]), (x * (index + 1) + 10.0 * (index + 1), x * (index + 1)))


@pytest.mark.parametrize("pred", [True, False])
def test_reap_cond_keeps_the_taken_branch(pred):
    def f(pred, x):
        return lax.cond(
            pred,
            lambda x: sow(jnp.sin(x), tag="t", name="v"),
            lambda x: sow(jnp.cos(x), tag="t", name="v"),
            x,
        )

    x = jnp.float32(0.3)
    assert_tree_close(reap(f, tag="t")(pred, x)[1]["v"], jnp.sin(x) if pred else jnp.cos(x))


def test_reap_cond_branch_that_does_not_sow_a_new_name_is_an_error():
    def f(pred, x):
        return lax.cond(  # <COND_ONE_BRANCH>
            pred,
            lambda x: x + 1.0,
            lambda x: sow(x * 2.0, tag="t", name="v"),  # <ONE_BRANCH_SOWS>
            x,
        )

    # lax.cond's branch 0 is its false branch.
    with raises(
        ValueError,
        "name 'v' of tag 't'",
        "sown in branch 0",
        at("ONE_BRANCH_SOWS"),
        at("COND_ONE_BRANCH"),
        "not in branch 1",
        "initial value",
    ):
        reap(f, tag="t")(True, jnp.float32(1.0))


def test_reap_cond_branch_may_skip_a_name_sown_before():
    def f(pred, x):
        sow(jnp.float32(-1.0), tag="t", name="v", mode="clobber")
        return lax.cond(
            pred, lambda x: x, lambda x: sow(x * 2.0, tag="t", name="v", mode="clobber"), x
        )

    assert_tree_close(reap(f, tag="t")(True, jnp.float32(3.0))[1]["v"], jnp.float32(-1.0))
    assert_tree_close(reap(f, tag="t")(False, jnp.float32(3.0))[1]["v"], jnp.float32(6.0))


def test_reap_cond_branches_sowing_different_shapes_is_an_error():
    def f(pred, x):
        return lax.cond(  # <COND_SHAPES>
            pred,
            lambda x: sow(x, tag="t", name="v").sum(),
            lambda x: sow(jnp.stack([x, x]), tag="t", name="v").sum(),
            x,
        )

    with raises(ValueError, "'v' (tag 't')", "float32[2]", "float32[]", at("COND_SHAPES")):
        reap(f, tag="t")(True, jnp.float32(1.0))


def test_reap_cond_inside_scan_appends_the_taken_values():
    def f(xs):
        def step(carry, x):
            y = lax.cond(
                x > 0,
                lambda x: sow(x, tag="t", name="y", mode="append"),
                lambda x: sow(-10.0 * x, tag="t", name="y", mode="append"),
                x,
            )
            return carry, y

        return lax.scan(step, jnp.float32(0.0), xs)[1]

    ys, sown = reap(f, tag="t")(XS)
    assert_tree_close(sown["y"], ys)
    assert_tree_close(sown["y"], jnp.where(XS > 0, XS, -10.0 * XS))


# ---------------------------------------------------------------- checkpoint, custom rules


def test_reap_checkpoint_body_and_its_gradient():
    @jax.checkpoint
    def body(x):
        return sow(jnp.sin(x), tag="t", name="s") * 2.0

    x = jnp.float32(0.4)
    assert_tree_close(reap(body, tag="t")(x), (2.0 * jnp.sin(x), {"s": jnp.sin(x)}))
    # Differentiating the checkpointed body sows once, on the primal value.
    assert_tree_close(reap(jax.grad(body), tag="t")(x), (2.0 * jnp.cos(x), {"s": jnp.sin(x)}))
    grad_of_sown = jax.grad(lambda x: reap(body, tag="t")(x)[1]["s"])(x)
    assert_tree_close(grad_of_sown, jnp.cos(x))


def test_reap_checkpoint_inside_scan():
    def f(xs):
        step = jax.checkpoint(
            lambda c, x: (c + sow(x * x, tag="t", name="sq", mode="append"), None)
        )
        return lax.scan(step, jnp.float32(0.0), xs)[0]

    out, sown = jax.jit(reap(f, tag="t"))(XS)
    assert_tree_close((out, sown["sq"]), (np.sum(XS**2), XS**2))
    grads = jax.grad(lambda xs: reap(f, tag="t")(xs)[0])(XS)
    assert_tree_close(grads, 2.0 * XS)


@jax.custom_jvp
def sin_with_custom_jvp(x):
    return sow(jnp.sin(x), tag="t", name="s")


# A deliberately wrong derivative, to see that the user's rule is used.
sin_with_custom_jvp.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), 100.0 * tangents[0]))


@jax.custom_vjp
def sin_with_custom_vjp(x):
    return sow(jnp.sin(x), tag="t", name="s")


sin_with_custom_vjp.defvjp(lambda x: (sin_with_custom_vjp(x), None), lambda _, g: (-7.0 * g,))


def test_reap_custom_jvp_body():
    x = jnp.float32(0.4)
    assert_tree_close(reap(sin_with_custom_jvp, tag="t")(x), (jnp.sin(x), {"s": jnp.sin(x)}))
    grad = jax.grad(lambda x: reap(sin_with_custom_jvp, tag="t")(x)[0])(x)
    assert_tree_close(grad, jnp.float32(100.0))
    assert_tree_close(reap(jax.grad(sin_with_custom_jvp), tag="t")(x)[0], jnp.float32(100.0))


def test_reap_custom_vjp_body():
    x = jnp.float32(0.4)
    assert_tree_close(reap(sin_with_custom_vjp, tag="t")(x), (jnp.sin(x), {"s": jnp.sin(x)}))
    grad = jax.grad(lambda x: reap(sin_with_custom_vjp, tag="t")(x)[0])(x)
    assert_tree_close(grad, jnp.float32(-7.0))
    assert_tree_close(reap(jax.grad(sin_with_custom_vjp), tag="t")(x)[0], jnp.float32(-7.0))


# ---------------------------------------------------------------- reap under transformations


def test_reap_under_grad_with_sown_values_used_and_unused():
    def f(x):
        sow(x**3, tag="t", name="unused")
        return sow(jnp.sin(x), tag="t", name="used") * 2.0

    x = jnp.float32(0.4)
    assert_tree_close(jax.grad(lambda x: reap(f, tag="t")(x)[0])(x), 2.0 * jnp.cos(x))
    assert_tree_close(jax.grad(lambda x: reap(f, tag="t")(x)[1]["unused"])(x), 3.0 * x**2)


def test_reap_of_grad_keeps_unused_sows_inside_scan():
    def f(xs):
        def step(carry, x):
            sow(x * 10.0, tag="t", name="unused", mode="append")
            return carry + jnp.sin(x), None

        return lax.scan(step, jnp.float32(0.0), xs)[0]

    grads, sown = reap(jax.grad(f), tag="t")(XS)
    assert_tree_close((grads, sown), (jnp.cos(XS), {"unused": XS * 10.0}))


def test_reap_under_grad_through_a_scan():
    def loss(xs):
        _, sown = reap(running_sum, tag="t")(xs)
        return jnp.sum(sown["total"])

    # sum_i sum_{j<=i} x_j: x_j counts len(xs) - j times.
    assert_tree_close(jax.grad(loss)(XS), np.arange(5, 0, -1, dtype=np.float32))


def test_reap_under_vmap():
    out, sown = jax.vmap(reap(with_sow, tag="t"))(XS)
    assert_tree_close(out, jax.vmap(without_sow)(XS))
    assert_tree_close(sown["y"], jnp.sin(XS))


# ---------------------------------------------------------------- reap, shard_map


def per_shard_sums(mesh, x, *, in_spec=P(("x", "y")), axis_names=None):
    """Each shard sows the sum of its block of `x` and returns its block."""

    def body(block):
        sow(block.sum(), tag="t", name="block_sum")
        return block

    kwargs = {} if axis_names is None else {"axis_names": axis_names}
    return jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=in_spec, **kwargs)(x)


def test_reap_shard_map_one_entry_per_shard_in_mesh_order(mesh42):
    x = jnp.arange(16.0)
    out, sown = reap(per_shard_sums, tag="t")(mesh42, x)
    assert_tree_close(out, x)
    # Shard (i, j) of the 4x2 mesh holds block 2 * i + j of x.
    assert_tree_close(sown["block_sum"], x.reshape(8, 2).sum(axis=1))


def test_reap_shard_map_replicated_over_y(mesh42):
    x = jnp.arange(16.0)
    _, sown = jax.jit(reap(per_shard_sums, tag="t"), static_argnames=("mesh", "in_spec"))(
        mesh=mesh42, x=x, in_spec=P("x")
    )
    # Shards (i, 0) and (i, 1) both hold block i of four.
    assert_tree_close(sown["block_sum"], np.repeat(x.reshape(4, 4).sum(axis=1), 2))


def test_reap_shard_map_partial_manual(mesh42):
    x = jnp.arange(16.0)
    _, sown = reap(per_shard_sums, tag="t")(mesh42, x, in_spec=P("x"), axis_names=frozenset("x"))
    assert_tree_close(sown["block_sum"], x.reshape(4, 4).sum(axis=1))


def test_reap_shard_map_on_mesh8_with_psum(mesh8):
    def f(x):
        def body(block):
            total = sow(lax.psum(block.sum(), "i"), tag="t", name="total")
            sow(lax.axis_index("i"), tag="t", name="index")
            return block / total

        return jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.arange(8.0)
    out, sown = reap(f, tag="t")(x)
    assert_tree_close(out, x / 28.0)
    assert_tree_close(sown, {"index": np.arange(8, dtype=np.int32), "total": np.full(8, 28.0)})


def test_reap_shard_map_values_sown_before_stay_and_inside_gain_the_shard_axis(mesh42):
    def f(x):
        sow(x.sum(), tag="t", name="outside")
        sow(jnp.float32(-1.0), tag="t", name="both", mode="clobber")

        def body(block):
            sow(block.max(), tag="t", name="both", mode="clobber")
            return block

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x"), out_specs=P("x"))(x)

    x = jnp.arange(8.0)
    _, sown = reap(f, tag="t")(x)
    assert_tree_close(sown["outside"], jnp.float32(28.0))
    assert_tree_close(sown["both"], np.repeat(x.reshape(4, 2).max(axis=1), 2))


def test_reap_scan_inside_shard_map_and_shard_map_inside_scan(mesh42):
    def scan_inside(x):
        def body(block):
            # The carry starts varying over the shards, like the block it sums.
            return running_sum(block, start=block[0] * 0.0)[0][None]

        return jax.shard_map(body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=P(("x", "y")))(x)

    x = jnp.arange(16.0)
    _, sown = jax.jit(reap(scan_inside, tag="t"))(x)
    assert_tree_close(sown["total"], np.cumsum(x.reshape(8, 2), axis=1))

    def map_inside(xss):
        def step(offset, xs):
            def body(block):
                return sow(block + offset, tag="t", name="shifted", mode="append")

            sm = jax.shard_map(body, mesh=mesh42, in_specs=P("x"), out_specs=P("x"))
            return offset + 1.0, sm(xs)

        return lax.scan(step, jnp.float32(0.0), xss)[1]

    xss = jnp.arange(24.0).reshape(3, 8)
    _, sown = reap(map_inside, tag="t")(xss)
    # Iteration k, shard (i, j): block i of xss[k] (two values), plus k.
    blocks = xss.reshape(3, 4, 1, 2) + jnp.arange(3.0)[:, None, None, None]
    assert_tree_close(sown["shifted"], jnp.broadcast_to(blocks, (3, 4, 2, 2)).reshape(3, 8, 2))


def test_reap_cond_inside_shard_map(mesh42):
    def f(x):
        def body(block):
            return lax.cond(
                block.sum() > 10.0,
                lambda b: sow(b * 2.0, tag="t", name="v"),
                lambda b: sow(b * 3.0, tag="t", name="v"),
                block,
            )

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x"), out_specs=P("x"))(x)

    x = jnp.arange(8.0)
    out, sown = reap(f, tag="t")(x)
    blocks = x.reshape(4, 2)
    expected = jnp.where(blocks.sum(axis=1, keepdims=True) > 10.0, blocks * 2.0, blocks * 3.0)
    assert_tree_close(out, expected.reshape(8))
    assert_tree_close(sown["v"], np.repeat(expected, 2, axis=0))


# ---------------------------------------------------------------- plant


def test_plant_replaces_given_names_and_keeps_the_others():
    x = jnp.float32(0.7)
    y = jnp.sin(x)
    z = {"a": jnp.float32(5.0), "b": (x, jnp.float32(-1.0))}
    assert_tree_close(plant(with_sow, tag="t")({"z": z}, x), 5.0 - 1.0)
    # "y" planted, "z" computed from it.
    assert_tree_close(plant(with_sow, tag="t")({"y": 2.0}, x), 2.0 * 2.0 + 3.0)
    assert_tree_close(plant(with_sow, tag="t")({}, x), y * 2.0 + y + 1.0)
    assert_tree_close(jax.jit(plant(with_sow, tag="t"))({"y": 2.0}, x), jnp.float32(7.0))


def test_plant_only_its_tag():
    def f(x):
        return sow(x, tag="u", name="v") + sow(2.0 * x, tag="t", name="v")

    assert_tree_close(plant(f, tag="t")({"v": 10.0}, jnp.float32(1.0)), jnp.float32(11.0))


def test_plant_unknown_name_lists_the_names_of_the_tag():
    def f(x):
        sow(x, tag="u", name="other_tag")
        sow(x, tag="t", name="alpha")
        return sow(x, tag="t", name="beta")

    with raises(ValueError, "['gamma']", "never sows", "tag 't'", "['alpha', 'beta']"):
        plant(f, tag="t")({"gamma": 1.0, "alpha": 2.0}, jnp.float32(1.0))
    with raises(ValueError, "The names it sows under that tag are: none"):
        plant(f, tag="v")({"alpha": 2.0}, jnp.float32(1.0))


def test_plant_checks_values():
    with raises(TypeError, "dict from sown names to values"):
        plant(with_sow, tag="t")([1.0], jnp.float32(1.0))
    with raises(ValueError, "does not fit the sow", "shape (3,)"):
        plant(with_sow, tag="t")({"y": jnp.ones(3)}, jnp.float32(1.0))
    with raises(ValueError, "does not fit the sow", "structure"):
        plant(with_sow, tag="t")({"z": {"a": 1.0}}, jnp.float32(1.0))
    with raises(ValueError, "does not fit the sow", "dtype int32"):
        plant(with_sow, tag="t")({"y": jnp.int32(1)}, jnp.float32(1.0))


def feed_back(xs, *, reverse=False, unroll=1):
    """The scan outputs what each iteration's sow returns."""

    def step(carry, x):
        return carry + 1.0, sow(x + carry, tag="t", name="fed", mode="append")

    return lax.scan(step, jnp.float32(0.0), xs, reverse=reverse, unroll=unroll)[1]


@pytest.mark.parametrize("reverse", [False, True])
def test_plant_append_in_scan_gives_iteration_i_entry_i(reverse):
    planted = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0])
    ys = plant(feed_back, tag="t")({"fed": planted}, XS, reverse=reverse)
    assert_tree_close(ys, planted)
    # Round trip: reaping then planting the reaped values changes nothing.
    ys, sown = reap(feed_back, tag="t")(XS, reverse=reverse)
    assert_tree_close(plant(feed_back, tag="t")(sown, XS, reverse=reverse), ys)


def test_plant_append_in_scan_with_unroll_under_jit():
    planted = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0])
    ys = jax.jit(plant(feed_back, tag="t"), static_argnames="unroll")(
        {"fed": planted}, XS, unroll=2
    )
    assert_tree_close(ys, planted)


def test_plant_append_in_nested_scans():
    def f(xss):
        def outer(carry, xs):
            def inner(carry, x):
                return carry, sow(x, tag="t", name="fed", mode="append") * 2.0

            return carry, lax.scan(inner, carry, xs)[1]

        return lax.scan(outer, jnp.float32(0.0), xss)[1]

    planted = jnp.arange(12.0).reshape(3, 4) * 10.0
    assert_tree_close(plant(f, tag="t")({"fed": planted}, jnp.zeros((3, 4))), planted * 2.0)


def test_plant_append_in_zero_length_scan():
    assert plant(feed_back, tag="t")({"fed": jnp.zeros(0)}, XS[:0]).shape == (0,)


def test_plant_append_stack_of_the_wrong_length_is_an_error():
    with raises(ValueError, "shape (4,)", "needs 5 entries along its axis 0"):
        plant(feed_back, tag="t")({"fed": jnp.zeros(4)}, XS)


def test_plant_clobber_in_scan_while_and_cond():
    def f(x, pred):
        def step(carry, _):
            return carry + sow(carry, tag="t", name="c", mode="clobber"), None

        x = lax.scan(step, x, None, length=3)[0]

        def body(x):
            return x + sow(x, tag="t", name="c", mode="clobber")

        x = lax.while_loop(lambda x: x < 150.0, body, x)
        return lax.cond(
            pred,
            lambda x: x + sow(x, tag="t", name="c", mode="clobber"),
            lambda x: x - sow(x, tag="t", name="c", mode="clobber"),
            x,
        )

    # Every sow of "c" returns 40: 1 -> 121 (scan) -> 161 (one while trip) -> 201 / 121.
    out = jax.jit(plant(f, tag="t"))({"c": 40.0}, jnp.float32(1.0), True)
    assert_tree_close(out, jnp.float32(201.0))
    assert_tree_close(plant(f, tag="t")({"c": 40.0}, jnp.float32(1.0), False), 121.0)


def test_plant_append_in_while_is_an_error():
    def f(x):
        return lax.while_loop(
            lambda x: x < 3.0, lambda x: sow(x, tag="t", name="w", mode="append"), x
        )

    with raises(ValueError, "'w'", "mode='append'", "while_loop"):
        plant(f, tag="t")({"w": jnp.zeros(3)}, jnp.float32(0.0))


def test_plant_in_checkpoint_and_custom_rules():
    @jax.checkpoint
    def body(x):
        return sow(jnp.sin(x), tag="t", name="s") * 2.0

    x = jnp.float32(0.4)
    assert_tree_close(plant(body, tag="t")({"s": 3.0}, x), jnp.float32(6.0))
    assert_tree_close(plant(sin_with_custom_jvp, tag="t")({"s": 3.0}, x), jnp.float32(3.0))
    assert_tree_close(plant(sin_with_custom_vjp, tag="t")({"s": 3.0}, x), jnp.float32(3.0))


def test_plant_under_grad_with_respect_to_planted_values():
    def f(x):
        y = sow(jnp.sin(x), tag="t", name="y")
        return y**2 * x

    x = jnp.float32(0.4)
    grad_y = jax.grad(lambda y: plant(f, tag="t")({"y": y}, x))(jnp.float32(3.0))
    assert_tree_close(grad_y, 2.0 * 3.0 * x)

    def loss(planted):
        return jnp.sum(plant(feed_back, tag="t")({"fed": planted}, XS) ** 2)

    planted = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert_tree_close(jax.jit(jax.grad(loss))(planted), 2.0 * planted)


def test_plant_under_vmap():
    out = jax.vmap(plant(lambda x: sow(x * 2.0, tag="t", name="a") + 1.0, tag="t"))(
        {"a": XS * 10.0}, XS
    )
    assert_tree_close(out, XS * 10.0 + 1.0)


def test_plant_one_tag_and_reap_another():
    def f(x):
        y = sow(x * 2.0, tag="t", name="y")
        return sow(y + 1.0, tag="u", name="z")

    out, sown = reap(plant(f, tag="t"), tag="u")({"y": 5.0}, jnp.float32(1.0))
    assert_tree_close((out, sown), (jnp.float32(6.0), {"z": 6.0}))


def test_reap_of_plant_sees_the_planted_values():
    planted = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0])
    _, sown = reap(plant(feed_back, tag="t"), tag="t")({"fed": planted}, XS)
    assert_tree_close(sown["fed"], planted)


# ---------------------------------------------------------------- plant, shard_map


def test_plant_shard_map_gives_each_shard_its_entry(mesh42):
    def f(x):
        def body(block):
            return block * sow(block.sum(), tag="t", name="scale")

        return jax.shard_map(body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=P(("x", "y")))(x)

    x = jnp.arange(16.0)
    scales = jnp.arange(8.0) + 1.0
    out = jax.jit(plant(f, tag="t"))({"scale": scales}, x)
    assert_tree_close(out, (x.reshape(8, 2) * scales[:, None]).reshape(16))


def test_plant_shard_map_partial_manual(mesh42):
    def f(x):
        def body(block):
            return block * sow(block.sum(), tag="t", name="scale")

        return jax.shard_map(
            body, mesh=mesh42, in_specs=P("x"), out_specs=P("x"), axis_names=frozenset("x")
        )(x)

    x = jnp.arange(16.0)
    scales = jnp.array([1.0, 2.0, 3.0, 4.0])
    out = plant(f, tag="t")({"scale": scales}, x)
    assert_tree_close(out, (x.reshape(4, 4) * scales[:, None]).reshape(16))


def test_plant_shard_map_replicated_value_takes_the_first_entry_along_invariant_axes(mesh42):
    def f(x):
        def body(block):
            total = sow(lax.psum(block.sum(), ("x", "y")), tag="t", name="total")
            per_x = sow(lax.psum(block.sum(), "y"), tag="t", name="per_x")
            return total, block * per_x

        return jax.shard_map(
            body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=(P(), P(("x", "y")))
        )(x)

    x = jnp.arange(16.0)
    (total, scaled), sown = reap(f, tag="t")(x)
    assert_tree_close(total, jnp.float32(120.0))
    planted = {"total": jnp.arange(8.0) + 100.0, "per_x": jnp.arange(8.0)}
    total, scaled = plant(f, tag="t")(planted, x)
    # "total" is replicated over x and y: shard (0, 0)'s entry; "per_x" varies
    # over x only: shard (i, 0)'s entry, entry 2 * i.
    assert_tree_close(total, jnp.float32(100.0))
    per_x = jnp.repeat(jnp.arange(8.0)[::2], 2)
    assert_tree_close(scaled, (x.reshape(8, 2) * per_x[:, None]).reshape(16))
    # Planting the reaped values changes nothing.
    assert_tree_close(plant(f, tag="t")(sown, x), (jnp.float32(120.0), f(x)[1]))


def test_plant_scan_inside_shard_map_and_shard_map_inside_scan(mesh42):
    def scan_inside(x):
        def body(block):
            return feed_back(block)

        return jax.shard_map(body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=P(("x", "y")))(x)

    planted = jnp.arange(16.0).reshape(8, 2) * 10.0
    out = plant(scan_inside, tag="t")({"fed": planted}, jnp.zeros(16))
    assert_tree_close(out, planted.reshape(16))

    def map_inside(xss):
        def step(carry, xs):
            def body(block):
                return block + sow(block.sum(), tag="t", name="s", mode="append")

            sm = jax.shard_map(body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
            return carry, sm(xs)

        return lax.scan(step, jnp.float32(0.0), xss)[1]

    planted = jnp.arange(24.0).reshape(3, 8)
    out = jax.jit(plant(map_inside, tag="t"))({"s": planted}, jnp.zeros((3, 8)))
    assert_tree_close(out, planted)


@pytest.mark.parametrize("trips", [0, 2])
def test_plant_append_in_a_loop_carry_inside_shard_map(mesh42, trips):
    # Found by the fuzzer (seed 1451): with zero trips, the planted entry must still
    # vary over the manual axes as the loop carry it replaces does.
    def f(x):
        def body(block):
            step = lambda i, c: sow(c, tag="t", name="c", mode="append")  # noqa: E731
            return lax.fori_loop(0, trips, step, block)

        return jax.jit(
            jax.shard_map(body, mesh=mesh42, in_specs=P("y"), out_specs=P("y"), axis_names={"y"})
        )(x)

    x = jnp.linspace(-1.0, 1.0, 16)
    out, reaped = reap(f, tag="t")(x)
    assert reaped["c"].shape == (2, trips, 8)
    assert_tree_close(plant(f, tag="t")(reaped, x), out)


def test_plant_shard_map_wrong_number_of_entries_is_an_error(mesh42):
    with raises(ValueError, "shape (4,)", "needs 8 entries", "manual axes ('x', 'y')"):
        plant(per_shard_sums, tag="t")({"block_sum": jnp.zeros(4)}, mesh42, jnp.arange(16.0))


# ---------------------------------------------------------------- docstring examples


@pytest.mark.parametrize("function", [sow, reap, plant])
def test_docstring_example_runs(function):
    source = re.search(r"```python\n(.*?)```", function.__doc__, re.DOTALL)
    assert source is not None
    code = "\n".join(line[8:] for line in source.group(1).splitlines())
    exec(compile(code, f"<{function.__name__} docstring>", "exec"), {})
