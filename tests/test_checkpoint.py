"""`default_checkpoint_handler`: the body is interpreted inside a checkpoint that
keeps the user's `policy` and `prevent_cse`, so the rematerialisation boundary
stays. Plain JAX is the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, jaxprs_in_params

from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)

# ---------------------------------------------------------------- helpers


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def record_sin(interpreter, ctx, eqn, invals):
    (x,) = invals
    return HandlerResult(dict(ctx, seen=ctx["seen"] + jnp.sum(x)), [jnp.sin(x)])


def interpreter_with(handler=None):
    dispatcher = default_dispatcher()
    if handler is not None:
        dispatcher.register_handler("sin", handler)
    return Interpreter(dispatcher)


def eqns_named(jaxpr, name):
    """Every equation of primitive `name` in `jaxpr` and its sub-jaxprs."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            found.extend(eqns_named(sub, name))
    return found


def body(x):
    return jnp.sin(jnp.sin(x)) @ x


X = jnp.arange(9.0).reshape(3, 3) / 10


POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# ---------------------------------------------------------------- the boundary


@pytest.mark.parametrize("prevent_cse", [True, False])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_and_prevent_cse_kept(policy, prevent_cse):
    f = jax.checkpoint(body, policy=POLICIES[policy], prevent_cse=prevent_cse)
    closed = jax.make_jaxpr(reinterpret(f, interpreter_with(count_sin)))(jnp.int32(0), X)
    (eqn,) = eqns_named(closed, "remat2")
    assert eqn.params["policy"] is POLICIES[policy]
    assert eqn.params["prevent_cse"] is prevent_cse
    assert eqn.params["differentiated"] is False
    # The interpreted body (with the context) is inside the boundary.
    inner = eqn.params["jaxpr"]
    assert len(eqns_named(inner, "sin")) == 2
    assert len(eqns_named(inner, "add")) == 2  # the two counts


def test_default_checkpoint_params_kept():
    f = jax.checkpoint(body)
    plain = eqns_named(jax.make_jaxpr(f)(X), "remat2")[0]
    (eqn,) = eqns_named(jax.make_jaxpr(reinterpret(f, interpreter_with()))((), X), "remat2")
    assert eqn.params["policy"] is plain.params["policy"]
    assert eqn.params["prevent_cse"] is plain.params["prevent_cse"]


@pytest.mark.parametrize("policy", ["nothing_saveable", "everything_saveable"])
def test_grad_rematerialises_like_plain_jax(policy):
    f = jax.checkpoint(body, policy=POLICIES[policy])
    interpret = reinterpret(f, interpreter_with(count_sin))

    def plain_loss(x):
        return jnp.sum(f(x))

    def loss(x):
        return jnp.sum(interpret(jnp.int32(0), x)[0])

    plain = jax.make_jaxpr(jax.grad(plain_loss))(X)
    interpreted = jax.make_jaxpr(jax.grad(loss))(X)
    # The backward pass recomputes (or saves) exactly what plain JAX does: a lost
    # boundary would save the sin outputs and recompute nothing.
    assert len(eqns_named(interpreted, "sin")) == len(eqns_named(plain, "sin"))
    assert len(eqns_named(interpreted, "remat2")) == len(eqns_named(plain, "remat2"))


def test_policies_differ_so_the_check_above_means_something():
    def sins_in_grad(policy):
        f = jax.checkpoint(body, policy=POLICIES[policy])
        interpret = reinterpret(f, interpreter_with(count_sin))
        closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(interpret(jnp.int32(0), x)[0])))(X)
        return len(eqns_named(closed, "sin"))

    assert sins_in_grad("nothing_saveable") > sins_in_grad("everything_saveable")


# ---------------------------------------------------------------- values


def test_grad_matches_plain_jax():
    f = jax.checkpoint(body, policy=POLICIES["nothing_saveable"])
    interpret = reinterpret(f, interpreter_with(count_sin))

    def loss(x):
        out, ctx = interpret(jnp.int32(0), x)
        return jnp.sum(out**2), ctx

    grad, ctx = jax.grad(loss, has_aux=True)(X)
    want = jax.grad(lambda x: jnp.sum(body(x) ** 2))(X)
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    assert int(ctx) == 2
    jit_grad, jit_ctx = jax.jit(jax.grad(loss, has_aux=True))(X)
    np.testing.assert_allclose(jit_grad, want, rtol=1e-5)
    assert int(jit_ctx) == 2


def test_ctx_updated_inside_checkpoint_comes_out():
    f = jax.checkpoint(body)
    interpret = reinterpret(f, interpreter_with(record_sin))
    ctx = {"seen": jnp.float32(1.0), "tag": "kept"}
    out, new_ctx = interpret(ctx, X)
    expected = 1.0 + float(jnp.sum(X)) + float(jnp.sum(jnp.sin(X)))
    np.testing.assert_allclose(new_ctx["seen"], expected, rtol=1e-6)
    assert new_ctx["tag"] == "kept"
    np.testing.assert_allclose(out, body(X), rtol=1e-6)
    _, jit_ctx = jax.jit(interpret)({"seen": jnp.float32(1.0)}, X)
    np.testing.assert_allclose(jit_ctx["seen"], expected, rtol=1e-6)


def test_identity_matches_plain_jax():
    f = jax.checkpoint(body, prevent_cse=False)
    interpret = reinterpret(f, interpreter_with())
    out, ctx = interpret({"a": jnp.ones(2)}, X)
    np.testing.assert_array_equal(out, f(X))
    np.testing.assert_array_equal(ctx["a"], jnp.ones(2))
    out, _ = jax.vmap(interpret, in_axes=(None, 0))({"a": jnp.ones(2)}, jnp.stack([X, 2 * X]))
    np.testing.assert_allclose(out, jax.vmap(f)(jnp.stack([X, 2 * X])), rtol=1e-6)


def test_checkpoint_in_scan_under_grad():
    step = jax.checkpoint(lambda c, x: (jnp.sin(c) * x, None))

    def f(x):
        return jax.lax.scan(step, x, jnp.arange(1.0, 5.0))[0]

    interpret = reinterpret(f, interpreter_with(count_sin))

    def loss(x):
        out, ctx = interpret(jnp.int32(0), x)
        return out, ctx

    grad, ctx = jax.grad(loss, has_aux=True)(0.3)
    np.testing.assert_allclose(grad, jax.grad(f)(0.3), rtol=1e-5)
    assert int(ctx) == 4


def test_nested_checkpoints():
    inner = jax.checkpoint(jnp.sin, prevent_cse=False)
    f = jax.checkpoint(lambda x: inner(inner(x)) * 2)
    interpret = reinterpret(f, interpreter_with(count_sin))
    closed = jax.make_jaxpr(interpret)(jnp.int32(0), jnp.float32(0.4))
    outer_eqn = eqns_named(closed, "remat2")[0]
    nested = eqns_named(outer_eqn.params["jaxpr"], "remat2")
    assert [e.params["prevent_cse"] for e in nested] == [False, False]
    out, ctx = interpret(jnp.int32(0), jnp.float32(0.4))
    assert int(ctx) == 2
    np.testing.assert_allclose(out, f(0.4), rtol=1e-6)
    grad = jax.grad(lambda x: interpret(jnp.int32(0), x)[0])(0.4)
    np.testing.assert_allclose(grad, jax.grad(f)(0.4), rtol=1e-6)


def test_per_input_prevent_cse_with_an_array_context():
    # `prevent_cse` may be one flag per input; the context and the body's consts
    # are inputs too, so the flags must grow with them (JAX checks the length).
    def f(a, b):
        return jax.checkpoint(lambda u, v: jnp.sin(u) * v, prevent_cse=(False, True))(a, b)

    def count_sin(interpreter, ctx, eqn, invals):
        outvals = default_primitive_handler(interpreter, ctx, eqn, invals).outvals
        return HandlerResult(ctx + 1.0, outvals)

    interpreted = reinterpret(
        f, Interpreter(default_dispatcher().register_handler("sin", count_sin))
    )
    (out, ctx) = interpreted(jnp.float32(0.0), 1.5, 2.0)
    assert out == f(1.5, 2.0) and float(ctx) == 1.0
    grads = jax.grad(lambda a, b: interpreted(jnp.float32(0.0), a, b)[0], argnums=(0, 1))(1.5, 2.0)
    assert grads == jax.grad(f, argnums=(0, 1))(1.5, 2.0)
    closed = jax.make_jaxpr(interpreted)(jnp.float32(0.0), 1.5, 2.0)
    (remat,) = [e for e in closed.eqns if e.primitive.name == "remat2"]
    assert remat.params["prevent_cse"][-2:] == (False, True)
