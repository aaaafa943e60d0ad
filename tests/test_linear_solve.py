"""`default_custom_linear_solve_handler`: handlers see the equations of the solve
(and of the `matvec` it calls), the solution and its implicit derivatives are
JAX's. Plain JAX is the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)
from kups.harvest import reap, sow

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
    np.testing.assert_array_equal(out, jax.jit(linear_solve)(A, B))


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


def test_a_handler_changing_values_inside_the_solve_changes_the_solution():
    # The solution is the interpreted solve's: a handler that doubles every
    # division gives what a solver written that way gives.
    def double_div(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx + 1, [2 * invals[0] / invals[1]])

    def doubled(a, b, steps=3):
        diag = jnp.diag(a)

        def solve(matvec, rhs):
            x = 2 * rhs / diag
            for _ in range(steps - 1):
                x = x + 2 * (rhs - matvec(x)) / diag
            return x

        return jax.lax.custom_linear_solve(lambda x: a @ x, b, solve=solve)

    out, ctx = reinterpret(linear_solve, interpreter_with("div", double_div))(0, A, B)
    np.testing.assert_array_equal(out, doubled(A, B))
    assert not np.allclose(out, linear_solve(A, B))
    assert int(ctx) == 3


# A handler that touches the solve but changes nothing: the interpretation must
# be plain JAX, bit for bit.
def count_div_exactly(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jax.lax.div(*invals)])


def counting(f):
    return reinterpret(f, interpreter_with("div", count_div_exactly))


@pytest.mark.parametrize("where", ["solve", "matvec"])
def test_an_ordered_callback_in_a_touched_solve_runs_once(where):
    calls = []

    def note(v):
        jax.debug.callback(lambda v: calls.append(np.asarray(v)), v, ordered=True)

    def matvec(x):
        if where == "matvec":
            note(x)
        return A @ x

    def solve(matvec, rhs):
        if where == "solve":
            note(rhs)
        return matvec(rhs / jnp.diag(A)) / jnp.diag(A)

    def f(b):
        return jax.lax.custom_linear_solve(matvec, b, solve=solve)

    # Eagerly and under jit: plain JAX runs the callback once, and so does kups
    # with the two divisions of the solve counted.
    for plain, interpreted in ((f, counting(f)), (jax.jit(f), jax.jit(counting(f)))):
        calls.clear()
        want = plain(B)
        jax.effects_barrier()
        assert len(calls) == 1
        calls.clear()
        out, ctx = interpreted(jnp.int32(0), B)
        jax.effects_barrier()
        assert int(ctx) == 2
        assert len(calls) == 1
        np.testing.assert_array_equal(out, want)

    # Differentiated, JAX solves the tangent with the same solve: twice, in
    # plain JAX and in kups.
    counts = []
    for fn in (f, lambda b: counting(f)(jnp.int32(0), b)[0]):
        calls.clear()
        jax.jvp(fn, (B,), (B,))
        jax.effects_barrier()
        counts.append(len(calls))
    assert counts == [2, 2]


def test_touched_solve_is_plain_jax_bit_for_bit():
    interpret = counting(linear_solve)

    def loss(a, b):
        return jnp.sum(interpret(jnp.int32(0), a, b)[0] ** 2)

    def plain_loss(a, b):
        return jnp.sum(linear_solve(a, b) ** 2)

    np.testing.assert_array_equal(interpret(jnp.int32(0), A, B)[0], linear_solve(A, B))
    for transform in (lambda g: g, jax.jit):
        got = transform(jax.grad(loss, argnums=(0, 1)))(A, B)
        want = transform(jax.grad(plain_loss, argnums=(0, 1)))(A, B)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    bs = jnp.stack([B, 2 * B, -B])
    got = jax.vmap(interpret, in_axes=(None, None, 0))(jnp.int32(0), A, bs)[0]
    np.testing.assert_array_equal(got, jax.vmap(linear_solve, in_axes=(None, 0))(A, bs))


def test_jvp_in_each_input_is_plain_jax_bit_for_bit():
    # Tangents in the matrix only, in the right-hand side only, and in both: the
    # implicit rule differentiates `matvec` in its perturbed constants only.
    interpret = counting(linear_solve)
    da = jnp.array([[0.1, -0.2, 0.0], [0.3, 0.0, 0.1], [0.0, 0.2, -0.4]])
    db = jnp.array([0.5, -1.0, 2.0])
    cases = [
        (lambda a: interpret(jnp.int32(0), a, B)[0], lambda a: linear_solve(a, B), (A,), (da,)),
        (lambda b: interpret(jnp.int32(0), A, b)[0], lambda b: linear_solve(A, b), (B,), (db,)),
        (
            lambda a, b: interpret(jnp.int32(0), a, b)[0],
            linear_solve,
            (A, B),
            (da, db),
        ),
    ]
    for f, plain, primals, tangents in cases:
        out, out_dot = jax.jvp(f, primals, tangents)
        want, want_dot = jax.jvp(plain, primals, tangents)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(out_dot, want_dot)


def test_aux_outputs_of_the_solve():
    def solve(matvec, rhs):
        x = rhs / jnp.diag(A)
        return x, jnp.sum(x)

    def f(b):
        return jax.lax.custom_linear_solve(
            lambda x: A @ x, b, solve=solve, transpose_solve=solve, has_aux=True
        )

    (x, aux), ctx = counting(f)(jnp.int32(0), B)
    want_x, want_aux = f(B)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(aux, want_aux)
    assert int(ctx) == 1
    grad = jax.grad(lambda b: jnp.sum(counting(f)(jnp.int32(0), b)[0][0] ** 2))(B)
    np.testing.assert_array_equal(grad, jax.grad(lambda b: jnp.sum(f(b)[0] ** 2))(B))


def test_second_order_through_a_touched_solve_is_plain_jax():
    # A JVP of a VJP, and a Hessian, through a solve a handler touches (the LU
    # solve inside `jnp.linalg.solve`, whose LU factors are taken under
    # `stop_gradient`): differentiating the solver's own operations would see no
    # dependence on the matrix; JAX's rule for the primitive does.
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
    # Reverse over reverse too.
    np.testing.assert_allclose(
        jax.hessian(lambda y: jnp.sum(interpret(jnp.int32(0), y)[0] ** 3))(y),
        jax.hessian(lambda y: jnp.sum(f(y) ** 3))(y),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_touched_solve_inside_a_derivative_rule():
    # The interpreted solve runs on tangents inside a `custom_jvp` rule, so JAX
    # makes it part of a linear function and transposes it (reverse mode), then
    # differentiates that again (a Hessian): it must stay JAX's primitive, with
    # its transpose and implicit derivatives, not become the solver's operations.
    def solve(m, v):
        return jnp.linalg.solve(m, v)

    interpret = reinterpret(solve, interpreter_with("div", count_div_exactly))

    def through(s):
        @jax.custom_jvp
        def g(y):
            return jnp.sin(y)

        @g.defjvp
        def _(primals, tangents):
            (y,), (t,) = primals, tangents
            return g(y), s(A + jnp.diag(y**2), t)

        return lambda y: jnp.sum(g(y) ** 2)

    y = jnp.array([0.3, -0.7, 1.1])
    kups = through(lambda m, v: interpret(jnp.int32(0), m, v)[0])
    np.testing.assert_allclose(
        jax.hessian(kups)(y), jax.hessian(through(solve))(y), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_array_equal(jax.grad(kups)(y), jax.grad(through(solve))(y))


def test_a_sow_inside_the_solve_is_reaped():
    # The context gains a leaf inside the solve: it leaves the primitive as an
    # auxiliary output, under jit, vmap and grad, and the solution stays JAX's.
    def solve(matvec, rhs):
        x = rhs / jnp.diag(A)
        for _ in range(3):
            x = x + (rhs - matvec(x)) / jnp.diag(A)
        sow(x, tag="t", name="x")
        return x

    def f(b):
        return jax.lax.custom_linear_solve(
            lambda x: A @ x, b, solve=solve, transpose_solve=solve, symmetric=True
        )

    reaping = reap(f, tag="t")
    for transform in (lambda g: g, jax.jit):
        out, reaped = transform(reaping)(B)
        np.testing.assert_array_equal(out, f(B))
        np.testing.assert_array_equal(reaped["x"], f(B))
    bs = jnp.stack([B, 2 * B])
    out, reaped = jax.vmap(reaping)(bs)
    np.testing.assert_array_equal(out, jax.vmap(f)(bs))
    np.testing.assert_array_equal(reaped["x"], out)
    np.testing.assert_array_equal(
        jax.grad(lambda b: jnp.sum(reaping(b)[0] ** 2))(B),
        jax.grad(lambda b: jnp.sum(f(b) ** 2))(B),
    )
