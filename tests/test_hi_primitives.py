"""JAX's own high-level primitives (`call_hi_primitive`, from JAX 0.12): what
`lax.custom_root`, `jnp.searchsorted`, `jnp.ldexp` and `jnp.frexp` bind. Each
holds an object that expands into the primitives it stands for; kups goes inside
that expansion, as it goes inside a library primitive, and keeps the primitive's
own derivative. The same programs are checked on every release, whatever they
bind there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kups.checks import check, checked, nan_checks
from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)
from kups.harvest import reap, sow
from kups.instrument import count_primitives

STEPS = 20


def newton(f, x0):
    return lax.fori_loop(0, STEPS, lambda i, x: x - f(x) / jnp.cos(x), x0)


def arcsin_by_newton(y):
    return lax.custom_root(lambda x: jnp.sin(x) - y, 0.5, newton, lambda g, r: r / jnp.cos(0.5))


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, default_primitive_handler(interpreter, ctx, eqn, invals).outvals)


def test_a_handler_sees_inside_custom_root():
    counted = reinterpret(
        arcsin_by_newton, Interpreter(default_dispatcher().register_handler("sin", count_sin))
    )
    for run in (counted, jax.jit(counted)):
        out, sins = run(0, 0.3)
        assert int(sins) == STEPS
        np.testing.assert_array_equal(out, jax.jit(arcsin_by_newton)(0.3))
    assert count_primitives(arcsin_by_newton)(0.3)[1]["sin"] == STEPS
    # The derivative is custom_root's own (its tangent solve), as in plain JAX.
    assert jax.grad(lambda y: counted(0, y)[0])(0.3) == jax.grad(arcsin_by_newton)(0.3)


def test_effects_inside_custom_root_are_not_lost():
    def with_effects(y):
        def f(x):
            sow(x, tag="t", name="iterate", mode="append")
            check(jnp.isfinite(x), "non-finite iterate")
            return jnp.sin(x) - y

        return lax.custom_root(f, 0.5, newton, lambda g, r: r)

    _, reaped = jax.jit(reap(with_effects, tag="t"))(0.3)
    assert reaped["iterate"].shape == (STEPS,)
    assert jax.jit(checked(with_effects))(0.3)[1].get() is None
    assert "non-finite iterate" in jax.jit(checked(with_effects))(jnp.nan)[1].get()
    assert checked(arcsin_by_newton, errors=nan_checks)(0.3)[1].get() is None


@pytest.mark.parametrize(
    "fn",
    [
        lambda v: jnp.searchsorted(jnp.linspace(0.0, 1.0, 10), v),
        lambda v: jnp.ldexp(v, 3),
        lambda v: jnp.frexp(v)[0],
    ],
    ids=["searchsorted", "ldexp", "frexp"],
)
def test_jnp_functions_that_bind_one_are_interpreted_bit_for_bit(fn):
    v = jnp.array([0.25, 0.7, -3.5])
    identity = reinterpret(fn, Interpreter(default_dispatcher()))
    np.testing.assert_array_equal(jax.jit(identity)(0, v)[0], jax.jit(fn)(v))
    np.testing.assert_array_equal(identity(0, v)[0], fn(v))
    counts = count_primitives(fn)(v)[1]
    assert "call_hi_primitive" not in dict(counts)
