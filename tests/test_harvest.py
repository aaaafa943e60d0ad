"""`kups.harvest`: `sow`, `reap`, `plant`, `harvest` and `nest` through every
control-flow primitive, under transformations and inside `shard_map`, and every
mistake as a clear error.

Expected values come from plain JAX (the same program without harvest, or a
scan's own stacked outputs) or are computed by hand; never from kups itself.
"""

import functools
import re
import textwrap
import warnings

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kups.effects import InterpreterPolicy
from kups.harvest import MODES, harvest, nest, plant, reap, reap_grads, sow, sow_cond
from library_primitive import library_call, library_fn_call

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


def test_sow_rejects_a_name_that_is_not_a_string():
    with raises(TypeError, "The name of a sown value must be a non-empty string"):
        sow(1.0, tag="t", name=3)


def test_sow_rejects_a_tag_that_is_not_hashable_or_missing():
    with raises(TypeError, "tag=['t']", "not hashable", "Enum"):
        sow(1.0, tag=["t"], name="y")
    with raises(TypeError, "tag=None", "non-empty string or another hashable"):
        sow(1.0, tag=None, name="y")


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


def _stacked_outputs(jaxpr, length):
    """The outputs of the top-level scans of `jaxpr` stacked along `length`."""
    return [
        v.aval.shape
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "scan"
        for v in eqn.outvars
        if v.aval.shape[:1] == (length,)
    ]


@pytest.mark.parametrize("jit", [False, True])
def test_reap_clobber_new_in_a_scan_is_carried_not_stacked(jit):
    # Each iteration sows `last` (directly, through a jit, an inner scan that
    # runs, or every branch of a cond): the scan carries the last value and
    # stacks nothing, whatever its size.
    def f(xs, where, size):
        def step(carry, x):
            value = jnp.full((size,), x) + carry
            if where == "direct":
                sow(value, tag="t", name="last", mode="clobber")
            elif where == "jit":
                jax.jit(lambda v: sow(v, tag="t", name="last", mode="clobber"))(value)
            elif where == "inner scan":
                lax.scan(
                    lambda c, _: (sow(c, tag="t", name="last", mode="clobber"), None),
                    value,
                    None,
                    length=2,
                )
            elif where == "both branches":
                lax.cond(
                    x > 2.0,
                    lambda v: sow(v, tag="t", name="last", mode="clobber"),
                    lambda v: sow(-v, tag="t", name="last", mode="clobber"),
                    value,
                )
            return carry + x, None

        return lax.scan(step, jnp.float32(0.0), xs)[0]

    xs = jnp.arange(1.0, 6.0)
    for where in ("direct", "jit", "inner scan", "both branches"):
        for size in (2**14, 3):
            reaped = reap(functools.partial(f, where=where, size=size), tag="t")
            _, sown = (jax.jit(reaped) if jit else reaped)(xs)
            assert_tree_close(sown["last"], jnp.full((size,), 15.0))
            jaxpr = jax.make_jaxpr(reaped)(xs).jaxpr
            assert _stacked_outputs(jaxpr, 5) == [], (where, size)


def test_reap_clobber_in_a_loop_that_may_not_run_is_the_last_iterations_value():
    # The inner while runs no step in the last iteration: that iteration's value
    # is the init (what a zero-trip loop yields), not the one sown before it.
    def f(xs):
        def step(carry, x):
            def body(i):
                sow(x * 10.0 + i, tag="t", name="v", mode="clobber", init=-1.0)
                return i + 1.0

            lax.while_loop(lambda i: i < x - 2.0, body, jnp.float32(0.0))
            return carry, None

        return lax.scan(step, jnp.float32(0.0), xs)[0]

    for xs, expected in (([5.0, 4.0, 0.5], -1.0), ([0.5, 5.0, 4.0], 41.0)):
        xs = jnp.array(xs)
        assert_tree_close(reap(f, tag="t")(xs)[1]["v"], jnp.float32(expected))
        assert_tree_close(jax.jit(reap(f, tag="t"))(xs)[1]["v"], jnp.float32(expected))


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


@pytest.mark.parametrize("jit", [False, True])
def test_reap_of_grad_keeps_the_forward_value_of_a_sow_a_backward_rule_runs_again(jit):
    # equinox's checkpointed while loop (diffrax's default adjoint) runs the body
    # again in its backward rule, last at the first iteration: the forward pass's
    # last value is the one reaped, as from the function itself.
    def body(c):
        i, x = c
        x = jnp.sin(x) * 1.1
        sow(jnp.sum(x), tag="t", name="last", mode="clobber", init=0.0)
        return i + 1, x

    def loop(kind):
        def f(x):
            out = eqxi.while_loop(lambda c: c[0] < 5, body, (0, x), max_steps=8, kind=kind)
            return jnp.sum(out[1] ** 2)

        return f

    # A custom_vjp whose backward rule computes the forward again.
    def forward(x):
        return sow(x * 2.0, tag="t", name="last", mode="clobber")

    twice = jax.custom_vjp(forward)
    twice.defvjp(lambda x: (forward(x), x), lambda x, g: jax.vjp(forward, x)[1](g))

    def recomputed(x):
        return jnp.sum(twice(x + 1.0) ** 2)

    x = jnp.linspace(0.1, 1.0, 3)
    for f in (loop("checkpointed"), loop("bounded"), recomputed):
        wrap = jax.jit if jit else (lambda g: g)
        expected = reap(f, tag="t")(x)[1]["last"]
        grads, sown = wrap(reap(jax.grad(f), tag="t"))(x)
        assert_tree_close(sown["last"], expected)
        assert_tree_close(grads, jax.grad(f)(x))
        assert_tree_close(wrap(reap(jax.value_and_grad(f), tag="t"))(x)[1]["last"], expected)


@pytest.mark.parametrize("jit", [False, True])
def test_reap_of_grad_keeps_a_clobber_sown_in_a_checkpointed_loop_that_later_steps_skip(jit):
    # grad's forward pass calls a checkpointed body with `eval_jaxpr` (JAX 0.11+):
    # a call, which runs its body once, as `jit` does. The sow is in a cond that
    # the outer scan's second step never takes (equinox's bounded while loop,
    # diffrax's DirectAdjoint, has this shape): the value stays the first step's.
    def step(h, i):
        def go(h):
            sow(h, tag="t", name="h", mode="clobber", init=0.0)
            return jnp.sin(h) * 2.0

        return lax.cond(i < 3, go, lambda h: h, h), None

    inner = jax.checkpoint(lambda h, js: lax.scan(step, h, js)[0])

    def nested(x):
        return lax.scan(lambda h, js: (inner(h, js), None), x, jnp.arange(8).reshape(2, 4))[0]

    def bounded(x):
        def body(c):
            i, h = c
            sow(h, tag="t", name="h", mode="clobber", init=0.0)
            return i + 1, jnp.sin(h) * 2.0

        return eqxi.while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=64, kind="bounded")[1]

    wrap = jax.jit if jit else (lambda g: g)
    x = jnp.float32(0.5)
    for f in (nested, bounded):
        expected = reap(f, tag="t")(x)[1]["h"]
        assert float(expected) != 0.0
        grads, sown = wrap(reap(jax.grad(f), tag="t"))(x)
        assert_tree_close(sown["h"], expected)
        assert_tree_close(grads, jax.grad(f)(x))


@pytest.mark.parametrize("mode", ["strict", "append"])
@pytest.mark.parametrize("jit", [False, True])
def test_reap_of_grad_keeps_the_forward_values_in_every_mode(mode, jit):
    # A custom_vjp whose backward rule computes the forward again, sows included:
    # the backward pass adds no second strict value and no more append entries.
    def forward(x):
        return sow(x * 2.0, tag="t", name="v", mode=mode)

    twice = jax.custom_vjp(forward)
    twice.defvjp(lambda x: (forward(x), x), lambda x, g: jax.vjp(forward, x)[1](g))

    def once(x):
        return jnp.sum(twice(x + 1.0) ** 2)

    def in_a_scan(x):
        return lax.scan(lambda c, xi: (c + twice(xi) ** 2, None), jnp.zeros(()), x)[0]

    x = jnp.linspace(0.1, 1.0, 3)
    wrap = jax.jit if jit else (lambda g: g)
    for f in (once, in_a_scan) if mode == "append" else (once,):
        grads, sown = wrap(reap(jax.grad(f), tag="t"))(x)
        assert_tree_close(sown, reap(f, tag="t")(x)[1])
        assert_tree_close(grads, jax.grad(f)(x))


def test_reap_of_grad_takes_a_sow_only_the_backward_rule_makes():
    # A name first sown by a backward rule (a cotangent tap) is reaped as usual.
    @jax.custom_vjp
    def tap(x):
        return x

    def tap_backward(_, g):
        return (sow(g, tag="t", name="cotangent", mode="clobber"),)

    tap.defvjp(lambda x: (x, None), tap_backward)

    def f(x):
        return jnp.sum(jnp.sin(tap(x)) * 3.0)

    x = jnp.linspace(0.1, 1.0, 3)
    grads, sown = reap(jax.grad(f), tag="t")(x)
    assert_tree_close(sown["cotangent"], 3.0 * jnp.cos(x))
    assert_tree_close(grads, 3.0 * jnp.cos(x))


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


@pytest.mark.parametrize("mode", ["strict", "clobber", "append"])
@pytest.mark.parametrize("jit", [False, True])
def test_reap_of_grad_of_a_checkpointed_sow_in_shard_map_is_the_forward_value(mesh8, mode, jit):
    # The backward shard_map runs the checkpointed function again, sow included;
    # that sow gives no value, so the forward one is not given a second shard axis.
    def loss(w, x):
        def body(w, block):
            @jax.checkpoint
            def layer(h):
                h = jnp.tanh(h * w)
                if mode == "append":
                    lax.scan(lambda c, r: (c, sow(r, tag="t", name="h", mode=mode)), 0.0, h)
                else:
                    sow(jnp.sum(h), tag="t", name="h", mode=mode)
                return h

            return lax.psum(jnp.sum(layer(block) ** 2), "i")

        return jax.shard_map(body, mesh=mesh8, in_specs=(P(), P("i")), out_specs=P())(w, x)

    wrap = jax.jit if jit else (lambda g: g)
    w, x = jnp.float32(0.5), jnp.linspace(-2.0, 2.0, 16)
    _, forward = wrap(reap(loss, tag="t"))(w, x)
    assert forward["h"].shape == ((8, 2) if mode == "append" else (8,))
    grads, sown = wrap(reap(jax.grad(loss), tag="t"))(w, x)
    assert_tree_close(sown, forward)
    # Under jit: JAX 0.10.0 does not run a checkpoint's grad inside shard_map eagerly.
    assert_tree_close(grads, jax.jit(jax.grad(loss))(w, x))


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
    with raises(ValueError, "that this call acts on are: none"):
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


def _rule_programs(h):
    """Three programs whose derivative rules run the function again, each sowing
    `sin(x)` as "h" (or using `h` instead when it is given): equinox's checkpointed
    loop (a custom_vjp whose backward rule runs the body again, and a custom_jvp
    rule inside), a custom_vjp and a custom_jvp whose rules call the function,
    and a custom_vjp whose `fwd` differentiates it."""

    def sown(x):
        return sow(jnp.sin(x), tag="t", name="h", mode="clobber") if h is None else h

    def body(c):
        i, x = c
        return i + 1, sown(x) * x + 0.1 * x

    def loop(x):
        out = eqxi.while_loop(lambda c: c[0] < 4, body, (0, x), max_steps=6, kind="checkpointed")
        return jnp.sum(out[1] ** 2)

    def times(x):
        return sown(x) * x

    by_vjp = jax.custom_vjp(times)
    by_vjp.defvjp(lambda x: (times(x), x), lambda x, g: jax.vjp(times, x)[1](g))
    by_jvp = jax.custom_jvp(times)
    by_jvp.defjvp(lambda p, t: jax.jvp(times, p, t))
    # A `fwd` that differentiates the function itself (its residual is the pullback).
    by_fwd_vjp = jax.custom_vjp(times)
    by_fwd_vjp.defvjp(lambda x: jax.vjp(times, x), lambda pullback, g: pullback(g))
    return {
        "checkpointed loop": loop,
        "custom_vjp": lambda x: jnp.sum(by_vjp(x + 1.0) ** 2),
        "custom_jvp": lambda x: jnp.sum(by_jvp(x + 1.0) ** 2),
        "custom_vjp, fwd by jax.vjp": lambda x: jnp.sum(by_fwd_vjp(x + 1.0) ** 2),
    }


@pytest.mark.parametrize("program", sorted(_rule_programs(None)))
@pytest.mark.parametrize("jit", ["eager", "jit inside", "jit outside"])
def test_grad_of_plant_plants_the_sows_a_derivative_rule_runs(program, jit):
    # JAX runs these rules only when it differentiates the planted function; their
    # sows are planted too, and a planted value is a constant there as elsewhere:
    # the derivative is the planted program's (here, with h fixed).
    x = jnp.linspace(0.1, 1.0, 3)
    h = jnp.array([0.5, -0.25, 2.0])
    f = _rule_programs(None)[program]
    expected = jax.value_and_grad(_rule_programs(h)[program])(x)

    def planted(x):
        return plant(f, tag="t")({"h": h}, x)

    if jit == "jit inside":
        got = jax.value_and_grad(jax.jit(planted))(x)
    elif jit == "jit outside":
        got = jax.jit(jax.value_and_grad(planted))(x)
    else:
        got = jax.value_and_grad(planted)(x)
    assert_tree_close(got, expected)
    # Another name planted: the function's own derivative.
    unplanted = jax.grad(lambda x: plant(f, tag="other")({}, x))(x)
    assert_tree_close(unplanted, jax.grad(f)(x))


@pytest.mark.parametrize("around", ["checkpoint", "jit"])
@pytest.mark.parametrize("program", sorted(_rule_programs(None)))
def test_sows_in_derivative_rules_under_checkpoint_and_jit(program, around):
    # jax.checkpoint around the rules' programs: JAX recomputes the loop body
    # (with its sow) with no residuals; a sow there was an AssertionError in JAX,
    # with or without an effect around. A checkpointed or jitted body is traced
    # once and cached, with its equations: the rule plant traces (a planted
    # sow's tangent zero) is not JAX's, and neither takes the place of the other.
    wrap = jax.checkpoint if around == "checkpoint" else jax.jit
    x = jnp.linspace(0.1, 1.0, 3)
    h = jnp.array([0.5, -0.25, 2.0])
    f = _rule_programs(None)[program]
    expected = jax.grad(f)(x)
    assert_tree_close(jax.grad(wrap(f))(x), expected)
    if program != "checkpointed loop":  # whose sow has no `init` for reap
        out, reaped = reap(jax.grad(wrap(f)), tag="t")(x)
        assert_tree_close(out, expected)
        assert_tree_close(reaped, reap(f, tag="t")(x)[1])
    planted = jax.grad(_rule_programs(h)[program])(x)
    for grad in (
        jax.grad(lambda x: plant(wrap(f), tag="t")({"h": h}, x)),
        jax.grad(wrap(lambda x: plant(f, tag="t")({"h": h}, x))),
    ):
        assert_tree_close(grad(x), planted)
        assert_tree_close(jax.jit(grad)(x), planted)
    assert_tree_close(jax.grad(wrap(f))(x), expected)


def test_grad_with_respect_to_planted_values_through_custom_derivatives():
    # Custom derivatives (jax.nn.relu is a custom_jvp) between the plant and the
    # sow keep the planted value's derivative.
    def f(x):
        y = sow(jnp.sin(x), tag="t", name="y")
        return jnp.sum(jax.nn.relu(x) * sin_with_custom_vjp(x) + y**2)

    x = jnp.linspace(0.1, 1.0, 3)
    y = jnp.array([1.0, -2.0, 3.0])
    grad_y = jax.grad(lambda y: plant(f, tag="t")({"y": y}, x))(y)
    assert_tree_close(grad_y, 2.0 * y)
    assert_tree_close(jax.jit(jax.grad(lambda y: plant(f, tag="t")({"y": y}, x)))(y), 2.0 * y)


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


# ---------------------------------------------------------------- one program, every primitive


def sows_everywhere(x, xs, blocks, trips, pred, *, mesh, sow=sow):
    """Sows of tags "t" and "u" in straight-line code, scan, while, cond and
    shard_map; every sown value feeds the output. With `sow=_identity` it is the
    plain JAX program."""
    top = sow(x * 2.0, tag="t", name="top")
    other = sow(x * 3.0, tag="u", name="other")

    def step(carry, x):
        y = sow(x + 1.0, tag="t", name="in_scan", mode="append")
        z = sow(x * 3.0, tag="u", name="u_scan", mode="append")
        return carry + y * z, None

    total = lax.scan(step, top + other, xs)[0]

    def body(state):
        i, v = state
        return i + 1, sow(v, tag="t", name="in_while", mode="clobber", init=-1.0) * 2.0

    _, v = lax.while_loop(lambda state: state[0] < trips, body, (0, x))
    c = lax.cond(
        pred,
        lambda y: sow(y + 1.0, tag="t", name="in_cond"),
        lambda y: sow(y - 1.0, tag="t", name="in_cond"),
        total,
    )

    def shard_body(block):
        return sow(block * 2.0, tag="t", name="in_shard") + sow(
            block.max(), tag="u", name="u_shard"
        )

    out = jax.shard_map(shard_body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(blocks)
    return c + v + out.sum()


def _identity(value, **_):
    return value


def everywhere_inputs(axis_type):
    """`sows_everywhere`'s arguments, its mesh, and what it sows (by hand)."""
    mesh = jax.make_mesh((8,), ("i",), axis_types=(axis_type,))
    x, xs = jnp.float32(1.5), jnp.arange(4.0)
    blocks = jax.device_put(jnp.arange(8.0) + 1.0, NamedSharding(mesh, P("i")))
    total = 2.0 * 1.5 + 3.0 * 1.5 + np.sum((np.arange(4.0) + 1.0) * 3.0 * np.arange(4.0))
    blocks_np = np.arange(8.0) + 1.0
    sown_t = {
        "top": 3.0,
        "in_scan": np.arange(4.0) + 1.0,
        "in_while": 3.0,  # trips=2: sows 1.5, then 3.0
        "in_cond": total + 1.0,  # pred=True
        "in_shard": (blocks_np * 2.0)[:, None],
    }
    sown_u = {"other": 4.5, "u_scan": np.arange(4.0) * 3.0, "u_shard": blocks_np}
    return (x, xs, blocks, 2, True), mesh, sown_t, sown_u


AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_everywhere_program_reaps_by_hand(axis_type):
    args, mesh, sown_t, sown_u = everywhere_inputs(axis_type)
    expected_out = sows_everywhere(*args, mesh=mesh, sow=_identity)
    (out, inner), outer = jax.jit(
        reap(reap(sows_everywhere, tag="t"), tag="u"), static_argnames="mesh"
    )(*args, mesh=mesh)
    assert_tree_close((out, inner, outer), (expected_out, sown_t, sown_u))


# ---------------------------------------------------------------- allowlist, blocklist, exclusive


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("taken", [("top",), ("in_scan", "in_while"), ("in_cond", "in_shard")])
def test_reap_allowlist_leaves_the_other_sows_for_an_outer_reap(axis_type, taken):
    args, mesh, sown_t, _ = everywhere_inputs(axis_type)
    inner_reap = reap(sows_everywhere, tag="t", allowlist=taken)
    (out, inner), outer = jax.jit(reap(inner_reap, tag="t"), static_argnames="mesh")(
        *args, mesh=mesh
    )
    assert_tree_close(out, sows_everywhere(*args, mesh=mesh, sow=_identity))
    assert_tree_close(inner, {name: sown_t[name] for name in taken})
    assert_tree_close(outer, {name: v for name, v in sown_t.items() if name not in taken})


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_reap_blocklist_is_the_complement_of_allowlist(axis_type):
    args, mesh, sown_t, _ = everywhere_inputs(axis_type)
    blocked = ("in_scan", "in_shard")
    (_, inner), outer = reap(reap(sows_everywhere, tag="t", blocklist=blocked), tag="t")(
        *args, mesh=mesh
    )
    assert_tree_close(inner, {n: v for n, v in sown_t.items() if n not in blocked})
    assert_tree_close(outer, {n: sown_t[n] for n in blocked})
    # Both lists: the allowlist's names (or scopes) minus the blocklist's.
    _, both = reap(sows_everywhere, tag="t", allowlist=["top", "in_cond"], blocklist=["in_scan"])(
        *args, mesh=mesh
    )
    assert_tree_close(both, {"in_cond": sown_t["in_cond"], "top": sown_t["top"]})


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_reap_exclusive_hides_other_tags_from_an_outer_reap(axis_type):
    # Oryx: "exclusive" runs the function with the sows of other tags removed.
    args, mesh, sown_t, sown_u = everywhere_inputs(axis_type)
    expected_out = sows_everywhere(*args, mesh=mesh, sow=_identity)
    exclusive = reap(sows_everywhere, tag="t", exclusive=True)
    (out, inner), outer = jax.jit(reap(exclusive, tag="u"), static_argnames="mesh")(
        *args, mesh=mesh
    )
    assert_tree_close((out, inner, outer), (expected_out, sown_t, {}))
    # Without exclusive, the outer reap sees them (the test above).
    (_, inner), outer = reap(reap(sows_everywhere, tag="t"), tag="u")(*args, mesh=mesh)
    assert_tree_close(outer, sown_u)


def test_exclusive_hides_other_tags_from_an_outer_plant():
    def f(x):
        return sow(x, tag="t", name="a") + sow(x * 2.0, tag="u", name="b")

    x = jnp.float32(1.0)
    planted_outside = plant(reap(f, tag="t"), tag="u")({"b": 10.0}, x)
    assert_tree_close(planted_outside, (jnp.float32(11.0), {"a": 1.0}))
    with raises(ValueError, "['b']", "never sows under tag 'u'"):
        plant(reap(f, tag="t", exclusive=True), tag="u")({"b": 10.0}, x)
    with raises(ValueError, "['b']", "never sows under tag 'u'"):
        plant(plant(f, tag="t", exclusive=True), tag="u")({"b": 10.0}, {"a": 5.0}, x)
    assert_tree_close(plant(plant(f, tag="t"), tag="u")({"b": 10.0}, {"a": 5.0}, x), 15.0)


def test_plant_allowlist_and_blocklist():
    def f(x):
        return sow(x, tag="t", name="a") + sow(x * 2.0, tag="t", name="b")

    x = jnp.float32(1.0)
    assert_tree_close(plant(f, tag="t", blocklist=["b"])({"a": 10.0}, x), jnp.float32(12.0))
    # A sow left out keeps its value and stays for an outer plant of the tag.
    inner = plant(f, tag="t", allowlist=["a"])
    assert_tree_close(plant(inner, tag="t")({"b": 100.0}, {"a": 10.0}, x), jnp.float32(110.0))
    with raises(
        ValueError,
        "['b'], which the function sows under tag 't' but allowlist/blocklist leave out",
        "['a']",
    ):
        plant(f, tag="t", allowlist=["a"])({"b": 1.0}, x)


def test_plant_allowlist_through_scan_and_shard_map(mesh8):
    def f(xs, blocks):
        def step(carry, x):
            kept = sow(x, tag="t", name="kept", mode="append")
            planted = sow(x, tag="t", name="planted", mode="append")
            return carry + kept * planted, None

        def body(block):
            return block * sow(block.sum(), tag="t", name="scale")

        total = lax.scan(step, jnp.float32(0.0), xs)[0]
        return total, jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(blocks)

    xs, blocks = jnp.arange(3.0), jnp.arange(8.0)
    values = {"planted": jnp.array([5.0, 6.0, 7.0]), "scale": jnp.full(8, 2.0)}
    total, scaled = jax.jit(plant(f, tag="t", blocklist=["kept"]))(values, xs, blocks)
    assert_tree_close((total, scaled), (jnp.float32(0.0 * 5 + 1 * 6 + 2 * 7), blocks * 2.0))


def test_allowlist_and_blocklist_mistakes_are_clear_errors():
    for wrap in (reap, plant, harvest):
        caller = wrap.__name__
        with raises(TypeError, f"{caller}(allowlist='top')", "not a single string", "['top']"):
            wrap(with_sow, tag="t", allowlist="top")
        with raises(TypeError, f"{caller}(blocklist=...)", "iterable of names", "int"):
            wrap(with_sow, tag="t", blocklist=3)
        with raises(ValueError, "['y']", "both allowlist and blocklist"):
            wrap(with_sow, tag="t", allowlist=["y", "z"], blocklist={"y"})
        with raises(TypeError, "entry 3", "non-empty string"):
            wrap(with_sow, tag="t", allowlist=["y", 3])
        with raises(TypeError, "exclusive='yes'"):
            wrap(with_sow, tag="t", exclusive="yes")


# ---------------------------------------------------------------- nest


def test_nest_puts_names_under_the_scope_and_composes():
    # Oryx's documented behaviour:
    #   harvest(foo, tag='test')({}, 1.)                  == (1., {'x': 1.})
    #   harvest(nest(foo, scope='a'), tag='test')({}, 1.) == (1., {'a': {'x': 1.}})
    def foo(x):
        return sow(x, tag="test", name="x")

    x = jnp.float32(1.0)
    assert_tree_close(harvest(foo, tag="test")({}, x), (x, {"x": x}))
    assert_tree_close(harvest(nest(foo, scope="a"), tag="test")({}, x), (x, {"a": {"x": x}}))
    twice = nest(nest(foo, scope="a"), scope="b")
    assert_tree_close(reap(twice, tag="test")(x), (x, {"b": {"a": {"x": x}}}))
    assert_tree_close(nest(foo, scope="a")(x), x)  # the identity outside reap


def test_nest_lets_two_calls_sow_the_same_strict_name():
    def layer(x, w):
        return sow(jnp.tanh(w * x), tag="t", name="out")

    def model(x):
        y = nest(layer, scope="first")(x, 2.0)
        return nest(layer, scope="second")(y, 3.0), layer(y, 1.0)

    x = jnp.float32(0.3)
    (out, last), sown = jax.jit(reap(model, tag="t"))(x)
    y = jnp.tanh(2.0 * x)
    expected = {"first": {"out": y}, "out": jnp.tanh(y), "second": {"out": jnp.tanh(3.0 * y)}}
    assert_tree_close((out, last, sown), (jnp.tanh(3.0 * y), jnp.tanh(y), expected))


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_nest_through_every_primitive(axis_type):
    args, mesh, sown_t, sown_u = everywhere_inputs(axis_type)
    expected_out = sows_everywhere(*args, mesh=mesh, sow=_identity)
    scoped = nest(nest(jax.jit(sows_everywhere, static_argnames="mesh"), scope="a"), scope="b")
    (out, inner), outer = jax.jit(reap(reap(scoped, tag="t"), tag="u"), static_argnames="mesh")(
        *args, mesh=mesh
    )
    assert_tree_close(
        (out, inner, outer), (expected_out, {"b": {"a": sown_t}}, {"b": {"a": sown_u}})
    )


def test_nest_under_vmap_and_grad():
    def f(x):
        return nest(lambda x: sow(jnp.sin(x), tag="t", name="s") * 2.0, scope="a")(x)

    out, sown = jax.vmap(reap(f, tag="t"))(XS)
    assert_tree_close((out, sown), (2.0 * jnp.sin(XS), {"a": {"s": jnp.sin(XS)}}))
    grad = jax.grad(lambda x: reap(f, tag="t")(x)[1]["a"]["s"])(jnp.float32(0.4))
    assert_tree_close(grad, jnp.cos(jnp.float32(0.4)))
    grad = jax.grad(lambda s: plant(f, tag="t")({"a": {"s": s}}, jnp.float32(0.4)))(1.0)
    assert_tree_close(grad, jnp.float32(2.0))


def test_plant_into_nested_scopes_through_scan_and_shard_map(mesh42):
    planted = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0])
    scoped = nest(nest(feed_back, scope="inner"), scope="outer")
    ys = jax.jit(plant(scoped, tag="t"))({"outer": {"inner": {"fed": planted}}}, XS)
    assert_tree_close(ys, planted)
    # Round trip through reap.
    ys, sown = reap(scoped, tag="t")(XS)
    assert_tree_close(plant(scoped, tag="t")(sown, XS), ys)

    def f(x):
        def body(block):
            return block * sow(block.sum(), tag="t", name="scale")

        sm = jax.shard_map(body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
        return nest(sm, scope="s")(x) + sow(x, tag="t", name="scale", mode="clobber")

    x = jnp.arange(16.0)
    scales = jnp.arange(8.0) + 1.0
    out = plant(f, tag="t")({"s": {"scale": scales}, "scale": jnp.ones(16)}, x)
    assert_tree_close(out, (x.reshape(8, 2) * scales[:, None]).reshape(16) + 1.0)


def test_nest_scope_and_name_clash_is_an_error():
    def f(x):
        sow(x, tag="t", name="a")  # <CLASH_NAME>
        return nest(lambda x: sow(x, tag="t", name="y"), scope="a")(x)  # <CLASH_SCOPE>

    with raises(ValueError, "name 'a' of tag 't'", at("CLASH_NAME"), "'a/y'", at("CLASH_SCOPE")):
        reap(f, tag="t")(jnp.float32(1.0))


def test_nest_errors_name_the_scope_and_the_user_lines():
    def f(x):
        sow(x, tag="t", name="y")  # <NESTED_FIRST>
        return sow(x, tag="t", name="y")  # <NESTED_SECOND>

    with raises(
        ValueError,
        "name 'y' in scope 'b/a' of tag 't'",
        "sown twice",
        at("NESTED_FIRST"),
        at("NESTED_SECOND"),
    ):
        reap(nest(nest(f, scope="a"), scope="b"), tag="t")(jnp.float32(1.0))


def test_plant_nested_values_mistakes():
    scoped = nest(with_sow, scope="a")
    x = jnp.float32(0.7)
    with raises(TypeError, "scope 'a'", "is a float, not a dict", "values[scope][name]"):
        plant(scoped, tag="t")({"a": 1.0}, x)
    with raises(ValueError, "['a/w', 'b']", "never sows", "['a/y', 'a/z']"):
        plant(scoped, tag="t")({"a": {"y": 1.0, "w": 2.0}, "b": 1.0}, x)
    with raises(TypeError, "non-empty string scope"):
        nest(with_sow, scope="")


def test_allowlist_takes_a_scope_or_a_path_inside_it():
    def f(x):
        sow(x, tag="t", name="top")
        nest(lambda x: sow(x, tag="t", name="p") + sow(x, tag="t", name="q"), scope="s")(x)
        return x

    x = jnp.float32(2.0)
    assert_tree_close(reap(f, tag="t", allowlist=["s"])(x)[1], {"s": {"p": x, "q": x}})
    assert_tree_close(reap(f, tag="t", allowlist=[("s", "q")])(x)[1], {"s": {"q": x}})
    assert_tree_close(reap(f, tag="t", blocklist=[("s", "q")])(x)[1], {"s": {"p": x}, "top": x})


# ---------------------------------------------------------------- harvest


def test_harvest_oryx_documented_examples():
    # From Oryx's harvest module documentation.
    def f(x):
        y = sow(x + 1.0, tag="intermediate", name="y")
        return y + 1.0

    harvested = harvest(f, tag="intermediate")
    assert_tree_close(harvested({"y": 0.0}, 1.0), (1.0, {}))
    assert_tree_close(harvested({"y": 0.0}, 5.0), (1.0, {}))
    assert_tree_close(harvested({}, 1.0), (3.0, {"y": 2.0}))
    assert_tree_close(harvested({}, 5.0), (7.0, {"y": 6.0}))
    # No sow of the tag is left for an enclosing harvest (nothing to reap, nothing
    # to plant) or reap.
    assert harvest(harvested, tag="intermediate")({}, {}, 1.0)[1] == {}
    with raises(ValueError, "['y']", "never sows under tag 'intermediate'"):
        harvest(harvested, tag="intermediate")({"y": 3.0}, {}, 1.0)
    assert reap(harvested, tag="intermediate")({}, 1.0)[1] == {}


def test_harvest_with_nest_scopes_and_a_planted_while_name():
    def layer(x, trips):
        def body(state):
            i, x = state
            return i + 1, sow(x, tag="t", name="h", mode="clobber") * 2.0

        return sow(lax.while_loop(lambda s: s[0] < trips, body, (0, x))[1], tag="t", name="out")

    def model(x, trips):
        return nest(layer, scope="b")(nest(layer, scope="a")(x, trips), trips)

    x = jnp.float32(1.0)
    # "h" is first sown in a while loop without init: reaping it is an error,
    # planting it is not (a planted value needs no zero-trip value).
    with raises(ValueError, "name 'h' in scope 'a'", "first sown", "init="):
        reap(model, tag="t")(x, 2)
    values = {"a": {"h": 5.0}, "b": {"h": 0.5}}
    out, reaped = jax.jit(harvest(model, tag="t"))(values, x, 2)
    # Scope a: two trips of 5 * 2 -> 10; scope b: 0.5 * 2 -> 1.
    assert_tree_close((out, reaped), (jnp.float32(1.0), {"a": {"out": 10.0}, "b": {"out": 1.0}}))
    out, reaped = harvest(model, tag="t")({"a": {"h": 5.0, "out": 3.0}, "b": {"h": 0.5}}, x, 0)
    assert_tree_close((out, reaped), (jnp.float32(3.0), {"b": {"out": 3.0}}))


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_harvest_plants_some_names_and_reaps_the_others(axis_type):
    args, mesh, sown_t, sown_u = everywhere_inputs(axis_type)

    def planted_sow(value, *, tag, name, **_):
        # What each sow of the planted names receives: every shard gets ones.
        per_sow = {"top": jnp.float32(-2.0), "in_while": jnp.float32(0.5), "in_shard": jnp.ones(1)}
        return per_sow[name] if tag == "t" and name in per_sow else value

    # Planted: a straight-line name, the while one (a clobber constant) and the
    # shard_map one (one entry per shard); reaped: the others.
    values = {"top": -2.0, "in_while": 0.5, "in_shard": jnp.ones((8, 1))}
    harvested = jax.jit(harvest(sows_everywhere, tag="t"), static_argnames="mesh")
    (out, reaped), outer = reap(harvested, tag="u")(values, *args, mesh=mesh)
    assert_tree_close(out, sows_everywhere(*args, mesh=mesh, sow=planted_sow))
    # "top" starts the scan: -2 + 4.5 + sum((xs + 1) * 3 xs), and pred=True adds 1.
    total = -2.0 + 4.5 + np.sum((np.arange(4.0) + 1.0) * 3.0 * np.arange(4.0))
    assert_tree_close(reaped, {"in_cond": total + 1.0, "in_scan": sown_t["in_scan"]})
    assert_tree_close(outer, sown_u)


def test_harvest_appended_names_in_scan_planted_and_reaped():
    def f(xs):
        def step(carry, x):
            fed = sow(x + carry, tag="t", name="fed", mode="append")
            seen = sow(fed * 2.0, tag="t", name="seen", mode="append")
            return carry + 1.0, seen

        return lax.scan(step, jnp.float32(0.0), xs)[1]

    planted = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0])
    ys, reaped = jax.jit(harvest(f, tag="t"))({"fed": planted}, XS)
    assert_tree_close((ys, reaped), (planted * 2.0, {"seen": planted * 2.0}))


def test_harvest_under_vmap_and_grad():
    def f(x):
        y = sow(jnp.sin(x), tag="t", name="y")
        z = sow(y * x, tag="t", name="z")
        return z**2

    harvested = harvest(f, tag="t")
    out, reaped = jax.vmap(harvested, in_axes=(0, 0))({"y": XS * 10.0}, XS)
    assert_tree_close((out, reaped), ((XS * 10.0 * XS) ** 2, {"z": XS * 10.0 * XS}))
    x = jnp.float32(0.4)
    # d/dy of (y * x)**2 at y = 3: 2 * 3 * x * x; d/dx: 2 * 3 * x * 3.
    grad_y, grad_x = jax.grad(lambda y, x: harvested({"y": y}, x)[0], argnums=(0, 1))(3.0, x)
    assert_tree_close((grad_y, grad_x), (2.0 * 3.0 * x * x, 2.0 * 3.0 * x * 3.0))
    grad_of_reaped = jax.grad(lambda x: harvested({}, x)[1]["z"])(x)
    assert_tree_close(grad_of_reaped, jnp.sin(x) + x * jnp.cos(x))


def test_harvest_traces_the_function_once():
    traces = []

    def f(x):
        traces.append(None)
        return sow(x * 2.0, tag="t", name="a") + sow(x, tag="t", name="b")

    out, reaped = harvest(f, tag="t")({"a": 5.0}, jnp.float32(1.0))
    assert_tree_close((out, reaped), (jnp.float32(6.0), {"b": 1.0}))
    assert len(traces) == 1


def test_harvest_with_allowlist_leaves_the_others_for_an_outer_reap():
    def f(x):
        return (
            sow(x, tag="t", name="a")
            + sow(x * 2.0, tag="t", name="b")
            + sow(x * 3.0, tag="t", name="c")
        )

    harvested = harvest(f, tag="t", allowlist=["a", "b"])
    (out, inner), outer = reap(harvested, tag="t")({"a": 10.0}, jnp.float32(1.0))
    assert_tree_close((out, inner, outer), (jnp.float32(15.0), {"b": 2.0}, {"c": 3.0}))
    with raises(
        ValueError, "harvest(tag='t', allowlist=['a', 'b']) was given ['c']", "allowlist/blocklist"
    ):
        harvested({"c": 1.0}, jnp.float32(1.0))
    with raises(TypeError, "harvest(fn, tag='t')", "dict from sown names"):
        harvested(1.0, jnp.float32(1.0))


# ---------------------------------------------------------------- init: zero-trip loops


def while_with_init(x, trips, *, init=-1.0):
    def body(state):
        i, x = state
        state = {"value": x, "count": i}
        sown = sow(state, tag="t", name="last", mode="clobber", init=init)  # <INIT_SOW>
        return i + 1, sown["value"] * 2.0

    return lax.while_loop(lambda state: state[0] < trips, body, (0, x))  # <INIT_LOOP>


@pytest.mark.parametrize(("trips", "value", "count"), [(0, -1.0, -1), (1, 1.5, 0), (3, 6.0, 2)])
def test_reap_while_init_is_what_a_zero_trip_loop_yields(trips, value, count):
    (_, x), sown = jax.jit(reap(while_with_init, tag="t"))(jnp.float32(1.5), trips)
    assert_tree_close(x, jnp.float32(1.5 * 2.0**trips))
    assert_tree_close(sown, {"last": {"count": np.int32(count), "value": np.float32(value)}})
    assert sown["last"]["count"].dtype == jnp.int32


def test_reap_while_init_with_nan_and_under_vmap():
    def f(x, trips):
        def body(state):
            i, x = state
            return i + 1, sow(x, tag="t", name="last", mode="clobber", init=float("nan")) * 2.0

        return lax.while_loop(lambda state: state[0] < trips, body, (0, x))

    # The loop's predicate is batched: each entry stops after its own trips.
    _, sown = jax.vmap(reap(f, tag="t"))(jnp.ones(3), jnp.array([0, 2, 1]))
    assert np.isnan(sown["last"][0])
    assert_tree_close(sown["last"][1:], jnp.array([2.0, 1.0]))


def _unbatched_before(kind: str):
    """A program that sows "v" before a loop (or a cond) on a value that does not
    depend on its input `b`, and again inside on one that does: under
    `jax.vmap` over `b`, JAX binds the first sow unbatched and the second
    batched."""

    def f(b, flag):
        v = sow(jnp.zeros(3), tag="t", name="v", mode="clobber")

        def step(v):
            return sow(v + b, tag="t", name="v", mode="clobber") * 0.5

        if kind == "while":
            return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, step(c[1])), (0, v))[1]
        if kind == "scan":
            return lax.scan(lambda v, _: (step(v), None), v, None, length=3)[0]
        return lax.cond(flag, lambda: step(v), lambda: v)

    return f


@pytest.mark.parametrize("kind", ["while", "scan", "cond"])
def test_reap_of_vmap_with_a_value_sown_unbatched_before_a_loop(kind):
    # reap(vmap(f)) carries the unbatched value broadcast along the batch, as
    # each element of vmap(reap(f)) has it.
    f = _unbatched_before(kind)
    bs = jnp.stack([XS[:3], -XS[2:]])
    for flag in (True, False) if kind == "cond" else (True,):
        expected = jax.vmap(reap(f, tag="t"), (0, None))(bs, flag)
        for wrapped in (
            reap(jax.vmap(f, (0, None)), tag="t"),
            jax.jit(reap(jax.vmap(f, (0, None)), tag="t"), static_argnums=1),
        ):
            out, sown = wrapped(bs, flag)
            assert sown["v"].shape == (2, 3)
            np.testing.assert_array_equal(out, expected[0])
            np.testing.assert_array_equal(sown["v"], expected[1]["v"])


def test_reap_while_sow_of_another_shape_is_an_error():
    # Without vmap, a shape the value sown before the loop does not have is the
    # program's error, not a batch to broadcast along.
    def f(b):
        v = sow(b, tag="t", name="v", mode="clobber")

        def body(c):
            i, v = c
            return i + 1, sow(jnp.stack([v, v]), tag="t", name="v", mode="clobber")[0]

        return lax.while_loop(lambda c: c[0] < 3, body, (0, v))[1]

    with pytest.raises(ValueError, match="with a shape or dtype other than the value sown before"):
        reap(f, tag="t")(XS[:3])


def test_reap_while_init_that_a_leaf_cannot_hold_is_an_error():
    # JAX would turn NaN into 0 in the int32 "count" leaf: kups does not.
    with raises(ValueError, "name 'last'", at("INIT_SOW"), "init=nan", "dtype int32"):
        reap(while_with_init, tag="t")(jnp.float32(1.0), 0, init=float("nan"))
    with raises(ValueError, "init=0.5", "dtype int32"):
        reap(while_with_init, tag="t")(jnp.float32(1.0), 0, init=0.5)


def test_reap_value_sown_before_the_loop_takes_precedence_over_init():
    def f(x, trips):
        sow({"value": jnp.float32(7.0), "count": 7}, tag="t", name="last", mode="clobber")
        return while_with_init(x, trips)

    assert_tree_close(reap(f, tag="t")(jnp.float32(1.0), 0)[1]["last"]["value"], 7.0)
    assert_tree_close(reap(f, tag="t")(jnp.float32(1.0), 2)[1]["last"]["value"], 2.0)


def test_reap_while_init_inside_scan_and_inside_a_nested_while():
    def f(starts, trips):
        def step(carry, start_and_trips):
            start, n = start_and_trips
            return carry, while_with_init(start, n)[1]

        return lax.scan(step, 0.0, (starts, trips))[1]

    starts, trips = jnp.array([1.0, 2.0, 3.0]), jnp.array([2, 0, 1])
    _, sown = reap(f, tag="t")(starts, trips)
    # The clobber name comes out of the last iteration: one trip from 3.0.
    assert_tree_close(sown["last"], {"count": np.int32(0), "value": np.float32(3.0)})

    def outer(x, outer_trips, inner_trips):
        def body(state):
            i, x = state
            return i + 1, while_with_init(x, inner_trips)[1]

        return lax.while_loop(lambda s: s[0] < outer_trips, body, (0, x))[1]

    for outer_trips, inner_trips, value in [(0, 3, -1.0), (2, 0, -1.0), (1, 2, 2.0)]:
        _, sown = jax.jit(reap(outer, tag="t"))(jnp.float32(1.0), outer_trips, inner_trips)
        assert_tree_close(sown["last"]["value"], jnp.float32(value))


@pytest.fixture
def traced_bodies(monkeypatch):
    """The names of the bodies the interpreters trace, in order."""
    import kups.effects._body as body_module

    traced = []
    trace_body = body_module.trace_body

    def counting(*args, **kwargs):
        traced.append(kwargs.get("name"))
        return trace_body(*args, **kwargs)

    monkeypatch.setattr(body_module, "trace_body", counting)
    return traced


def test_reap_while_traces_its_body_once(traced_bodies):
    # A name first sown directly in the body, with an init, starts the carry at
    # its init: the body is not traced a first time to find its shape, and the
    # condition, where nothing is sown, is not traced again at all.
    def f(x, trips):
        def body(state):
            i, v = state
            return i + 1, sow(jnp.sin(v), tag="t", name="v", mode="clobber", init=-1.0)

        return lax.while_loop(lambda s: s[0] < trips, body, (0, x))[1]

    reaped = jax.jit(reap(f, tag="t"))
    for trips, value in [(0, -1.0), (2, np.sin(np.sin(np.float32(0.5))))]:
        out, sown = reaped(jnp.float32(0.5), trips)
        assert_tree_close(sown["v"], jnp.float32(value))
        assert_tree_close(out, jax.jit(f)(jnp.float32(0.5), trips))
    assert traced_bodies == ["while_loop body"]


def _nested_in_while(around):
    """A while loop whose body holds `around` (a while, scan, cond or jit) around
    a clobber sow with an init."""

    def leaf(v):
        return sow(jnp.sin(v), tag="t", name="v", mode="clobber", init=-1.0)

    def inner(v, i):
        if around == "while":
            return lax.while_loop(lambda s: s[0] < i, lambda s: (s[0] + 1, leaf(s[1])), (0, v))[1]
        if around == "scan":
            return lax.scan(lambda c, _: (leaf(c), None), v, length=2)[0]
        if around == "cond":
            return lax.cond(v > 0, leaf, lambda v: leaf(v * 2.0), v)
        return jax.jit(leaf)(v)

    def f(x, trips):
        def body(state):
            i, v = state
            return i + 1, inner(v, i)

        return lax.while_loop(lambda s: s[0] < trips, body, (0, x))[1]

    return f


@pytest.mark.parametrize("around", ["while", "scan", "cond", "jit"])
def test_reap_nested_while_traces_each_body_once(traced_bodies, around):
    # A name sown with an init inside control flow nested in a loop's body also
    # starts the loop's carry at its init: each body is traced once, not once
    # per trace of the body around it.
    jax.make_jaxpr(reap(_nested_in_while(around), tag="t"), static_argnums=1)(jnp.float32(0.5), 3)
    expected = {
        "while": ["while_loop body", "while_loop body"],
        "scan": ["while_loop body", "scan"],
        "cond": ["while_loop body", "cond branch 0", "cond branch 1"],
        "jit": ["while_loop body", "jit leaf"],
    }
    assert traced_bodies == expected[around]


@pytest.mark.parametrize("around", ["while", "scan", "cond", "jit"])
def test_reap_nested_while_values_are_those_without_the_shortcut(monkeypatch, around):
    # Starting the carry at the init gives what tracing the body to find the
    # name's shape, then starting it at the init, gives: 0 outer trips (the
    # init), and inner loops that run 0, 1, 2 times.
    from kups.harvest._reap import Reaper

    f = _nested_in_while(around)
    results = []
    for shortcut in [True, False]:
        if not shortcut:
            monkeypatch.setattr(Reaper, "preseeded", lambda self, ctx, *args: ctx)
        results.append(
            [jax.jit(reap(f, tag="t"), static_argnums=1)(jnp.float32(0.5), n) for n in range(4)]
        )
    for (out, sown), (plain_out, plain_sown) in zip(*results, strict=True):
        assert_tree_close(out, plain_out)
        assert_tree_close(sown, plain_sown)
    assert_tree_close(results[0][0][1]["v"], jnp.float32(-1.0))
    assert_tree_close(results[0][3][0], jax.jit(f, static_argnums=1)(jnp.float32(0.5), 3))


def test_reap_nested_while_a_name_one_branch_sows_starts_at_its_init():
    # A name sown with init= in only one branch of a cond inside the loop: the
    # other branch leaves it as it was, its init before any sow.
    def f(x, start):
        def body(state):
            i, v = state
            v = lax.cond(
                i > start,
                lambda v: sow(v + 1.0, tag="t", name="v", mode="clobber", init=0.0),
                lambda v: v,
                v,
            )
            return i + 1, v

        return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    for start, expected in ((1, 1.5), (0, 2.5), (5, 0.0)):
        for fn in (reap(f, tag="t"), jax.jit(reap(f, tag="t"))):
            out, reaped = fn(jnp.float32(0.5), start)
            assert_tree_close(out, f(jnp.float32(0.5), start))
            assert_tree_close(reaped["v"], jnp.float32(expected))


def test_reap_nested_while_a_shared_body_sown_in_a_branch_and_directly():
    # One jitted function (one jaxpr) sows in a branch of a cond, where only one
    # branch sows, and then directly: the last sow wins.
    leaf = jax.jit(lambda v: sow(v + 1.0, tag="t", name="v", mode="clobber", init=0.0))

    def f(x):
        def body(state):
            i, v = state
            v = lax.cond(i > 1, leaf, lambda v: v, v)
            return i + 1, leaf(v)

        return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    out, reaped = reap(f, tag="t")(jnp.float32(0.5))
    assert_tree_close(out, jnp.float32(4.5))
    assert_tree_close(reaped["v"], jnp.float32(4.5))


# A clobber sow with init=, in one branch of a cond: alone, in equinox's bounded
# while loop (a scan of conds) and in a while loop, each stepping `p` times.
def step_value(h):
    return sow(jnp.sin(h), tag="t", name="last", mode="clobber", init=-1.0)


def alone(p, x):
    return lax.cond(p > 0, step_value, lambda h: h, x)


def bounded(p, x):
    cond = lambda c: c[0] < p  # noqa: E731
    body = lambda c: (c[0] + 1, step_value(c[1]))  # noqa: E731
    return eqxi.while_loop(cond, body, (0, x), max_steps=5, kind="bounded")[1]


def lax_while(p, x):
    return lax.while_loop(lambda c: c[0] < p, lambda c: (c[0] + 1, step_value(c[1])), (0, x))[1]


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_reap_a_sow_with_init_in_one_branch_of_a_cond(how):
    # A cond (alone, in a scan, and in equinox's bounded while loop, which is a
    # scan of conds): a branch that does not sow leaves the name as it was, its
    # init before any sow, as a while loop that runs no step does.
    def scanned(p, x):
        def step(c, _):
            return lax.cond(c[0] < p, lambda c: (c[0] + 1, step_value(c[1])), lambda c: c, c), None

        return lax.scan(step, (0, x), length=5)[0][1]

    def run(fn, p, x):
        wrapped = reap(fn, tag="t")
        if how == "jit":
            return jax.jit(wrapped)(p, x)
        if how == "vmap":
            out, reaped = jax.vmap(wrapped, in_axes=(None, 0))(p, jnp.stack([x, x]))
            return out[0], {name: value[0] for name, value in reaped.items()}
        return wrapped(p, x)

    x = jnp.float32(1.0)
    for fn in (alone, scanned, bounded, lax_while):
        for p, steps in ((3, 3), (0, 0)):
            out, reaped = run(fn, p, x)
            assert_tree_close(out, fn(p, x))
            expected = x
            for _ in range(min(steps, 1) if fn is alone else steps):
                expected = jnp.sin(expected)
            assert_tree_close(reaped["last"], expected if steps else jnp.float32(-1.0))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_plant_a_sow_with_init_in_one_branch_of_a_cond(how):
    # The programs `reap` takes above, `plant` takes too: the planted value
    # replaces the sow where it runs (equinox's bounded while loop is a scan of
    # conds, so no sow in it could be planted before).
    x, planted = jnp.float32(1.0), {"last": jnp.float32(10.0)}
    for fn in (alone, bounded, lax_while):
        wrapped = plant(fn, tag="t")
        wrapped = jax.jit(wrapped) if how == "jit" else wrapped
        assert_tree_close(wrapped(planted, 3, x), jnp.float32(10.0))
        assert_tree_close(wrapped(planted, 0, x), x)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_reap_while_init_inside_shard_map(axis_type):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P(("x", "y"))))

    def f(x):
        def body(block):
            def halve(v):
                return sow(v * 0.5, tag="t", name="v", mode="clobber", init=-1.0)

            return lax.while_loop(lambda v: v.sum() > 4.0, halve, block)

        return jax.shard_map(body, mesh=mesh, in_specs=P(("x", "y")), out_specs=P(("x", "y")))(x)

    out, sown = jax.jit(reap(f, tag="t"))(x)
    blocks = np.arange(16.0).reshape(8, 2)
    expected = []
    for block in blocks:
        last = np.full(2, -1.0)
        while block.sum() > 4.0:
            block = block * 0.5
            last = block
        expected.append(last)
    assert_tree_close(sown["v"], np.stack(expected))
    assert_tree_close(out, f(x))


@pytest.mark.parametrize("reverse", [False, True])
def test_reap_clobber_init_after_a_zero_length_scan(reverse):
    def f(xs):
        def step(carry, x):
            return carry + x, sow(carry * x, tag="t", name="c", mode="clobber", init=0.0)

        return lax.scan(step, jnp.float32(1.0), xs, reverse=reverse)

    assert_tree_close(reap(f, tag="t")(XS[:0])[1], {"c": jnp.float32(0.0)})
    (_, ys), sown = reap(f, tag="t")(XS)
    assert_tree_close(sown["c"], ys[0] if reverse else ys[-1])


def test_reap_first_sown_in_while_without_init_names_the_way_out():
    with raises(
        ValueError,
        "first sown",
        at("WHILE_SOW"),
        at("WHILE_LOOP"),
        "kups does not invent",
        "before the loop",
        "init=",
    ):
        reap(doubling_while, tag="t")(jnp.float32(1.0), 3, initial=False)


def test_sow_init_mistakes_are_clear_errors():
    with raises(ValueError, "init=0.0", "mode='clobber'"):
        sow(1.0, tag="t", name="y", init=0.0)
    with raises(ValueError, "init=0.0", "mode='append'"):
        sow(1.0, tag="t", name="y", mode="append", init=0.0)
    with raises(TypeError, "init of type Array", "a number"):
        sow(1.0, tag="t", name="y", mode="clobber", init=jnp.zeros(()))

    def two_inits(x, trips):
        def body(x):
            x = sow(x, tag="t", name="v", mode="clobber", init=0.0)  # <INIT_ZERO>
            return sow(x * 2.0, tag="t", name="v", mode="clobber", init=1.0)  # <INIT_ONE>

        return lax.while_loop(lambda x: x < trips, body, x)

    with raises(ValueError, "init=0.0", at("INIT_ZERO"), "init=1.0", at("INIT_ONE")):
        reap(two_inits, tag="t")(jnp.float32(1.0), 3.0)


def test_plant_ignores_init_and_nest_keeps_it():
    assert_tree_close(
        plant(while_with_init, tag="t")(
            {"last": {"value": jnp.float32(3.0), "count": 0}}, jnp.float32(1.0), 2
        ),
        (2, jnp.float32(6.0)),
    )
    _, sown = reap(nest(while_with_init, scope="w"), tag="t")(jnp.float32(1.0), 0)
    assert_tree_close(sown, {"w": {"last": {"count": np.int32(-1), "value": np.float32(-1.0)}}})


# ---------------------------------------------------------------- policy: opaque control flow
# `library_call` is a control-flow primitive kups has no handler for (see
# tests/library_primitive.py): the interpreters cannot walk what it runs.

IGNORE, WARN, RAISE = InterpreterPolicy.IGNORE, InterpreterPolicy.WARN, InterpreterPolicy.RAISE


def hiding_a_sow(x):
    def hidden(a):
        return sow(jnp.sin(a), tag="t", name="hidden") * 2.0

    y = sow(x + 1.0, tag="t", name="seen")
    return library_call(hidden, y)[0]


def hiding_a_sow_plainly(x):
    return jnp.sin(x + 1.0) * 2.0


@pytest.mark.parametrize("wrapper", [reap, plant, harvest, nest])
def test_policy_must_be_an_interpreter_policy(wrapper):
    options = {"scope": "s"} if wrapper is nest else {"tag": "t"}
    with raises(TypeError, "RAISE", "WARN", "IGNORE", "InterpreterPolicy.WARN"):
        wrapper(hiding_a_sow, policy="warn", **options)
    with raises(TypeError, "InterpreterPolicy", "got 2"):
        wrapper(hiding_a_sow, policy=2, **options)


def test_raise_says_a_sow_in_opaque_control_flow_would_be_lost():
    # Each message names the policy= of the wrapper that raised, the user's way out.
    calls = [
        ("reap", lambda: reap(hiding_a_sow, tag="t")(1.0)),
        ("reap", lambda: jax.jit(reap(hiding_a_sow, tag="t", policy=RAISE))(1.0)),
        ("plant", lambda: plant(hiding_a_sow, tag="t")({"seen": 2.0}, 1.0)),
        ("harvest", lambda: harvest(hiding_a_sow, tag="t")({}, 1.0)),
        ("nest", lambda: reap(nest(hiding_a_sow, scope="s"), tag="t", policy=IGNORE)(1.0)),
    ]
    for wrapper, call in calls:
        way_out = f"policy=InterpreterPolicy.IGNORE to {wrapper}(fn, policy=...)"
        with raises(NotImplementedError, "'library_call'", "library_primitive.py", "lost", way_out):
            call()


@pytest.mark.parametrize("policy", [IGNORE, WARN])
def test_a_sow_in_opaque_control_flow_is_not_reaped(policy):
    x = jnp.float32(0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, reaped = reap(hiding_a_sow, tag="t", policy=policy)(x)
        jit_out, jit_reaped = jax.jit(reap(hiding_a_sow, tag="t", policy=policy))(x)
    assert_tree_close(out, hiding_a_sow_plainly(x))
    assert_tree_close(reaped, {"seen": x + 1.0})
    assert_tree_close((jit_out, jit_reaped), (out, reaped))
    messages = [str(w.message) for w in caught if "'library_call'" in str(w.message)]
    assert bool(messages) == (policy is WARN)


# `library_fn_call` holds a Python function, not a jaxpr: kups cannot see into it.
# A sow bound when it runs (eagerly), is traced or is compiled (under jit) is not
# lost silently.


def sows_in_a_held_function(x):
    def held(a):
        return (sow(jnp.sin(a), tag="t", name="held") * 2.0,)

    y = sow(x + 1.0, tag="t", name="seen")
    return library_fn_call(held, y)[0]


@pytest.mark.parametrize(
    "wrapper, caller",
    [
        (lambda f: reap(f, tag="t"), "reap"),
        (lambda f: jax.jit(reap(f, tag="t")), "reap"),
        (lambda f: reap(jax.jit(f), tag="t"), "reap"),
        (lambda f: functools.partial(plant(f, tag="t"), {"held": 1.0}), "plant"),
        (lambda f: jax.jit(functools.partial(harvest(f, tag="t"), {})), "harvest"),
    ],
    ids=["reap", "jit-reap", "reap-jit", "plant", "jit-harvest"],
)
def test_a_sow_in_a_function_a_library_primitive_holds_is_not_lost_silently(wrapper, caller):
    with raises(
        NotImplementedError,
        "'sow'",
        "'library_fn_call'",
        "would be lost",
        f"policy=InterpreterPolicy.IGNORE to {caller}(fn, policy=...)",
    ):
        wrapper(sows_in_a_held_function)(jnp.float32(0.5))


@pytest.mark.parametrize("policy", [IGNORE, WARN])
def test_ignore_or_warn_runs_a_library_primitive_holding_a_sow(policy):
    x = jnp.float32(0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, reaped = jax.jit(reap(sows_in_a_held_function, tag="t", policy=policy))(x)
    assert_tree_close(out, hiding_a_sow_plainly(x))
    assert_tree_close(reaped, {"seen": x + 1.0})
    lost = [w for w in caught if "would be lost" in str(w.message)]
    assert bool(lost) == (policy is WARN)


def test_a_library_primitive_holding_sows_of_another_tag_runs():
    x = jnp.float32(0.5)
    for wrapped in (
        reap(sows_in_a_held_function, tag="u"),
        jax.jit(reap(sows_in_a_held_function, tag="u")),
    ):
        out, reaped = wrapped(x)
        assert_tree_close(out, hiding_a_sow_plainly(x))
        assert reaped == {}
    # Left out by the blocklist, the held sow is not one reap would take.
    out, reaped = reap(sows_in_a_held_function, tag="t", blocklist=["held"])(x)
    assert_tree_close(reaped, {"seen": x + 1.0})


def test_ignore_reaps_around_opaque_calls_in_scan_and_while():
    def f(xs):
        def step(carry, x):
            carry = sow(carry + x, tag="t", name="total", mode="append")
            # A strict sow inside a scan (or a while_loop, below) would be an
            # error, but these are hidden in opaque calls: they are never reaped.
            return library_call(lambda c: sow(c * 3.0, tag="t", name="inside"), carry)[0], None

        total = lax.scan(step, jnp.float32(0), xs)[0]

        def body(v):
            return library_call(lambda a: sow(a * 2.0, tag="t", name="inside_while"), v)[0]

        return lax.while_loop(lambda v: v < 100.0, body, total)

    totals, carry = [], jnp.float32(0)
    for x in XS:
        carry = carry + x
        totals.append(carry)
        carry = carry * 3.0
    final = carry
    while final < 100.0:
        final = final * 2.0
    for wrapped in (reap(f, tag="t", policy=IGNORE), jax.jit(reap(f, tag="t", policy=IGNORE))):
        out, reaped = wrapped(XS)
        assert_tree_close(out, final)
        assert_tree_close(reaped, {"total": jnp.stack(totals)})


def test_plant_and_harvest_under_ignore_see_only_the_visible_sows():
    x = jnp.float32(0.5)
    planted = plant(hiding_a_sow, tag="t", policy=IGNORE)
    assert_tree_close(planted({"seen": 3.0}, x), jnp.sin(3.0) * 2.0)
    with raises(ValueError, "['hidden']", "never sows", "['seen']"):
        planted({"hidden": 3.0}, x)
    out, reaped = harvest(hiding_a_sow, tag="t", policy=IGNORE)({"seen": 3.0}, x)
    assert_tree_close((out, reaped), (jnp.sin(3.0) * 2.0, {}))
    out, reaped = reap(nest(hiding_a_sow, scope="s", policy=IGNORE), tag="t", policy=IGNORE)(x)
    assert_tree_close((out, reaped), (hiding_a_sow_plainly(x), {"s": {"seen": x + 1.0}}))


def test_opaque_control_flow_without_a_sow_runs_under_the_default_policy():
    def f(x):
        y = library_call(lambda a: jnp.cos(a) + 1.0, x)[0]
        return sow(y, tag="t", name="y") * 2.0

    x = jnp.float32(0.5)
    out, reaped = reap(f, tag="t")(x)
    assert_tree_close((out, reaped), ((jnp.cos(x) + 1.0) * 2.0, {"y": jnp.cos(x) + 1.0}))


# ---------------------------------------------------------------- docstring examples


@pytest.mark.parametrize("function", [sow, sow_cond, reap, reap_grads, plant, harvest, nest])
def test_docstring_example_runs(function):
    source = re.search(r"```python\n(.*?)```", function.__doc__, re.DOTALL)
    assert source is not None
    code = textwrap.dedent(source.group(1))  # Python 3.13 dedents docstrings itself
    exec(compile(code, f"<{function.__name__} docstring>", "exec"), {})


def test_wrappers_show_the_users_signature_with_their_leading_argument():
    import inspect

    def model(x, y, scale=2.0):
        return sow(x * scale, tag="t", name="a") + y

    assert str(inspect.signature(reap(model, tag="t"))) == "(x, y, scale=2.0)"
    assert str(inspect.signature(plant(model, tag="t"))) == "(values, /, x, y, scale=2.0)"
    assert str(inspect.signature(harvest(model, tag="t"))) == "(values, /, x, y, scale=2.0)"
    assert not hasattr(plant(model, tag="t"), "__wrapped__")
    # jit's static/donate argnums count the leading argument, as the signature says.
    planted = jax.jit(plant(model, tag="t"), static_argnums=3)
    assert planted({"a": jnp.float32(5.0)}, jnp.float32(1.0), jnp.float32(1.0), 3.0) == 6.0


def test_loops_without_a_sow_are_not_walked(monkeypatch):
    from kups.harvest._plant import Planter
    from kups.harvest._reap import Reaper

    calls = []
    for cls, names in [
        (Reaper, ("scan", "while_loop", "cond")),
        (Planter, ("scan", "while_loop")),
    ]:
        for name in names:
            original = getattr(cls, name)

            def counting(self, interpreter, ctx, eqn, invals, original=original):
                calls.append(eqn.primitive.name)
                return original(self, interpreter, ctx, eqn, invals)

            monkeypatch.setattr(cls, name, counting)

    def f(x):
        x = lax.scan(lambda c, v: (c + v, None), x, jnp.arange(3.0))[0]  # no sow
        x = lax.fori_loop(0, 3, lambda i, c: c * 2, x)  # no sow
        x = lax.cond(x > 0, jnp.sin, jnp.cos, x)  # no sow
        x = sow(x, tag="t", name="last")
        return lax.scan(
            lambda c, v: (sow(c + v, tag="t", name="s", mode="append"), None), x, jnp.arange(2.0)
        )[0]

    out, sown = jax.jit(reap(f, tag="t"))(1.0)
    np.testing.assert_array_equal(out, jax.jit(f)(1.0))
    assert set(sown) == {"last", "s"} and sown["s"].shape == (2,)
    planted = jax.jit(plant(f, tag="t"))({"last": 5.0}, 1.0)
    assert planted == 5.0 + 0.0 + 1.0
    # Only the scan that sows reaches the handlers, once for reap and once for plant.
    assert calls == ["scan", "scan"]


# ---------------------------------------------------------------- jax.export


def _exported_program(x):
    y = sow(jnp.sin(x), tag="t", name="y")
    h = lax.scan(lambda c, v: (c + sow(v * c, tag="t", name="s", mode="append"), None), 1.0, x)[0]
    return sow(y * 2.0 + h, tag="t", name="out", mode="clobber")


def _round_trip(fn, *args):
    """`fn` exported from its jit, serialized, deserialized: its call, eagerly and
    inside jit, must give what `fn` gives."""
    from jax import export

    exported = export.export(jax.jit(fn))(*args)
    restored = export.deserialize(exported.serialize())
    expected = fn(*args)
    assert_tree_close(restored.call(*args), expected)
    assert_tree_close(jax.jit(restored.call)(*args), expected)
    assert jax.tree.structure(restored.call(*args)) == jax.tree.structure(expected)


def test_export_round_trips_reap_harvest_and_reap_grads():
    x = jnp.arange(3.0, dtype=jnp.float32)
    _round_trip(reap(_exported_program, tag="t"), x)
    _, reaped = reap(_exported_program, tag="t")(x)
    np.testing.assert_array_equal(reaped["s"], x * jnp.array([1.0, 1.0, 2.0]))
    _round_trip(lambda v: harvest(_exported_program, tag="t")({"y": jnp.ones(3)}, v), x)
    _round_trip(
        reap(lambda v: plant(_exported_program, tag="t")({"y": jnp.ones(3)}, v), tag="t"), x
    )
    _round_trip(reap_grads(lambda v: jnp.sum(_exported_program(v)), tag="t"), x)
    _round_trip(reap(nest(_exported_program, scope="inner"), tag="t"), x)
