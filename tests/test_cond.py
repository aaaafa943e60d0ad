"""`default_cond_handler`: `cond` and `switch` with 2, 3 and 4 branches keep the
taken branch's context, eagerly and under `jit`; branches returning different
contexts are a clear error."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)

X = jnp.array([0.25, -0.5, 1.0], jnp.float32)
LINES: dict[str, int] = {}


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def record_sin(interpreter, ctx, eqn, invals):
    y = jnp.sin(invals[0])
    return HandlerResult({**ctx, "count": ctx["count"] + 1, "last": y}, [y])


def counting_interpreter(handler=count_sin):
    return Interpreter(default_dispatcher().register_handler("sin", handler))


def sins(k):
    """A branch that applies `sin` `k` times (and is distinguishable by its output)."""

    def branch(x):
        for _ in range(k):
            x = jnp.sin(x)
        return x + float(k)

    return branch


def switch_fn(num_branches):
    def fn(index, x):
        return lax.switch(index, [sins(k) for k in range(num_branches)], x)

    return fn


@pytest.mark.parametrize("num_branches", [2, 3, 4])
def test_switch_keeps_taken_branch_context(num_branches):
    fn = switch_fn(num_branches)
    interpreted = reinterpret(fn, counting_interpreter())
    jitted = jax.jit(interpreted)
    for index in range(num_branches):
        expected = fn(index, X)
        np.testing.assert_allclose(sins(index)(X), expected, rtol=1e-6)
        out, ctx = interpreted(jnp.int32(100), index, X)
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        assert int(ctx) == 100 + index
        out, ctx = jitted(jnp.int32(100), jnp.int32(index), X)  # a traced index
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        assert int(ctx) == 100 + index


@pytest.mark.parametrize(("index", "taken"), [(-3, 0), (-1, 0), (3, 2), (17, 2)])
def test_switch_clamps_index_like_jax(index, taken):
    fn = switch_fn(3)
    out, ctx = jax.jit(reinterpret(fn, counting_interpreter()))(0, index, X)
    np.testing.assert_allclose(out, fn(index, X), rtol=1e-6)
    assert int(ctx) == taken


@pytest.mark.parametrize("pred", [False, True])
def test_cond_keeps_taken_branch_context(pred):
    def fn(p, x):
        return lax.cond(p, lambda x: jnp.sin(jnp.sin(x)), lambda x: jnp.cos(x), x)

    expected = fn(pred, X)
    eager = reinterpret(fn, counting_interpreter())
    for interpreted in (eager, jax.jit(eager)):
        out, ctx = interpreted(0, pred, X)
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        assert int(ctx) == (2 if pred else 0)


def test_cond_with_data_dependent_predicate_under_jit():
    def fn(x):
        return lax.cond(jnp.sum(x) > 0, lambda x: jnp.sin(x), lambda x: x * 2.0, x)

    jitted = jax.jit(reinterpret(fn, counting_interpreter()))
    for x in [X, -X]:
        out, ctx = jitted(0, x)
        np.testing.assert_allclose(out, fn(x), rtol=1e-6)
        assert int(ctx) == (1 if float(jnp.sum(x)) > 0 else 0)


def test_every_branch_adding_the_same_leaf():
    def fn(index, x):
        return lax.switch(index, [lambda x: jnp.sin(x), lambda x: jnp.sin(x * 3.0)], x)

    interpreted = jax.jit(reinterpret(fn, counting_interpreter(record_sin)))
    for index, scale in [(0, 1.0), (1, 3.0)]:
        _out, ctx = interpreted({"count": jnp.int32(0)}, index, X)
        assert set(ctx) == {"count", "last"}
        np.testing.assert_allclose(ctx["last"], jnp.sin(X * scale), rtol=1e-6)
        assert int(ctx["count"]) == 1


def test_branches_with_their_own_consts():
    def fn(index, x, a, b, c):
        # Each branch closes over different traced values.
        return lax.switch(
            index,
            [lambda x: jnp.sin(x * a), lambda x: x + b, lambda x: jnp.sin(jnp.sin(x - c)) * a],
            x,
        )

    args = (X, jnp.float32(2.0), jnp.array([1.0, 2.0, 3.0]), jnp.float32(0.5))
    interpreted = jax.jit(reinterpret(fn, counting_interpreter()))
    for index, count in [(0, 1), (1, 0), (2, 2)]:
        out, ctx = interpreted(0, index, *args)
        np.testing.assert_allclose(out, fn(index, *args), rtol=1e-6)
        assert int(ctx) == count


def test_nested_conds():
    def fn(i, j, x):
        inner = lambda x: lax.switch(j, [sins(1), sins(2), sins(3)], x)  # noqa: E731
        return lax.cond(i > 0, inner, sins(0), x)

    jitted = jax.jit(reinterpret(fn, counting_interpreter()))
    for i in (0, 1):
        for j in range(3):
            out, ctx = jitted(0, i, j, X)
            np.testing.assert_allclose(out, fn(i, j, X), rtol=1e-6)
            assert int(ctx) == (j + 1 if i else 0)


def test_vmapped_index_counts_per_example():
    fn = switch_fn(4)
    indices = jnp.array([3, 0, 2, 1, 2])
    out, ctx = jax.vmap(reinterpret(fn, counting_interpreter()), in_axes=(None, 0, None))(
        jnp.int32(0), indices, X
    )
    np.testing.assert_allclose(out, jax.vmap(fn, in_axes=(0, None))(indices, X), rtol=1e-6)
    np.testing.assert_array_equal(ctx, indices)


# ---------------------------------------------------------------------------
# Branches returning different contexts.
# ---------------------------------------------------------------------------


def mismatched(index, x):
    branches = [lambda x: x * 2.0, lambda x: x - 1.0, lambda x: jnp.sin(x), lambda x: x]
    LINES["switch"] = _next_line()
    return lax.switch(index, branches, x)


def test_branches_with_different_structures_are_a_clear_error():
    interpreter = counting_interpreter(record_sin)
    with pytest.raises(ValueError, match="branch") as info:
        reinterpret(mismatched, interpreter)({"count": jnp.int32(0)}, 1, X)
    message = str(info.value)
    assert "'cond'" in message
    assert f"test_cond.py:{LINES['switch']}" in message
    # Branch 2 is the one that adds ctx['last'].
    assert "branch 0 vs branch 2" in message
    assert "ctx['last']: absent vs float32[3]" in message


def test_two_branch_cond_with_different_structures():
    def fn(p, x):
        LINES["cond"] = _next_line()
        return lax.cond(p, jnp.sin, jnp.cos, x)

    with pytest.raises(ValueError, match="branch 0 vs branch 1") as info:
        reinterpret(fn, counting_interpreter(record_sin))({"count": jnp.int32(0)}, True, X)
    message = str(info.value)
    assert "ctx['last']" in message
    assert f"test_cond.py:{LINES['cond']}" in message


def test_branches_with_different_dtypes_are_a_clear_error():
    def add_half(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx + 0.5, [jnp.cos(invals[0])])

    dispatcher = default_dispatcher().register_handler("sin", count_sin)
    dispatcher.register_handler("cos", add_half)

    def fn(p, x):
        return lax.cond(p, jnp.sin, jnp.cos, x)

    with pytest.raises(ValueError, match="branch 0 vs branch 1") as info:
        reinterpret(fn, Interpreter(dispatcher))(jnp.int32(0), True, X)
    assert "ctx: float32[] vs int32[]" in str(info.value)


@pytest.mark.parametrize("pred", [False, True])
def test_cond_without_operands(pred):
    def fn(p):
        return lax.cond(p, lambda: jnp.sin(jnp.float32(1.0)), lambda: jnp.float32(2.0))

    for interpreted in (
        reinterpret(fn, counting_interpreter()),
        jax.jit(reinterpret(fn, counting_interpreter())),
    ):
        out, ctx = interpreted(0, pred)
        np.testing.assert_allclose(out, np.sin(1.0) if pred else 2.0, rtol=1e-6)
        assert int(ctx) == int(pred)


def test_context_no_branch_reads_stays_out_of_the_cond():
    def count_sin(interpreter, ctx, eqn, invals):
        outvals = default_primitive_handler(interpreter, ctx, eqn, invals).outvals
        return HandlerResult({**ctx, "n": ctx["n"] + 1}, outvals)

    def f(x):
        return jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)

    interpreted = reinterpret(
        f, Interpreter(default_dispatcher().register_handler("sin", count_sin))
    )
    ctx = {"a": jnp.arange(3.0), "n": jnp.int32(0)}
    closed = jax.make_jaxpr(interpreted)(ctx, 1.0)
    (cond,) = [e for e in closed.eqns if e.primitive.name == "cond"]
    (plain,) = [e for e in jax.make_jaxpr(f)(1.0).eqns if e.primitive.name == "cond"]
    # Only the count enters (and leaves) the cond; `a` is neither read nor changed.
    assert len(cond.invars) == len(plain.invars) + 1
    assert len(cond.outvars) == len(plain.outvars) + 1
    for x, n in [(1.0, 1), (-1.0, 0)]:
        out, new_ctx = interpreted(ctx, x)
        assert out == f(x) and int(new_ctx["n"]) == n and new_ctx["a"] is ctx["a"]
