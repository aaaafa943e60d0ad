"""Every bad input of the framework is a clear error: the right exception type,
and a message that names the primitive, the user's `file:line` where there is
one, and the fix."""

import functools
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    Uninitialized,
    default_dispatcher,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    define_effect,
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


# ---------------------------------------------------------------------------
# Messages about a function that is itself a jit or a shard_map, about errors
# raised in the user's handlers and hooks, and about a backward pass run after
# the interpreter returned.
# ---------------------------------------------------------------------------


def test_a_jitted_function_given_to_reinterpret_is_placed_at_the_users_call():
    no_jit = Interpreter(default_dispatcher().unregister_handler("jit"))
    with pytest.raises(NotImplementedError) as info:
        LINES["call_jit"] = _next_line()
        reinterpret(jax.jit(jnp.sin), no_jit)(0, X)
    message = str(info.value)
    assert "primitive 'jit' at " in message and f"{at('call_jit')} (" in message
    assert "in the function called there" in message
    assert "unknown" not in message


def test_a_jitted_function_under_jit_is_placed_at_the_users_call():
    no_jit = Interpreter(default_dispatcher().unregister_handler("jit"))
    with pytest.raises(NotImplementedError) as info:
        LINES["call_jit_jit"] = _next_line()
        jax.jit(reinterpret(jax.jit(jnp.sin), no_jit))(0, X)
    assert f"{at('call_jit_jit')} (" in str(info.value)


def test_a_library_jitted_function_given_to_reinterpret_is_placed_at_the_users_call_too():
    # The jit equation of equinox.filter_jit has only equinox's lines: the user's
    # call of the function follows them.
    import equinox as eqx

    no_jit = Interpreter(default_dispatcher().unregister_handler("jit"))
    with pytest.raises(NotImplementedError) as info:
        LINES["call_filter_jit"] = _next_line()
        reinterpret(eqx.filter_jit(jnp.sin), no_jit)(0, X)
    message = str(info.value)
    assert "primitive 'jit' at " in message and "equinox" in message
    assert f", called from {__file__}:{LINES['call_filter_jit']} (" in message


def _raises_for(primitive: str) -> Interpreter:
    def fails(interpreter, ctx, eqn, invals):
        raise ValueError(f"no {primitive} here")

    return Interpreter(default_dispatcher().register_handler(primitive, fails))


def test_an_equation_inside_a_library_jit_names_the_users_line_that_called_the_library(
    installed_library,
):
    # JAX cuts an equation's traceback at the jit it was traced in: inside an
    # installed library's jitted function only the library's lines are left. The
    # user's line comes from the jit equation around it, which the interpreter is in.
    library = installed_library(
        "kups_test_jitted_lib",
        "import jax\nimport jax.numpy as jnp\n\n\n@jax.jit\ndef sine(x):\n    return jnp.sin(x)\n",
    )

    def user_fn(x):
        return library.sine(x) * 2.0  # the user's call of the library

    with pytest.raises(ValueError, match="no sin here") as info:
        LINES["call_jitted_lib"] = _next_line()
        reinterpret(user_fn, _raises_for("sin"))(0, X)
    message = str(info.value)
    assert f"primitive 'sin' at {library.__file__}:7" in message
    called = f", called from {__file__}:{user_fn.__code__.co_firstlineno + 1}:"
    assert called in message and ".user_fn), called with" in message
    # Not the line that called the interpreted function.
    assert f"{at('call_jitted_lib')} (" not in message


def test_an_equation_without_a_user_line_is_placed_at_the_call_around_it():
    # `jnp.remainder` is a jit: its equations have none of the user's lines.
    def user_fn(x):
        return jnp.remainder(x, 0.3) + 1.0  # the user's call

    with pytest.raises(ValueError, match="no rem here") as info:
        reinterpret(user_fn, _raises_for("rem"))(0, X)
    message = str(info.value)
    line = f"{__file__}:{user_fn.__code__.co_firstlineno + 1}:"
    assert f"primitive 'rem' inside the call at {line}" in message
    assert "unknown" not in message


def test_reduce_ctx_axis_suggestion_for_a_shard_map_given_to_reinterpret_names_the_line():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("data")
    body = jax.shard_map(jnp.sin, mesh=mesh, in_specs=spec, out_specs=spec)
    typo = functools.partial(default_shard_map_handler, reduce_ctx=lambda c: lax.psum(c, "dat"))
    dispatcher = default_dispatcher().register_handler("shard_map", typo)
    dispatcher.register_handler("sin", lambda i, c, e, v: HandlerResult(c + 1.0, [jnp.sin(v[0])]))
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, spec))
    with pytest.raises(ValueError) as info:
        LINES["call_shard_map"] = _next_line()
        reinterpret(body, Interpreter(dispatcher))(jnp.float32(0), x)
    message = str(info.value)
    assert f"{at('call_shard_map')} (" in message
    assert "'dat' (did you mean 'data'?)" in message


def _causes(err: BaseException) -> list[BaseException]:
    chain = []
    while err.__cause__ is not None:
        err = err.__cause__
        chain.append(err)
    return chain


def count_in_dict(interpreter, ctx, eqn, invals):
    LINES["dict_handler"] = _next_line()
    return HandlerResult({**ctx, "sin": ctx["sin"] + 1}, [jnp.sin(invals[0])])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_context_of_the_wrong_kind_names_the_handler_the_equation_and_the_context(jit):
    wrapped = reinterpret(user_sin, with_sin_handler(count_in_dict))
    if jit:
        wrapped = jax.jit(wrapped)
    with pytest.raises(TypeError) as info:
        wrapped(0, X)
    message = str(info.value)
    assert "is not a mapping" in message  # JAX's own words come first
    assert f"{at('dict_handler')} (count_in_dict), in the handler count_in_dict" in message
    assert "kups: raised at" in message and "for the primitive 'sin' at " in message
    assert f"{at('sin')}:" in message and "(user_sin), called with the context" in message
    assert ("i32[] (an array)" if jit else "the context 0 (of type int)") in message
    original = _causes(info.value)[-1]  # JAX may put its own record between
    assert isinstance(original, TypeError) and "kups" not in str(original)
    assert "is not a mapping" in str(original)


def capped_count(interpreter, ctx, eqn, invals):
    LINES["capped_handler"] = _next_line()
    if ctx < 2:  # Python's `if` on a tracer: the body is being traced
        ctx = ctx + 1
    return HandlerResult(ctx, [jnp.sin(invals[0])])


@pytest.mark.parametrize("program", ["scan", "jit"])
def test_a_tracer_error_in_a_handler_gets_the_handler_and_the_equation_as_a_note(program):
    # JAX's concretization errors are made from a tracer, not a message: the
    # error stays JAX's own, and kups' words are a note on it.
    fn = user_sin_in_scan if program == "scan" else jax.jit(user_sin)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        reinterpret(fn, with_sin_handler(capped_count))(0, X)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "kups: raised at" in notes and f"{at('capped_handler')} (capped_count)" in notes
    assert "in the handler capped_count for the primitive 'sin'" in notes
    line = at("scan_sin" if program == "scan" else "sin")
    assert f"{line}:" in notes and "jnp.where or lax.cond" in notes


_TAG = define_effect("kups_test_core_errors_tag")


@pytest.mark.parametrize("cast", [False, True])
def test_a_handler_that_returns_a_replicated_value_for_a_varying_output_is_stopped(cast):
    # Shape and dtype right, but the same on every shard where the equation's
    # output differs between shards: JAX would fail later at the psum, naming
    # neither the handler nor the equation.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def replace(interpreter, ctx, eqn, invals):
        value = jnp.broadcast_to(ctx, invals[0].shape).astype(invals[0].dtype)
        return HandlerResult(ctx, [lax.pcast(value, ("x",), to="varying") if cast else value])

    def program(x):
        def per_shard(b):
            LINES["tagged"] = _next_line()
            (h,) = _TAG.bind(jnp.tanh(b))
            return lax.psum(jnp.sum(h), "x")

        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    wrapped = jax.jit(
        reinterpret(program, Interpreter(default_dispatcher().register_handler(_TAG, replace)))
    )
    if cast:
        out, _ = wrapped(jnp.float32(0.25), jnp.arange(16.0))
        assert float(out) == 4.0
        return
    with pytest.raises(ValueError) as info:
        wrapped(jnp.float32(0.25), jnp.arange(16.0))
    message = str(info.value)
    assert "<locals>.replace for primitive 'kups_test_core_errors_tag'" in message
    assert f"{at('tagged')}:" in message and "{V:x}" in message
    assert "jax.lax.pcast(value, ('x',), to='varying')" in message


def test_a_dict_context_works_with_the_same_handler():
    out, ctx = reinterpret(user_sin, with_sin_handler(count_in_dict))({"sin": 0}, X)
    assert ctx == {"sin": 1}
    assert (out == user_sin(X)).all()


def test_reduce_ctx_error_on_a_scalar_leaf_gets_kups_context():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("data")
    body = jax.shard_map(user_sin, mesh=mesh, in_specs=spec, out_specs=spec)

    def reduce(ctx):
        LINES["reduce"] = _next_line()
        return jnp.sum(ctx, axis=0)

    handler = functools.partial(default_shard_map_handler, reduce_ctx=reduce)
    dispatcher = default_dispatcher().register_handler("shard_map", handler)
    dispatcher.register_handler("sin", lambda i, c, e, v: HandlerResult(c + 1.0, [jnp.sin(v[0])]))
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, spec))

    def user(x):
        LINES["user_shard_map"] = _next_line()
        return body(x)

    with pytest.raises(ValueError) as info:
        reinterpret(user, Interpreter(dispatcher))(jnp.float32(0), x)
    message = str(info.value)
    assert "out of bounds" in message
    assert f"{at('reduce')} (reduce), in the handler" in message
    assert "default_shard_map_handler (with reduce_ctx=)" in message
    assert f"{at('user_shard_map')}:" in message
    assert "f32[]" in message
    assert "out of bounds" in str(_causes(info.value)[-1])
    assert "kups" not in str(_causes(info.value)[-1])


def test_errors_of_kups_own_handlers_are_not_wrapped():
    # The scan handler's own message already says where: no second kups paragraph.
    bad = functools.partial(default_scan_handler, updater=lambda ctx, i: {"new": 1})
    interpreter = Interpreter(default_dispatcher().register_handler("scan", bad))
    with pytest.raises(Exception) as info:
        reinterpret(user_sin_in_scan, interpreter)({}, X)
    assert "kups: raised at" not in str(info.value)


def test_register_handler_with_a_function_suggests_the_primitive_name_and_a_swap():
    with pytest.raises(TypeError) as info:
        default_dispatcher().register_handler(jnp.sin, count_in_dict)  # pyright: ignore[reportArgumentType]
    message = str(info.value)
    assert "did you mean 'sin'" in message
    assert "register_handler('sin', handler)" in message
    assert "arguments swapped" in message
    with pytest.raises(TypeError, match="arguments swapped"):
        default_dispatcher().register_handler(count_in_dict, "sin")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("primitive", ["sin", lax.sin_p], ids=["name", "primitive"])
def test_register_handler_with_swapped_arguments_gives_the_call_in_the_right_order(primitive):
    # The handler's name is no primitive's: no guess from it ("count_in_dict" is
    # not a misspelled primitive), the fix is the same call with the two swapped.
    with pytest.raises(TypeError) as info:
        default_dispatcher().register_handler(count_in_dict, primitive)  # pyright: ignore[reportArgumentType]
    message = str(info.value)
    assert "register_handler('sin', count_in_dict)" in message
    assert "arguments swapped" in message and "did you mean" not in message


# The cookbook's gradient tap.
cotangent_p = define_effect("test_core_errors_cotangent")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def tap(x, name):
    return x


def _tap_backward(name, residuals, cotangent):
    (cotangent,) = cotangent_p.bind(cotangent, name=name)
    return (cotangent,)


tap.defvjp(lambda x, name: (x, None), _tap_backward)


def keep_cotangent(interpreter, ctx, eqn, invals):
    return HandlerResult({**ctx, eqn.params["name"]: invals[0]}, list(invals))


def tap_loss(w, x):
    LINES["tap"] = _next_line()
    hidden = tap(jnp.tanh(x @ w), "hidden")
    return jnp.sum(hidden**2)


W, XS = jnp.arange(6.0).reshape(3, 2) / 6, jnp.ones((4, 3))


def taps(**kwargs):
    return Interpreter(default_dispatcher().register_handler(cotangent_p, keep_cotangent), **kwargs)


def test_gradient_tap_records_when_the_gradient_function_is_interpreted():
    grads, tapped = reinterpret(jax.grad(tap_loss), taps())({}, W, XS)
    hidden = jnp.tanh(XS @ W)
    assert jnp.allclose(tapped["hidden"], jax.grad(lambda h: jnp.sum(h**2))(hidden))
    assert jnp.allclose(grads, jax.grad(tap_loss)(W, XS))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradient_of_an_interpreted_function_with_a_tap_is_loud(jit):
    grad = jax.grad(lambda w: reinterpret(tap_loss, taps())({}, w, XS)[0])
    if jit:
        grad = jax.jit(grad)
    with pytest.raises(NotImplementedError) as info:
        grad(W)
    assert type(info.value).__name__ == "LostEffectError"
    message = str(info.value)
    assert "'test_core_errors_cotangent'" in message
    assert "backward rule of the custom_vjp" in message
    assert "primitive 'custom_vjp_call' at " in message and f"{at('tap')}:" in message
    assert "reinterpret(jax.grad(f), interpreter)" in message


def test_gradient_of_an_interpreted_function_with_a_tap_warns_or_goes_on_by_the_policy():
    plain = jax.grad(tap_loss)(W, XS)
    ignoring = jax.grad(
        lambda w: reinterpret(tap_loss, taps(policy=InterpreterPolicy.IGNORE))({}, w, XS)[0]
    )
    assert jnp.array_equal(ignoring(W), plain)
    warning = jax.grad(
        lambda w: reinterpret(tap_loss, taps(policy=InterpreterPolicy.WARN))({}, w, XS)[0]
    )
    with pytest.warns(UserWarning, match="backward rule of the custom_vjp"):
        assert jnp.array_equal(warning(W), plain)


def test_gradient_of_an_interpreted_function_whose_tap_is_not_handled_is_quiet():
    # An interpreter that does not handle the effect loses nothing: no error.
    plain = jax.grad(tap_loss)(W, XS)
    identity = Interpreter(default_dispatcher())
    grads = jax.grad(lambda w: reinterpret(tap_loss, identity)({}, w, XS)[0])(W)
    assert jnp.array_equal(grads, plain)


# ---------------------------------------------------------------------------
# Functions given to kups with the wrong signature; static leaves that print the
# same; a keyword argument named `ctx`.
# ---------------------------------------------------------------------------


def _scan_of_sin(xs):
    return lax.scan(lambda c, x: (c + jnp.sin(x), None), 0.0, xs)[0]


def _three_arguments(interpreter, ctx, eqn):
    return HandlerResult(ctx, [])


def _one_argument(sentinel):
    return sentinel


def _recording(interpreter, ctx, eqn, invals):
    return HandlerResult({**ctx, "k": jnp.sum(invals[0])}, [jnp.sin(invals[0])])


@pytest.mark.parametrize(
    "dispatcher, culprit, primitive",
    [
        (default_dispatcher().register_handler("sin", _three_arguments), "", "'sin'"),
        (default_dispatcher().register_fallback_handler(_three_arguments), "", "'sin'"),
        (
            default_dispatcher()
            .register_handler("sin", _recording)
            .register_handler(
                "scan", functools.partial(default_scan_handler, initializer=_one_argument)
            ),
            " (with initializer=)",
            "'scan'",
        ),
    ],
    ids=["handler", "fallback", "initializer"],
)
def test_a_function_given_with_the_wrong_signature_is_named_with_the_equation(
    dispatcher, culprit, primitive
):
    with pytest.raises(TypeError) as info:
        reinterpret(_scan_of_sin, Interpreter(dispatcher))({}, jnp.ones(3))
    message = str(info.value)
    assert "positional argument" in message
    assert f"{culprit} for the primitive {primitive} at {__file__}" in message
    assert "handler(interpreter, ctx, eqn, invals)" in message
    assert message.count("kups:") == 1  # said once, not again by each enclosing handler


class _Tag:
    """A static leaf without `__eq__` whose copies print the same."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"_Tag({self.name!r})"


def test_static_leaves_that_differ_but_print_the_same_are_named():
    def tag_sin(interpreter, ctx, eqn, invals):
        return HandlerResult({"last": _Tag("sin")}, [jnp.sin(invals[0])])

    interpreter = Interpreter(default_dispatcher().register_handler("sin", tag_sin))
    with pytest.raises(ValueError, match=r"ctx\['last'\]: static _Tag\('sin'\) vs static") as info:
        reinterpret(_scan_of_sin, interpreter)({"last": _Tag("sin")}, jnp.ones(3))
    assert "print the same" in str(info.value) and "__eq__" in str(info.value)


def test_a_keyword_argument_named_ctx_reaches_the_function():
    def scaled(x, *, ctx=1.0):
        return x * ctx

    wrapped = reinterpret(scaled, Interpreter(default_dispatcher()))
    out, ctx = wrapped(0, X, ctx=5.0)
    assert ctx == 0 and (out == X * 5.0).all()
    assert (wrapped(0, X)[0] == X).all()
