"""`lax.composite`: a call of its decomposition. Re-bound whole when no handler
acts inside it; interpreted inline (its body's equations, the composite's name
dropped) when one does."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kups.checks import checked, nan_checks
from kups.debug import find_nans, nan_sites
from kups.effects import CALL_PRIMITIVES, Interpreter, default_dispatcher, reinterpret
from kups.harvest import plant, reap, sow
from kups.instrument import count_primitives

double_log = lax.composite(lambda x: jnp.log(x) * 2.0, name="my.double_log")


def f(x):
    return double_log(x) + 1.0


X = jnp.arange(4.0) - 1.0  # log(-1) is a NaN, log(0) an Inf


def test_identity_keeps_the_composite():
    assert "composite" in CALL_PRIMITIVES
    identity = reinterpret(f, Interpreter(default_dispatcher()))
    names = [e.primitive.name for e in jax.make_jaxpr(identity)(0, X).jaxpr.eqns]
    assert names == ["composite", "add"]
    np.testing.assert_array_equal(jax.jit(identity)(0, X)[0], jax.jit(f)(X))


def test_effects_see_inside_the_composite():
    counts = count_primitives(f)(X)[1]
    assert dict(counts) == {"log": 1, "mul": 1, "add": 1}
    for run in (checked(f, errors=nan_checks), jax.jit(checked(f, errors=nan_checks))):
        out, error = run(X)
        np.testing.assert_array_equal(out, f(X))
        assert error.kind == "nan" and "'log'" in error.message
    for report in ("reaching", "first"):
        assert find_nans(f, report=report)(X)[1].primitive == "log"
    sites = nan_sites(f)(X)[1]
    assert [(s.primitive, s.kind) for s in sites] == [("log", "nan"), ("log", "inf")]


def test_a_sow_inside_a_composite_is_reaped_and_planted():
    def g(x):
        inner = lax.composite(lambda x: sow(jnp.sin(x), tag="t", name="v") * 2.0, name="my.c")
        return inner(x)

    _, reaped = reap(g, tag="t")(X)
    np.testing.assert_array_equal(reaped["v"], jnp.sin(X))
    planted = jax.jit(plant(g, tag="t"))({"v": jnp.ones(4)}, X)
    np.testing.assert_array_equal(planted, 2.0 * jnp.ones(4))
