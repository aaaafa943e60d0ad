"""`default_custom_linear_solve_handler`: handlers see the equations of the solve
(and of the `matvec` it calls), the solution and its implicit derivatives are
JAX's. Plain JAX is the oracle."""

import jax
import jax.numpy as jnp
import numpy as np

from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)

# ---------------------------------------------------------------- helpers


def count_div(interpreter, ctx, eqn, invals):
    """Counts `div` equations (the solver's steps)."""
    return HandlerResult(ctx + 1, [invals[0] / invals[1]])


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def interpreter_with(name=None, handler=None):
    dispatcher = default_dispatcher()
    if name is not None:
        dispatcher.register_handler(name, handler)
    return Interpreter(dispatcher)


A = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])
B = jnp.array([1.0, 2.0, 3.0])


def jacobi(a, b, steps=3):
    """A few Jacobi steps: an inexact solver, so differentiating its iterations
    would not give the implicit derivative."""
    diag = jnp.diag(a)

    def solve(matvec, rhs):
        x = rhs / diag
        for _ in range(steps - 1):
            x = x + (rhs - matvec(x)) / diag
        return x

    return solve


def linear_solve(a, b, steps=3):
    return jax.lax.custom_linear_solve(
        lambda x: a @ x,
        b,
        solve=jacobi(a, b, steps),
        transpose_solve=jacobi(a.T, b, steps),
    )


def exact_solve(a, b):
    return jax.lax.custom_linear_solve(
        lambda x: a @ x,
        b,
        solve=lambda mv, rhs: jnp.linalg.solve(a, rhs),
        transpose_solve=lambda vm, rhs: jnp.linalg.solve(a.T, rhs),
    )


# ---------------------------------------------------------------- tests


def test_identity_matches_plain_jax():
    interpret = reinterpret(linear_solve, interpreter_with())
    out, ctx = interpret({"c": jnp.ones(2)}, A, B)
    np.testing.assert_array_equal(out, linear_solve(A, B))
    np.testing.assert_array_equal(ctx["c"], jnp.ones(2))
    out, _ = jax.jit(interpret)({"c": jnp.ones(2)}, A, B)
    np.testing.assert_allclose(out, linear_solve(A, B), rtol=1e-6)


def test_exact_solve_value():
    out, _ = reinterpret(exact_solve, interpreter_with())((), A, B)
    np.testing.assert_allclose(A @ out, B, rtol=1e-5)


def test_grad_is_implicit_like_plain_jax():
    interpret = reinterpret(linear_solve, interpreter_with("div", count_div))

    def loss(a, b):
        out, ctx = interpret(jnp.int32(0), a, b)
        return jnp.sum(out**2), ctx

    def plain_loss(a, b):
        return jnp.sum(linear_solve(a, b) ** 2)

    (grad_a, grad_b), ctx = jax.grad(loss, argnums=(0, 1), has_aux=True)(A, B)
    want_a, want_b = jax.grad(plain_loss, argnums=(0, 1))(A, B)
    np.testing.assert_allclose(grad_a, want_a, rtol=1e-5)
    np.testing.assert_allclose(grad_b, want_b, rtol=1e-5)
    assert int(ctx) == 3

    # The implicit derivative is not the derivative of the solver's iterations.
    def unrolled(a, b):
        return jnp.sum(jacobi(a, b)(lambda x: a @ x, b) ** 2)

    assert not np.allclose(jax.grad(unrolled)(A, B), want_a, rtol=1e-3)

    jit_grad, jit_ctx = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(A, B)
    np.testing.assert_allclose(jit_grad[0], want_a, rtol=1e-5)
    assert int(jit_ctx) == 3


def test_jvp_like_plain_jax():
    interpret = reinterpret(linear_solve, interpreter_with("div", count_div))
    tangent = jnp.array([0.5, -1.0, 2.0])
    out, out_dot = jax.jvp(lambda b: interpret(jnp.int32(0), A, b)[0], (B,), (tangent,))
    want, want_dot = jax.jvp(lambda b: linear_solve(A, b), (B,), (tangent,))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(out_dot, want_dot, rtol=1e-5)


def test_counting_sees_the_solve_and_its_matvec():
    # Three Jacobi steps: one division each; the matvec called inside the solve
    # (a dot product) is seen too.
    out, ctx = reinterpret(linear_solve, interpreter_with("div", count_div))(jnp.int32(0), A, B)
    assert int(ctx) == 3
    np.testing.assert_allclose(out, linear_solve(A, B), rtol=1e-6)

    def count_dot(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx + 1, [eqn.primitive.bind(*invals, **eqn.params)])

    _, dots = reinterpret(linear_solve, interpreter_with("dot_general", count_dot))(0, A, B)
    assert int(dots) == 2  # the matvec in steps 2 and 3


def test_counting_with_sin_in_solve_under_jit():
    def solve_with_sin(b):
        return jax.lax.custom_linear_solve(
            lambda x: 2.0 * x,
            b,
            solve=lambda mv, rhs: jnp.sin(rhs) * 0 + rhs / 2.0,
            symmetric=True,
        )

    interpret = jax.jit(reinterpret(solve_with_sin, interpreter_with("sin", count_sin)))
    out, ctx = interpret(jnp.int32(4), B)
    assert int(ctx) == 5
    np.testing.assert_allclose(out, B / 2.0)
    grad = jax.grad(lambda b: jnp.sum(interpret(jnp.int32(0), b)[0]))(B)
    np.testing.assert_allclose(grad, jax.grad(lambda b: jnp.sum(solve_with_sin(b)))(B))


def test_under_vmap():
    interpret = reinterpret(linear_solve, interpreter_with("div", count_div))
    bs = jnp.stack([B, 2 * B, -B])
    out, ctx = jax.vmap(interpret, in_axes=(None, None, 0))(jnp.int32(0), A, bs)
    np.testing.assert_allclose(out, jax.vmap(linear_solve, in_axes=(None, 0))(A, bs), rtol=1e-6)
    np.testing.assert_array_equal(ctx, [3, 3, 3])


def test_handler_changing_values_does_not_change_solution():
    # Documented: the solution is JAX's; the interpreted solve only feeds the context.
    def double_div(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx + 1, [2 * invals[0] / invals[1]])

    out, ctx = reinterpret(linear_solve, interpreter_with("div", double_div))(0, A, B)
    np.testing.assert_allclose(out, linear_solve(A, B), rtol=1e-6)
    assert int(ctx) == 3


def test_second_order_through_a_touched_solve_is_plain_jax():
    # A JVP of a VJP through a solve a handler touches (here the LU solve inside
    # `jnp.linalg.solve`, a `custom_linear_solve`): the second derivative is JAX's.
    def f(y):
        return jnp.linalg.solve(A + jnp.diag(y**2), y)

    def count(interpreter, ctx, eqn, invals):
        return HandlerResult(
            ctx + 1, default_primitive_handler(interpreter, ctx, eqn, invals).outvals
        )

    interpret = reinterpret(f, Interpreter(default_dispatcher().register_fallback_handler(count)))
    y = jnp.array([0.3, -0.7, 1.1])

    def second(fn):
        return jax.jacfwd(jax.grad(lambda y: jnp.sum(fn(y) ** 3)))(y)

    np.testing.assert_allclose(
        second(lambda y: interpret(jnp.int32(0), y)[0]), second(f), rtol=1e-5, atol=1e-6
    )
