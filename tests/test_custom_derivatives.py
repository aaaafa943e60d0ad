"""`default_custom_jvp_handler` / `default_custom_vjp_handler`: the primal body is
interpreted with the context, and derivatives still come from the user's rules.
Every rule here differs from the true derivative, so a test fails if the rule is
bypassed (JAX differentiating the interpreted body instead)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kups.checks import checked, nan_checks
from kups.debug import find_nans, nan_sites
from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)
from kups.harvest import reap, sow
from kups.instrument import count_primitives

# ---------------------------------------------------------------- helpers


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def record_sin(interpreter, ctx, eqn, invals):
    (x,) = invals
    return HandlerResult(dict(ctx, seen=ctx["seen"] + jnp.sum(x)), [jnp.sin(x)])


def interpreter_with(handler=count_sin):
    return Interpreter(default_dispatcher().register_handler("sin", handler))


@jax.custom_jvp
def sin_jvp(x):
    return jnp.sin(x)


@sin_jvp.defjvp
def _sin_jvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    return sin_jvp(x), 10.0 * t  # not cos(x): the rule must be the one used


@jax.custom_vjp
def sin_vjp(x):
    return jnp.sin(x)


def _sin_vjp_fwd(x):
    return sin_vjp(x), x


def _sin_vjp_bwd(x, g):
    return (-3.0 * g,)  # not cos(x) * g


sin_vjp.defvjp(_sin_vjp_fwd, _sin_vjp_bwd)

X = jnp.array([0.1, 0.5, 2.0])


# ---------------------------------------------------------------- custom_jvp


def test_custom_jvp_primal_is_interpreted():
    f = lambda x: sin_jvp(x) * 2  # noqa: E731
    out, ctx = reinterpret(f, interpreter_with())(jnp.int32(0), X)
    assert int(ctx) == 1
    np.testing.assert_allclose(out, 2 * np.sin(X), rtol=1e-6)


def test_custom_jvp_grad_uses_rule():
    interpret = reinterpret(sin_jvp, interpreter_with())

    def loss(x):
        out, ctx = interpret(jnp.int32(0), x)
        return jnp.sum(out), ctx

    grad, ctx = jax.grad(loss, has_aux=True)(X)
    np.testing.assert_allclose(grad, 10.0 * np.ones(3))
    assert int(ctx) == 1
    np.testing.assert_allclose(jax.jit(jax.grad(loss, has_aux=True))(X)[0], 10.0 * np.ones(3))


def test_custom_jvp_jvp_uses_rule():
    interpret = reinterpret(sin_jvp, interpreter_with())
    tangent = jnp.array([1.0, 2.0, 3.0])
    (out, ctx), (out_dot, ctx_dot) = jax.jvp(lambda x: interpret(jnp.int32(0), x), (X,), (tangent,))
    np.testing.assert_allclose(out, np.sin(X), rtol=1e-6)
    np.testing.assert_allclose(out_dot, 10.0 * tangent)
    assert int(ctx) == 1
    assert ctx_dot.dtype == jax.dtypes.float0


def test_custom_jvp_second_order_uses_rule():
    interpret = reinterpret(sin_jvp, interpreter_with())
    first = jax.grad(lambda x: interpret(jnp.int32(0), x)[0])
    np.testing.assert_allclose(first(0.3), 10.0)
    np.testing.assert_allclose(jax.grad(first)(0.3), 0.0)


def test_custom_jvp_library_rule_relu():
    # relu's custom rule gives 0 at 0; differentiating max(x, 0) would give 0.5.
    out_grad = jax.grad(lambda x: reinterpret(jax.nn.relu, interpreter_with())(0, x)[0])(0.0)
    assert float(out_grad) == float(jax.grad(jax.nn.relu)(0.0)) == 0.0
    assert float(jax.grad(lambda x: jnp.maximum(x, 0.0))(0.0)) == 0.5


def test_custom_jvp_nondiff_argnums_static():
    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def scaled(n, x):
        return jnp.sin(x) * n

    @scaled.defjvp
    def _rule(n, primals, tangents):
        return scaled(n, primals[0]), 100.0 * n * tangents[0]

    interpret = reinterpret(lambda x: scaled(3, x), interpreter_with())
    out, ctx = interpret(jnp.int32(0), X)
    np.testing.assert_allclose(out, 3 * np.sin(X), rtol=1e-6)
    assert int(ctx) == 1
    grad = jax.grad(lambda x: jnp.sum(interpret(jnp.int32(0), x)[0]))(X)
    np.testing.assert_allclose(grad, 300.0 * np.ones(3))


def test_custom_jvp_nondiff_argnums_callable():
    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def apply(fn, x):
        return fn(x)

    @apply.defjvp
    def _rule(fn, primals, tangents):
        return apply(fn, primals[0]), 7.0 * tangents[0]

    interpret = reinterpret(lambda x: apply(jnp.sin, x), interpreter_with())
    out, ctx = interpret(jnp.int32(0), X)
    assert int(ctx) == 1
    np.testing.assert_allclose(out, np.sin(X), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(interpret(jnp.int32(0), x)[0]))(X)
    np.testing.assert_allclose(grad, 7.0 * np.ones(3))


def test_custom_jvp_under_vmap():
    interpret = reinterpret(sin_jvp, interpreter_with())
    xs = jnp.stack([X, X + 1])
    out, ctx = jax.vmap(interpret, in_axes=(None, 0))(jnp.int32(0), xs)
    np.testing.assert_allclose(out, np.sin(xs), rtol=1e-6)
    np.testing.assert_array_equal(ctx, [1, 1])
    grads = jax.vmap(jax.grad(lambda x: jnp.sum(interpret(jnp.int32(0), x)[0])))(xs)
    np.testing.assert_allclose(grads, 10.0 * np.ones((2, 3)))


def test_custom_jvp_float_ctx_and_multiple_outputs():
    @jax.custom_jvp
    def two(x, y):
        return jnp.sin(x) * y, jnp.sin(y)

    @two.defjvp
    def _rule(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        return two(x, y), (2.0 * tx + 5.0 * ty, -ty)

    interpret = reinterpret(two, interpreter_with(record_sin))
    ctx = {"seen": jnp.float32(0.0)}
    (a, b), new_ctx = interpret(ctx, jnp.float32(0.5), jnp.float32(1.5))
    np.testing.assert_allclose(new_ctx["seen"], 2.0)
    np.testing.assert_allclose([a, b], [np.sin(0.5) * 1.5, np.sin(1.5)], rtol=1e-6)
    _, (da, db) = jax.jvp(
        lambda x, y: interpret(ctx, x, y)[0], (jnp.float32(0.5), jnp.float32(1.5)), (1.0, 1.0)
    )
    np.testing.assert_allclose([da, db], [7.0, -1.0])


def test_custom_jvp_inside_jit_and_scan():
    @jax.jit
    def f(x):
        return jax.lax.scan(lambda c, _: (sin_jvp(c), None), x, None, length=3)[0]

    interpret = reinterpret(f, interpreter_with())
    out, ctx = interpret(jnp.int32(0), jnp.float32(0.4))
    assert int(ctx) == 3
    np.testing.assert_allclose(out, f(0.4), rtol=1e-6)
    grad = jax.grad(lambda x: interpret(jnp.int32(0), x)[0])(0.4)
    np.testing.assert_allclose(grad, 1000.0, rtol=1e-6)


# ---------------------------------------------------------------- custom_vjp


def test_custom_vjp_primal_is_interpreted():
    out, ctx = reinterpret(lambda x: sin_vjp(x) + 1, interpreter_with())(jnp.int32(0), X)
    assert int(ctx) == 1
    np.testing.assert_allclose(out, np.sin(X) + 1, rtol=1e-6)


def test_custom_vjp_grad_uses_rule():
    interpret = reinterpret(sin_vjp, interpreter_with())

    def loss(x):
        out, ctx = interpret(jnp.int32(0), x)
        return jnp.sum(out), ctx

    grad, ctx = jax.grad(loss, has_aux=True)(X)
    np.testing.assert_allclose(grad, -3.0 * np.ones(3))
    assert int(ctx) == 1
    jit_grad, jit_ctx = jax.jit(jax.grad(loss, has_aux=True))(X)
    np.testing.assert_allclose(jit_grad, -3.0 * np.ones(3))
    assert int(jit_ctx) == 1


def test_custom_vjp_vjp_uses_rule():
    interpret = reinterpret(sin_vjp, interpreter_with())
    out, pullback = jax.vjp(lambda x: interpret(jnp.int32(0), x)[0], X)
    np.testing.assert_allclose(out, np.sin(X), rtol=1e-6)
    (cotangent,) = pullback(jnp.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(cotangent, [-3.0, -6.0, -9.0])


def test_custom_vjp_residuals_from_fwd():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return f(x), (x * 2, jnp.cos(x))

    def bwd(res, g):
        doubled, _ = res
        return (doubled * g,)  # d/dx claims 2x

    f.defvjp(fwd, bwd)
    interpret = reinterpret(f, interpreter_with())
    grad = jax.grad(lambda x: interpret(jnp.int32(0), x)[0])(1.5)
    np.testing.assert_allclose(grad, 3.0)


def test_custom_vjp_nondiff_argnums():
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def scaled(n, x):
        return jnp.sin(x) * n

    def fwd(n, x):
        return scaled(n, x), None

    def bwd(n, res, g):
        return (100.0 * n * g,)

    scaled.defvjp(fwd, bwd)
    interpret = reinterpret(lambda x: scaled(2, x), interpreter_with())
    out, ctx = interpret(jnp.int32(0), X)
    assert int(ctx) == 1
    np.testing.assert_allclose(out, 2 * np.sin(X), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(interpret(jnp.int32(0), x)[0]))(X)
    np.testing.assert_allclose(grad, 200.0 * np.ones(3))


def test_custom_vjp_under_vmap():
    interpret = reinterpret(sin_vjp, interpreter_with())
    xs = jnp.stack([X, 2 * X])
    out, ctx = jax.vmap(interpret, in_axes=(None, 0))(jnp.int32(0), xs)
    np.testing.assert_allclose(out, np.sin(xs), rtol=1e-6)
    np.testing.assert_array_equal(ctx, [1, 1])
    grads = jax.vmap(jax.grad(lambda x: jnp.sum(interpret(jnp.int32(0), x)[0])))(xs)
    np.testing.assert_allclose(grads, -3.0 * np.ones((2, 3)))
    grads = jax.grad(lambda xs: jnp.sum(jax.vmap(interpret, in_axes=(None, 0))(0, xs)[0]))(xs)
    np.testing.assert_allclose(grads, -3.0 * np.ones((2, 3)))


def test_custom_vjp_with_float_ctx_under_grad():
    interpret = reinterpret(sin_vjp, interpreter_with(record_sin))

    def loss(x):
        out, ctx = interpret({"seen": jnp.float32(1.0)}, x)
        return jnp.sum(out), ctx

    grad, ctx = jax.grad(loss, has_aux=True)(X)
    np.testing.assert_allclose(grad, -3.0 * np.ones(3))
    np.testing.assert_allclose(ctx["seen"], 1.0 + float(jnp.sum(X)), rtol=1e-6)


def test_custom_vjp_inside_jit():
    f = jax.jit(lambda x: sin_vjp(sin_vjp(x)))
    interpret = reinterpret(f, interpreter_with())
    out, ctx = interpret(jnp.int32(0), jnp.float32(0.7))
    assert int(ctx) == 2
    np.testing.assert_allclose(out, f(0.7), rtol=1e-6)
    grad = jax.grad(lambda x: interpret(jnp.int32(0), x)[0])(0.7)
    np.testing.assert_allclose(grad, 9.0)


@pytest.mark.parametrize("kind", ["jvp", "vjp"])
def test_identity_matches_plain_jax(kind):
    f = sin_jvp if kind == "jvp" else sin_vjp
    interpret = reinterpret(f, Interpreter(default_dispatcher()))
    out, ctx = interpret({"k": jnp.ones(2)}, X)
    np.testing.assert_array_equal(out, f(X))
    np.testing.assert_array_equal(ctx["k"], jnp.ones(2))
    grad = jax.grad(lambda x: jnp.sum(interpret({"k": jnp.ones(2)}, x)[0]))(X)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(f(x)))(X))


# ------------------------------------------- perturbed inputs, dtypes and names


@jax.custom_vjp
def scale_vjp(x, k):
    return x * k


def _scale_fwd(x, k):
    # Only x is differentiated: a constant k is not perturbed, as in plain JAX.
    assert x.perturbed and not k.perturbed
    return x.value * k.value, k.value


scale_vjp.defvjp(_scale_fwd, lambda k, g: (g * k, None), symbolic_zeros=True)


def test_custom_vjp_symbolic_zeros_sees_constants_unperturbed():
    k = jnp.float32(3.0)
    f = lambda x: scale_vjp(x, k)  # noqa: E731
    interpret = reinterpret(f, Interpreter(default_dispatcher()))
    expected = jax.grad(f)(1.0)
    assert float(expected) == 3.0
    assert float(jax.grad(lambda x: interpret(0, x)[0])(1.0)) == 3.0
    assert float(jax.jit(jax.grad(lambda x: interpret(0, x)[0]))(1.0)) == 3.0
    # k perturbed too: the rule is asked for both.
    both = lambda x, k: scale_vjp(x, k)  # noqa: E731
    interpret_both = reinterpret(both, Interpreter(default_dispatcher()))
    with pytest.raises(AssertionError):
        jax.grad(lambda x, k: interpret_both(0, x, k)[0], argnums=(0, 1))(1.0, k)


@jax.custom_jvp
def scale_jvp(x, k):
    return x * k


@scale_jvp.defjvp
def _scale_jvp_rule(primals, tangents):
    (x, k), (tx, tk) = primals, tangents
    assert not isinstance(tx, jax.custom_derivatives.SymbolicZero)
    assert isinstance(tk, jax.custom_derivatives.SymbolicZero)  # k is a constant
    return x * k, 5.0 * tx  # not k * tx: the rule must be the one used


scale_jvp.defjvp(_scale_jvp_rule, symbolic_zeros=True)


def test_custom_jvp_symbolic_zeros_sees_constants_as_symbolic_zeros():
    k = jnp.float32(3.0)
    f = lambda x: scale_jvp(x, k)  # noqa: E731
    interpret = reinterpret(f, interpreter_with())
    assert float(jax.grad(f)(1.0)) == 5.0
    assert float(jax.grad(lambda x: interpret(jnp.int32(0), x)[0])(1.0)) == 5.0
    _, tangent = jax.jvp(lambda x: interpret(jnp.int32(0), x)[0], (1.0,), (2.0,))
    assert float(tangent) == 10.0


def test_equinox_filter_custom_vjp_with_a_closed_over_array():
    # equinox asserts that its non-differentiated arguments are not perturbed.
    eqx = pytest.importorskip("equinox")

    @eqx.filter_custom_vjp
    def apply(params, x):
        weight, _ = params
        return weight * jnp.sin(x)

    @apply.def_fwd
    def _fwd(perturbed, params, x):
        return apply(params, x), None

    @apply.def_bwd
    def _bwd(residuals, g, perturbed, params, x):
        weight, _ = params
        return (7.0 * weight * jnp.sum(g), None)  # not cos: the rule must be the one used

    offset = jnp.float32(0.5)
    f = lambda w: apply((w, offset), X)  # noqa: E731
    interpret = reinterpret(f, interpreter_with())
    expected = jax.grad(lambda w: jnp.sum(f(w)))(2.0)
    np.testing.assert_allclose(expected, 7.0 * 2.0 * X.size)
    got = jax.grad(lambda w: jnp.sum(interpret(jnp.int32(0), w)[0]))(2.0)
    np.testing.assert_allclose(got, expected)


_SCALE = jnp.array([1.0, 2.0, 0.5])


@jax.custom_vjp
def _log_scaled(x):
    return jnp.log(x * _SCALE)  # closes over a jnp array: a const of the equation


_log_scaled.defvjp(lambda x: (_log_scaled(x), x), lambda x, g: (3.0 * g / x,))


@pytest.mark.parametrize(
    "effect",
    [
        lambda f: find_nans(f),
        lambda f: find_nans(f, report="first"),
        lambda f: nan_sites(f),
        lambda f: checked(f, errors=nan_checks),
        lambda f: functools.partial(reinterpret(f, interpreter_with()), jnp.int32(0)),
    ],
    ids=["find_nans", "first", "nan_sites", "nan_checks", "identity"],
)
def test_a_custom_vjp_closing_over_an_array_is_differentiated_by_its_rule(effect):
    x = jnp.array([1.0, 2.0, 4.0])
    expected = jax.grad(lambda x: jnp.sum(_log_scaled(x)))(x)
    np.testing.assert_allclose(expected, 3.0 / x)  # the rule's, not log's
    interpreted = effect(lambda x: jnp.sum(_log_scaled(x)))
    got = jax.grad(lambda x: interpreted(x)[0])(x)
    np.testing.assert_array_equal(got, expected)


@jax.custom_vjp
def double_bf16(x):
    return x * 2


def _double_fwd(x):
    return double_bf16(x), None


def _double_bwd(_, g):
    return (g.astype(jnp.float32) * 3,)  # an f32 cotangent for a bf16 input


double_bf16.defvjp(_double_fwd, _double_bwd)


def test_custom_vjp_bwd_returning_another_float_dtype():
    def loss(x):
        return double_bf16(double_bf16(x)).astype(jnp.float32)

    x = jnp.bfloat16(1.5)
    expected = jax.grad(loss)(x)
    interpret = reinterpret(loss, Interpreter(default_dispatcher()))
    got = jax.grad(lambda x: interpret(0, x)[0])(x)
    assert float(expected) == 9.0
    assert float(got) == float(expected) and got.dtype == expected.dtype


def _call_jaxpr_source(eqn):
    call_jaxpr = eqn.params["call_jaxpr"]  # ClosedJaxpr on JAX 0.10, Jaxpr on 0.11+
    return getattr(call_jaxpr, "jaxpr", call_jaxpr).debug_info.func_src_info


def test_interpreted_equations_keep_the_user_names():
    interpret = reinterpret(lambda x: sin_vjp(sin_jvp(x)), interpreter_with())
    text = str(jax.make_jaxpr(lambda x: interpret(jnp.int32(0), x)[0])(X))
    for fragment in ["name=sin_jvp", "jvp=_sin_jvp_rule", "name=sin_vjp"]:
        assert fragment in text, text
    assert "fwd=_sin_vjp_fwd" in text and "bwd=_sin_vjp_bwd" in text, text
    assert "primal" not in text, text
    eqns = jax.make_jaxpr(lambda x: interpret(jnp.int32(0), x)[0])(X).eqns
    sources = [_call_jaxpr_source(e) for e in eqns if e.primitive.name.startswith("custom")]
    assert len(sources) == 2
    assert all("test_custom_derivatives.py" in source for source in sources), sources


# ---------------------------------------------------------------- second order
# A straight-through estimator: the primal rounds (its own derivative is zero),
# the rule passes the tangent through. A second derivative of a function of its
# output needs the output's derivative inside the rule, which must come from the
# rule again, as in plain JAX, not from the interpreted rounding.


@jax.custom_jvp
def round_jvp(x):
    return jnp.round(x)


@round_jvp.defjvp
def _round_jvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    return round_jvp(x), t


@jax.custom_vjp
def round_vjp(x):
    return jnp.round(x)


round_vjp.defvjp(lambda x: (round_vjp(x), None), lambda _, g: (g,))


def count_round(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.round(invals[0])])


@pytest.mark.parametrize("fn", [round_jvp, round_vjp], ids=["custom_jvp", "custom_vjp"])
def test_second_derivatives_of_a_function_of_the_output_are_plain_jax(fn):
    interpret = reinterpret(
        fn, Interpreter(default_dispatcher().register_handler("round", count_round))
    )

    def cube(f):
        return lambda x: f(x) ** 3

    def kups(x):
        return interpret(jnp.int32(0), x)[0]

    x = jnp.float32(1.3)
    expected = jax.grad(jax.grad(cube(fn)))(x)  # 6 * round(x) == 6
    assert expected == 6.0
    assert jax.grad(jax.grad(cube(kups)))(x) == expected
    if fn is round_jvp:
        assert jax.jacfwd(jax.jacfwd(cube(kups)))(x) == expected
        assert jax.jacfwd(jax.grad(cube(kups)))(x) == expected


# ------------------------------------- debug callbacks in a differentiated body

CALLS: list[str] = []


def logged(rule_calls_f):
    """A custom_jvp sin whose body logs "f" and whose rule either logs "rule" and
    calls the function, or calls neither."""

    @jax.custom_jvp
    def f(x):
        jax.debug.callback(lambda: CALLS.append("f"), ordered=True)
        return jnp.sin(x)

    @f.defjvp
    def rule(primals, tangents):
        (x,), (t,) = primals, tangents
        if not rule_calls_f:
            return jnp.sin(x), jnp.cos(x) * t
        jax.debug.callback(lambda: CALLS.append("rule"), ordered=True)
        return f(x), jnp.cos(x) * t

    return f


logged_jvp, logged_apart = logged(rule_calls_f=True), logged(rule_calls_f=False)


@jax.custom_vjp
def logged_vjp(x):
    jax.jit(lambda: jax.debug.callback(lambda: CALLS.append("f"), ordered=True))()
    return jnp.sin(x)


def _logged_vjp_fwd(x):
    return logged_vjp(x), x


logged_vjp.defvjp(_logged_vjp_fwd, lambda x, g: (jnp.cos(x) * g,))


def count_every(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, default_primitive_handler(interpreter, ctx, eqn, invals).outvals)


@pytest.mark.parametrize(
    "fn", [logged_jvp, logged_apart, logged_vjp], ids=["rule calls f", "rule apart", "custom_vjp"]
)
@pytest.mark.parametrize(
    "transform",
    [
        lambda g: g,
        jax.jit,
        lambda g: lambda x: jax.jvp(g, (x,), (1.0,)),
        lambda g: jax.jit(jax.grad(g)),
        lambda g: jax.jit(jax.value_and_grad(g)),
        lambda g: jax.grad(jax.grad(g)),
        lambda g: jax.jit(jax.hessian(g)),
    ],
    ids=["call", "jit", "jvp", "jit grad", "jit value_and_grad", "grad grad", "jit hessian"],
)
def test_debug_callbacks_in_the_body_run_as_in_plain_jax(fn, transform):
    """Differentiated, plain JAX runs the rule instead of the function: kups runs
    the interpreted body beside the rule (for the context), without its debug
    callbacks, so each callback runs as many times as in plain JAX, at any order."""
    counting = reinterpret(
        fn, Interpreter(default_dispatcher().register_fallback_handler(count_every))
    )

    def kups(x):
        return counting(jnp.int32(0), x)[0]

    def calls(g):
        CALLS.clear()
        try:
            jax.block_until_ready(transform(g)(jnp.float32(0.7)))
        except TypeError:  # jvp of a custom_vjp: refused by JAX, so by kups too
            return "TypeError"
        jax.effects_barrier()
        return sorted(CALLS)

    assert calls(kups) == calls(fn)


@jax.custom_jvp
def printed_jvp(x):
    jax.debug.print("f {x}", x=x)
    return jnp.sin(x)


@printed_jvp.defjvp
def _printed_jvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    jax.debug.print("rule {x}", x=x)
    return printed_jvp(x), jnp.cos(x) * t


@pytest.mark.parametrize("transform", [jax.jit, jax.grad, lambda g: jax.jit(jax.grad(g))])
def test_debug_prints_in_the_body_run_as_in_plain_jax(transform, capsys):
    counting = reinterpret(
        printed_jvp, Interpreter(default_dispatcher().register_fallback_handler(count_every))
    )

    def printed(g):
        capsys.readouterr()
        jax.block_until_ready(transform(g)(jnp.float32(0.5)))
        jax.effects_barrier()
        return sorted(capsys.readouterr().out.splitlines())

    assert printed(lambda x: counting(jnp.int32(0), x)[0]) == printed(printed_jvp)


def test_the_context_of_a_differentiated_body_still_counts_its_callback():
    counting = reinterpret(
        logged_jvp, Interpreter(default_dispatcher().register_fallback_handler(count_every))
    )
    plain_count = counting(jnp.int32(0), jnp.float32(0.7))[1]
    CALLS.clear()
    (_, count), _ = jax.jvp(
        lambda x: counting(jnp.int32(0), x), (jnp.float32(0.7),), (jnp.float32(1.0),)
    )
    jax.effects_barrier()
    assert count == plain_count
    assert sorted(CALLS) == ["f", "rule"]


# ------------------------------------------------------- inside a shard_map


@jax.custom_jvp
def sown_sin(x):
    sow(jnp.sum(x), tag="t", name="s", mode="clobber")
    return jnp.sin(x) * 2.0


@sown_sin.defjvp
def _sown_sin_rule(primals, tangents):
    return sown_sin(primals[0]), 3.0 * tangents[0]


@jax.custom_vjp
def scaled_tanh(x, w):
    return jnp.tanh(x) * w


scaled_tanh.defvjp(
    lambda x, w: (scaled_tanh(x, w), (x, w)),
    lambda res, ct: (5.0 * ct, jax.lax.psum(jnp.sum(ct * res[0]), "i")),
)

EFFECTS = {
    "count_primitives": lambda fn: lambda *a: count_primitives(fn)(*a)[0],
    "reap": lambda fn: lambda *a: reap(fn, tag="t")(*a)[0],
    "find_nans": lambda fn: lambda *a: find_nans(fn)(*a)[0],
    "checked": lambda fn: lambda *a: checked(fn, errors=nan_checks)(*a)[0],
}


@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_derivatives_of_custom_rules_in_a_shard_map_body_under_effects(effect, axis_type):
    """The context's tangents inside a shard_map body vary over the manual axes
    where its values do, integer leaves too (find_nans and checked carry some):
    a float0 zero without that type was refused by JAX's custom_jvp check."""
    mesh = jax.make_mesh((8,), ("i",), axis_types=(axis_type,))

    def body(x, w):
        y = jax.nn.relu(sown_sin(x)) + scaled_tanh(x, w)
        return jax.lax.psum(jnp.sum(y**2), "i")

    loss = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 16), NamedSharding(mesh, P("i")))
    w = jnp.float32(0.7)
    effected = EFFECTS[effect](loss)
    grads = jax.jit(jax.grad(effected, argnums=(0, 1)))(x, w)
    for got, expected in zip(grads, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w), strict=True):
        np.testing.assert_array_equal(got, expected)

    def second(f):
        return jax.jit(jax.grad(jax.grad(lambda w: f(x, w))))(w)

    np.testing.assert_array_equal(second(effected), second(loss))


@jax.custom_vjp
def sin_and_argmax(x):
    return jnp.sin(x), jnp.argmax(x)


sin_and_argmax.defvjp(lambda x: (sin_and_argmax(x), x), lambda x, ct: (2.0 * ct[0],))


@pytest.mark.parametrize("effect", EFFECTS)
def test_custom_vjp_with_an_integer_output_in_a_shard_map_body_under_effects(effect, mesh8):
    """The integer output varies over the manual axis: its cotangent would have to
    be a float0 typed as varying; the user's bwd rule never sees it anyway."""

    def body(x):
        y, i = sin_and_argmax(x)
        return jax.lax.psum(jnp.sum(y) + i.astype(jnp.float32), "i")

    loss = jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P())
    x = jnp.linspace(-1.0, 1.0, 16)
    expected = jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(jax.jit(jax.grad(EFFECTS[effect](loss)))(x), expected)


@pytest.mark.parametrize("effect", EFFECTS)
def test_custom_vjp_in_an_eager_shard_map_body_under_effects(effect):
    """Called eagerly (no jit), a shard_map runs its body shard by shard, where
    JAX refuses a custom_vjp declared with symbolic zeros: kups' own custom_vjp
    declares them only where the user's rules do. (Eager shard_maps run op by
    op on every shard, so this runs on one mesh; the body is the same on both.)
    An effect called eagerly is compiled as a whole: `jax.disable_jit()` makes it
    run op by op, as the plain call does."""
    mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Explicit,))

    def body(x, w):
        y = scaled_tanh(x, w) + sin_and_argmax(x)[0]
        return jax.lax.psum(jnp.sum(y**2), "i")

    loss = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 16), NamedSharding(mesh, P("i")))
    w = jnp.float32(0.7)
    with jax.set_mesh(mesh):
        with jax.disable_jit():
            np.testing.assert_array_equal(EFFECTS[effect](loss)(x, w), loss(x, w))
        np.testing.assert_allclose(EFFECTS[effect](loss)(x, w), loss(x, w), rtol=1e-6)
        if effect != "count_primitives":
            return  # eager gradients run op by op on every shard: one effect is enough
        grads = jax.grad(EFFECTS[effect](loss), argnums=(0, 1))(x, w)
        expected = jax.grad(loss, argnums=(0, 1))(x, w)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(got, want)
