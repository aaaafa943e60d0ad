"""`default_custom_vmap_handler` (`jax.custom_batching.custom_vmap`) and
`default_remat_opt_handler` (a `custom_vjp` with `optimize_remat=True`, as
differentiation stages it): the function is interpreted with the context, and the
user's vmap rule and `fwd`/`bwd` rules are still used. Every rule here differs
from what JAX would derive, so a test fails if the rule is bypassed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning

from kups.effects import (
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)
from kups.harvest import reap, sow

X = jnp.array([0.1, 0.5, 2.0])
XS = jnp.stack([X, 2 * X])


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, default_primitive_handler(interpreter, ctx, eqn, invals).outvals)


def counting():
    return Interpreter(default_dispatcher().register_handler("sin", count_sin))


def assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------- custom_vmap


@custom_batching.custom_vmap
def twice_sin(x):
    return 2.0 * jnp.sin(x)


@twice_sin.def_vmap
def _twice_sin_rule(axis_size, in_batched, xs):
    return jnp.full_like(xs, 7.0), in_batched[0]  # not 2 sin(x): the rule must be used


def sown_sin(x):
    return 2.0 * sow(jnp.sin(x), tag="t", name="s")


sown = custom_batching.custom_vmap(sown_sin)
sown.def_vmap(lambda axis_size, in_batched, xs: (jnp.full_like(xs, 7.0), in_batched[0]))


@pytest.mark.parametrize("jit", [False, True])
def test_custom_vmap_identity_matches_plain_jax(jit):
    interpret = reinterpret(twice_sin, counting())
    interpret = jax.jit(interpret) if jit else interpret
    out, ctx = interpret(0, X)
    assert_same(out, jax.jit(twice_sin)(X) if jit else twice_sin(X))
    assert int(ctx) == 1


def test_custom_vmap_untouched_matches_plain_jax():
    out, ctx = jax.jit(reinterpret(twice_sin, Interpreter(default_dispatcher())))(0, X)
    assert_same(out, jax.jit(twice_sin)(X))
    assert int(ctx) == 0


def test_custom_vmap_rule_is_used_under_vmap_after_interpretation():
    interpret = reinterpret(twice_sin, counting())
    out, ctx = jax.vmap(lambda x: interpret(0, x))(XS)
    np.testing.assert_array_equal(out, np.full((2, 3), 7.0))
    assert_same(out, jax.vmap(twice_sin)(XS))
    np.testing.assert_array_equal(ctx, [1, 1])
    out, ctx = jax.jit(jax.vmap(lambda c, x: interpret(c, x)))(jnp.array([5, 6]), XS)
    np.testing.assert_array_equal(out, np.full((2, 3), 7.0))
    np.testing.assert_array_equal(ctx, [6, 7])


def test_custom_vmap_sow_in_the_function_is_reaped():
    out, reaped = reap(sown, tag="t")(X)
    np.testing.assert_allclose(reaped["s"], np.sin(X), rtol=1e-6)
    assert_same(out, sown(X))
    out, reaped = jax.jit(jax.vmap(reap(sown, tag="t")))(XS)
    np.testing.assert_array_equal(out, np.full((2, 3), 7.0))
    np.testing.assert_allclose(reaped["s"], np.sin(XS), rtol=1e-6)


def test_custom_vmap_rule_is_used_under_vmap_of_the_interpreter_inside():
    # vmap applied inside the interpreted function: JAX applied the rule before
    # kups saw the program.
    out, ctx = reinterpret(jax.vmap(twice_sin), counting())(0, XS)
    np.testing.assert_array_equal(out, np.full((2, 3), 7.0))
    assert int(ctx) == 0


def test_custom_vmap_jvp_matches_plain_jax():
    interpret = reinterpret(twice_sin, counting())
    tangent = jnp.array([1.0, 2.0, 3.0])
    (out, ctx), (out_dot, _) = jax.jvp(lambda x: interpret(0, x), (X,), (tangent,))
    want, want_dot = jax.jvp(twice_sin, (X,), (tangent,))
    assert_same((out, out_dot), (want, want_dot))
    assert int(ctx) == 1


def test_custom_vmap_with_several_arguments_and_an_unbatched_one():
    @custom_batching.custom_vmap
    def scaled(x, k):
        return jnp.sin(x) * k

    @scaled.def_vmap
    def _rule(axis_size, in_batched, xs, k):
        assert in_batched == [True, False]
        return xs + 100.0 * k, True

    interpret = reinterpret(scaled, counting())
    out, ctx = interpret(0, X, 3.0)
    assert_same(out, scaled(X, 3.0))
    out, ctx = jax.vmap(lambda x: interpret(0, x, 3.0))(XS)
    np.testing.assert_array_equal(out, XS + 300.0)
    np.testing.assert_array_equal(ctx, [1, 1])


# ---------------------------------------------------------------- remat_opt


@jax.custom_vjp
def remat_sin(x):
    return jnp.sin(x)


def _remat_sin_fwd(x):
    return remat_sin(x), jnp.cos(x)


def _remat_sin_bwd(cos_x, g):
    return (-3.0 * g * cos_x,)  # not cos(x) * g


remat_sin.defvjp(_remat_sin_fwd, _remat_sin_bwd, optimize_remat=True)


def loss(x):
    return jnp.sum(remat_sin(x))


def test_optimize_remat_stages_remat_opt():
    names = [e.primitive.name for e in jax.make_jaxpr(jax.grad(loss))(X).eqns]
    assert "remat_opt" in names


@pytest.mark.parametrize("jit", [False, True])
def test_remat_opt_identity_matches_plain_jax_and_uses_the_rules(jit):
    grad = jax.grad(loss)
    interpret = reinterpret(grad, counting())
    interpret = jax.jit(interpret) if jit else interpret
    out, ctx = interpret(0, X)
    assert_same(out, jax.jit(grad)(X) if jit else grad(X))
    np.testing.assert_allclose(out, -3.0 * np.cos(X), rtol=1e-6)
    assert int(ctx) == 1  # the forward rule's sin


def test_remat_opt_untouched_matches_plain_jax():
    grad = jax.grad(loss)
    out, ctx = jax.jit(reinterpret(grad, Interpreter(default_dispatcher())))(0, X)
    assert_same(out, jax.jit(grad)(X))
    assert int(ctx) == 0


def test_remat_opt_under_vmap_after_interpretation():
    interpret = reinterpret(jax.grad(loss), counting())
    out, ctx = jax.vmap(lambda x: interpret(0, x))(XS)
    assert_same(out, jax.vmap(jax.grad(loss))(XS))
    np.testing.assert_array_equal(ctx, [1, 1])


def test_remat_opt_value_and_grad_and_a_sow_in_the_forward_rule():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(sow(x, tag="t", name="fwd_in")), jnp.cos(x)

    f.defvjp(fwd, lambda c, g: (-3.0 * g * c,), optimize_remat=True)
    value_and_grad = jax.value_and_grad(lambda x: jnp.sum(f(x)))
    (value, grad), reaped = jax.jit(reap(value_and_grad, tag="t"))(X)
    assert_same((value, grad), value_and_grad(X))
    np.testing.assert_allclose(grad, -3.0 * np.cos(X), rtol=1e-6)
    np.testing.assert_array_equal(reaped["fwd_in"], X)


def test_remat_opt_primal_function_stands_in_when_residuals_are_unused():
    # Only the primal output of the vjp is used: when `jit` removes dead code, JAX
    # runs the primal function instead of the forward rule (no `cos`). Both are
    # interpreted, so the count is the same whichever runs.
    def primal_only(x):
        out, _ = jax.vjp(remat_sin, x)
        return jnp.sum(out)

    interpret = jax.jit(reinterpret(primal_only, counting()))
    out, ctx = interpret(0, X)
    assert_same(out, jax.jit(primal_only)(X))
    assert int(ctx) == 1
    assert "cosine" not in interpret.lower(0, X).as_text()
    assert "cosine" in jax.jit(reinterpret(jax.grad(loss), counting())).lower(0, X).as_text()


def test_remat_opt_forward_rule_context_when_the_primal_function_differs():
    # The primal function sows and the forward rule does not: under
    # differentiation JAX runs the forward rule, so its context (nothing sown) is
    # the one that comes out, whether or not the residuals are used.
    @jax.custom_vjp
    def f(x):
        return jnp.sin(sow(x, tag="t", name="in_f"))

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (-3.0 * g * c,), optimize_remat=True)

    def primal_only(x):
        out, _ = jax.vjp(f, x)
        return jnp.sum(out)

    out, reaped = jax.jit(reap(primal_only, tag="t"))(X)
    assert_same(out, primal_only(X))
    assert reaped == {}
    grad, reaped = jax.jit(reap(jax.grad(lambda x: jnp.sum(f(x))), tag="t"))(X)
    np.testing.assert_allclose(grad, -3.0 * np.cos(X), rtol=1e-6)
    assert reaped == {}


# ---------------------------------------------------------------- custom_partitioning


@custom_partitioning
def partitioned_sin(x):
    return jnp.sin(x)


partitioned_sin.def_partition(
    partition=lambda mesh, args, result: (mesh, jnp.sin, result.sharding, (args[0].sharding,)),
    sharding_rule="i -> i",
)


def test_custom_partitioning_untouched_is_rebound_quietly():
    out, ctx = jax.jit(reinterpret(partitioned_sin, Interpreter(default_dispatcher())))(0, X)
    assert_same(out, jax.jit(partitioned_sin)(X))
    assert int(ctx) == 0
    out, reaped = jax.jit(reap(lambda x: sow(partitioned_sin(x), tag="t", name="y"), tag="t"))(X)
    assert_same(reaped["y"], out)


def test_custom_partitioning_with_something_touched_inside_goes_to_the_policy():
    with pytest.raises(NotImplementedError, match="custom_partitioning"):
        reinterpret(partitioned_sin, counting())(0, X)
    interpret = reinterpret(
        partitioned_sin,
        Interpreter(
            default_dispatcher().register_handler("sin", count_sin),
            policy=InterpreterPolicy.IGNORE,
        ),
    )
    out, ctx = interpret(0, X)
    assert_same(out, partitioned_sin(X))
    assert int(ctx) == 0  # its body was not interpreted
