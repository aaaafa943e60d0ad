"""Every bad input of the framework is a clear error: the right exception type,
and a message that names the primitive, the user's `file:line` where there is
one, and the fix."""

import functools
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    Uninitialized,
    default_dispatcher,
    default_scan_handler,
    default_while_handler,
    reinterpret,
)

X = jnp.array([0.5, 1.5, -2.0], jnp.float32)
LINES: dict[str, int] = {}


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def at(key: str) -> str:
    """`test_core_errors.py:LINE`, the user's line recorded under `key`."""
    return f"test_core_errors.py:{LINES[key]}"


def user_sin(x):
    y = x * 2.0
    LINES["sin"] = _next_line()
    return jnp.sin(y) + 1.0


def user_sin_in_scan(xs):
    def body(carry, x):
        LINES["scan_sin"] = _next_line()
        return carry + jnp.sin(x), None

    return lax.scan(body, jnp.float32(0.0), xs)[0]


def with_sin_handler(handler, **kwargs):
    return Interpreter(default_dispatcher().register_handler("sin", handler), **kwargs)


# ---------------------------------------------------------------------------
# Unhandled control flow.
# ---------------------------------------------------------------------------


def user_jit(x):
    LINES["jit"] = _next_line()
    return jax.jit(jnp.cos)(x)


def user_cond_in_scan(xs):
    def body(carry, x):
        LINES["cond"] = _next_line()
        return lax.cond(x > 0, jnp.sin, jnp.cos, carry), None

    return lax.scan(body, jnp.float32(1.0), xs)[0]


def test_unhandled_control_flow_raises_by_default():
    with pytest.raises(NotImplementedError) as info:
        reinterpret(user_jit, Interpreter(Dispatcher()))(0, X)
    message = str(info.value)
    assert "'jit'" in message
    assert at("jit") in message
    assert "register_handler('jit', handler)" in message
    assert "InterpreterPolicy.IGNORE" in message


def test_unhandled_control_flow_inside_a_body_names_the_body_line():
    interpreter = Interpreter(default_dispatcher().unregister_handler("cond"))
    with pytest.raises(NotImplementedError) as info:
        reinterpret(user_cond_in_scan, interpreter)(0, X)
    message = str(info.value)
    assert "'cond'" in message and at("cond") in message
    assert "register_handler('cond', handler)" in message


def test_unhandled_control_flow_warn_policy():
    interpreter = Interpreter(Dispatcher(), InterpreterPolicy.WARN)
    with pytest.warns(UserWarning) as record:
        out, ctx = reinterpret(user_jit, interpreter)(0, X)
    (warning,) = record
    message = str(warning.message)
    assert "'jit'" in message and at("jit") in message and "register_handler" in message
    assert jnp.allclose(out, jnp.cos(X)) and ctx == 0


# ---------------------------------------------------------------------------
# Handlers returning the wrong thing.
# ---------------------------------------------------------------------------


def too_many_outvals(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx, [jnp.sin(invals[0]), invals[0]])


def no_outvals(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx, [])


def wrong_shape(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx, [jnp.sin(invals[0])[..., None]])


def wrong_dtype(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx, [jnp.sin(invals[0]).astype(jnp.float16)])


def tuple_outvals(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx, (jnp.sin(invals[0]),))


def bare_value(interpreter, ctx, eqn, invals):
    return jnp.sin(invals[0])


def bare_none(interpreter, ctx, eqn, invals):
    return None


def three_tuple(interpreter, ctx, eqn, invals):
    return ctx, [jnp.sin(invals[0])], "extra"


def string_outval(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx, ["sin"])


@pytest.mark.parametrize(
    ("handler", "error", "fragments"),
    [
        (
            too_many_outvals,
            ValueError,
            ["returned 2 outvals", "has 1 outputs (float32[3])", "one value per output"],
        ),
        (no_outvals, ValueError, ["returned 0 outvals", "one value per output"]),
        (
            wrong_shape,
            ValueError,
            [
                "output 0 of type float32[3,1]",
                "output 0 is float32[3]",
                "keep every output's shape",
            ],
        ),
        (
            wrong_dtype,
            ValueError,
            ["output 0 of type float16[3]", "output 0 is float32[3]", "shape and dtype"],
        ),
        (
            tuple_outvals,
            TypeError,
            ["outvals of type tuple", "must be a list", "HandlerResult(ctx, [y])"],
        ),
        (bare_value, TypeError, ["returns HandlerResult(ctx, outvals)"]),
        (bare_none, TypeError, ["returned NoneType", "returns HandlerResult(ctx, outvals)"]),
        (three_tuple, TypeError, ["returned tuple", "returns HandlerResult(ctx, outvals)"]),
        (string_outval, TypeError, ["a str as output 0", "not an array", "float32[3]"]),
    ],
)
@pytest.mark.parametrize("in_scan", [False, True], ids=["top", "scan_body"])
def test_bad_handler_result(handler, error, fragments, in_scan):
    fn, key = (user_sin_in_scan, "scan_sin") if in_scan else (user_sin, "sin")
    if in_scan:
        # The scan body sees scalars: adjust the expected avals.
        fragments = [f.replace("float32[3,1]", "float32[1]") for f in fragments]
        fragments = [f.replace("[3]", "[]") for f in fragments]
    with pytest.raises(error) as info:
        reinterpret(fn, with_sin_handler(handler))(0, X)
    message = str(info.value)
    assert "'sin'" in message
    assert handler.__name__ in message
    assert at(key) in message
    for fragment in fragments:
        assert fragment in message


def test_bad_handler_result_under_jit():
    with pytest.raises(ValueError, match="returned 2 outvals") as info:
        jax.jit(reinterpret(user_sin, with_sin_handler(too_many_outvals)))(0, X)
    assert at("sin") in str(info.value)


def test_bad_fallback_result():
    dispatcher = Dispatcher().register_fallback_handler(wrong_shape)
    with pytest.raises(ValueError, match="keep every output's shape") as info:
        reinterpret(user_sin, Interpreter(dispatcher))(0, X)
    assert "'mul'" in str(info.value) and "wrong_shape" in str(info.value)


# ---------------------------------------------------------------------------
# Loops: new context leaves, initializers, conditions.
# ---------------------------------------------------------------------------


def record_sin(interpreter, ctx, eqn, invals):
    y = jnp.sin(invals[0])
    return HandlerResult({**ctx, "last": y}, [y])


def count_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def user_scan(xs):
    LINES["scan"] = _next_line()
    return lax.scan(lambda c, x: (c + jnp.sin(x), None), jnp.float32(0.0), xs)[0]


def user_while(x):
    LINES["while"] = _next_line()
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1]


def user_while_sin_in_condition(x):
    LINES["while_cond"] = _next_line()
    return lax.while_loop(lambda c: jnp.sin(c) < 0.5, lambda c: c + 0.25, x)


@pytest.mark.parametrize(
    ("fn", "prim", "handler_name"), [(user_scan, "scan", "scan"), (user_while, "while", "while")]
)
def test_loop_body_adding_leaves_without_initializer(fn, prim, handler_name):
    with pytest.raises(ValueError) as info:
        reinterpret(fn, with_sin_handler(record_sin))({}, X)
    message = str(info.value)
    assert f"'{prim}'" in message and at(prim) in message
    assert "ctx['last']" in message
    assert "initializer" in message and f"default_{handler_name}_handler" in message


@pytest.mark.parametrize(
    ("fn", "prim", "handler"),
    [(user_scan, "scan", default_scan_handler), (user_while, "while", default_while_handler)],
)
def test_initializer_leaving_uninitialized(fn, prim, handler):
    interpreter = with_sin_handler(record_sin)
    interpreter.dispatcher.register_handler(
        prim, functools.partial(handler, initializer=lambda before, sentinel: sentinel)
    )
    with pytest.raises(ValueError) as info:
        reinterpret(fn, interpreter)({}, X)
    message = str(info.value)
    assert f"'{prim}'" in message and at(prim) in message
    assert "left context leaves Uninitialized: ctx['last']" in message
    assert "starting value" in message


def test_while_condition_changing_ctx():
    with pytest.raises(ValueError) as info:
        reinterpret(user_while_sin_in_condition, with_sin_handler(count_sin))(0, jnp.float32(0.0))
    message = str(info.value)
    assert "'while'" in message and at("while_cond") in message
    assert "condition" in message and "changes the context" in message
    assert "thread_condition=True" in message


def user_switch(i, x):
    LINES["switch"] = _next_line()
    return lax.switch(i, [jnp.cos, jnp.sin, jnp.tanh], x)


def test_cond_branches_with_different_ctx():
    with pytest.raises(ValueError) as info:
        reinterpret(user_switch, with_sin_handler(record_sin))({}, 0, X)
    message = str(info.value)
    assert "'cond'" in message and at("switch") in message
    assert "branch 0 vs branch 1" in message
    assert "ctx['last']: absent vs float32[3]" in message
    assert "same structure" in message


# ---------------------------------------------------------------------------
# Building the machine wrongly.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [3, "sin", None])
def test_reinterpret_non_callable(fn):
    with pytest.raises(TypeError) as info:
        reinterpret(fn, Interpreter(default_dispatcher()))
    message = str(info.value)
    assert "needs a callable fn" in message and type(fn).__name__ in message
    assert "swap" in message


def test_reinterpret_swapped_arguments():
    with pytest.raises(TypeError) as info:
        reinterpret(Interpreter(default_dispatcher()), jnp.sin)
    message = str(info.value)
    assert "kups.effects.Interpreter" in message
    assert "Interpreter(default_dispatcher())" in message


@pytest.mark.parametrize(
    "dispatcher",
    [{"sin": count_sin}, default_dispatcher, None, "default"],
    ids=["dict", "factory", "none", "string"],
)
def test_interpreter_non_dispatcher(dispatcher):
    with pytest.raises(TypeError) as info:
        Interpreter(dispatcher)
    message = str(info.value)
    assert "takes a kups.effects.Dispatcher" in message
    assert type(dispatcher).__name__ in message
    assert "default_dispatcher()" in message and "Dispatcher({primitive: handler})" in message


def test_uninitialized_needs_an_aval():
    with pytest.raises(TypeError, match="shape and a dtype"):
        Uninitialized(3)
    assert Uninitialized(jax.ShapeDtypeStruct((2,), jnp.int8)).shape == (2,)
    assert Uninitialized(X).dtype == jnp.float32


def test_unhandled_control_flow_names_what_would_be_lost():
    dispatcher = Dispatcher().register_handler("sin", count_sin)
    with pytest.raises(NotImplementedError, match=r"go to your handlers \('sin'\) would be lost"):
        reinterpret(lambda x: jax.jit(jnp.sin)(x), Interpreter(dispatcher))(0, X)
    with pytest.raises(NotImplementedError, match="nothing inside it goes to a handler"):
        reinterpret(user_jit, Interpreter(dispatcher))(0, X)
