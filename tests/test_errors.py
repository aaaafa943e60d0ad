"""A catalogue of user mistakes, across the framework and the effects.

Each test makes one mistake the way a user would, and checks what they get: the
exception type, and a message that names the primitive or the effect, the
user's line (`test_errors.py:LINE`, marked `# <NAME>` below) where there is
one, and the fix. Some mistakes are JAX's to report (a mesh made without
`axis_types`); those check that kups passes JAX's message through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kups
from kups.checks import check, checked
from kups.debug import find_nans, nan_sites
from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    default_dispatcher,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    define_effect,
    reinterpret,
)
from kups.harvest import harvest, nest, plant, reap, reap_grads, sow
from kups.instrument import count_flops, count_primitives

pytestmark = pytest.mark.leakcheck

X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)


def _marker_lines() -> dict[str, int]:
    lines = {}
    with open(__file__) as source:
        for number, text in enumerate(source, start=1):
            match = re.search(r"# <(\w+)>$", text)
            if match:
                lines[match.group(1)] = number
    return lines


LINES = _marker_lines()


def at(marker: str) -> str:
    """How a message names the line marked `# <marker>` in this file."""
    return f"test_errors.py:{LINES[marker]}"


def expect(exception: type[BaseException], call, *fragments: str) -> str:
    """Runs `call()`, which must raise `exception` with every fragment in its message."""
    with pytest.raises(exception) as info:
        call()
    message = str(info.value)
    missing = [fragment for fragment in fragments if fragment not in message]
    assert not missing, f"{missing} not in the message:\n{message}"
    return message


def identity_with(**handlers) -> Interpreter:
    dispatcher = default_dispatcher()
    for name, handler in handlers.items():
        dispatcher.register_handler(name, handler)
    return Interpreter(dispatcher)


def add_one_at_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


# ---------------------------------------------------------------------------
# Meshes and contexts.
# ---------------------------------------------------------------------------


def test_mesh_without_axis_types_is_jax_error_unchanged():
    # Since JAX 0.9, `make_mesh` without `axis_types` makes Explicit axes: a
    # shard_map then wants inputs already sharded as its in_specs say. That is
    # JAX's error, and kups must neither hide nor reword it.
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    assert mesh.axis_types == (AxisType.Explicit,) * 2

    def user(x):
        return jax.shard_map(lambda b: b * 2.0, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)

    plain = expect(ValueError, lambda: user(X), "in_specs passed to shard_map", "reshard")
    counted = expect(ValueError, lambda: count_primitives(user)(X))
    assert counted == plain
    # The fix JAX names works through kups too: shard the input first.
    sharded = jax.device_put(X, NamedSharding(mesh, P("x")))
    out, counts = count_primitives(user)(sharded)
    np.testing.assert_array_equal(out, X * 2.0)
    assert counts["mul"] == 8  # once per shard: the body is manual over x and y


class Tally:
    """A context class the user forgot to register as a pytree."""

    def __init__(self, n):
        self.n = n


def tally_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(Tally(ctx.n + 1), [jnp.sin(invals[0])])


def user_jit_sin(x):
    return jax.jit(jnp.sin)(x)  # <JIT_SIN>


def user_scan_sin(xs):
    return lax.scan(lambda c, x: (c + jnp.sin(x), None), 0.0, xs)[0]  # <SCAN_SIN>


def test_unregistered_context_class_holding_arrays_in_jit():
    # An object that is not a pytree is one static leaf, like a string. Its array
    # cannot come out of a jit: without a check it would leak a tracer.
    interpreter = identity_with(sin=tally_sin)

    def call():
        # Under JAX_CHECK_TRACER_LEAKS JAX would report the leak before kups can.
        with jax.check_tracer_leaks(False):
            return reinterpret(user_jit_sin, interpreter)(Tally(jnp.int32(0)), X)

    expect(
        TypeError,
        call,
        "ctx",
        "Tally",
        "static",
        "'jit'",
        at("JIT_SIN"),
        "register",
        "pytree",
    )


def test_unregistered_context_class_in_a_loop():
    interpreter = identity_with(sin=tally_sin)
    expect(
        ValueError,
        lambda: reinterpret(user_scan_sin, interpreter)(Tally(0), X),
        "'scan'",
        at("SCAN_SIN"),
        "static",
        "Tally",
        "pytree",
    )
    # Registered as a pytree, the same handler works: its `n` is a loop carry.
    interpreter = identity_with(sin=lambda i, ctx, e, v: HandlerResult(ctx.add(), [jnp.sin(v[0])]))
    _, ctx = reinterpret(user_scan_sin, interpreter)(RegisteredTally(jnp.int32(0)), X)
    assert int(ctx.n) == X.shape[0]


@jax.tree_util.register_pytree_node_class
class RegisteredTally:
    def __init__(self, n):
        self.n = n

    def add(self):
        return RegisteredTally(self.n + 1)

    def tree_flatten(self):
        return (self.n,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


# ---------------------------------------------------------------------------
# Handlers returning the wrong thing, deep inside a program.
# ---------------------------------------------------------------------------


def user_shard_map_sin(x, mesh):
    def body(b):
        return jnp.sin(b) * 2.0  # <SM_SIN>

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)


def test_handler_returning_a_tuple_of_outputs(mesh):
    def returns_tuple(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx, (jnp.sin(invals[0]),))

    expect(
        TypeError,
        lambda: reinterpret(user_shard_map_sin, identity_with(sin=returns_tuple))(0, X, mesh),
        "'sin'",
        "returns_tuple",
        at("SM_SIN"),
        "must be a list",
        "HandlerResult(ctx, [y])",
    )


def test_handler_returning_a_bare_value(mesh):
    def returns_value(interpreter, ctx, eqn, invals):
        return jnp.sin(invals[0])

    expect(
        TypeError,
        lambda: reinterpret(user_shard_map_sin, identity_with(sin=returns_value))(0, X, mesh),
        "'sin'",
        "returns_value",
        at("SM_SIN"),
        "HandlerResult(ctx, outvals)",
    )


def user_cond_sin(x):
    return lax.cond(x[0] > 0, lambda a: jnp.sin(a), jnp.cos, x)  # <COND_SIN>


@pytest.mark.parametrize(
    ("result", "fragments"),
    [
        (lambda y: y.astype(jnp.float16), ["float16[8]", "float32[8]", "shape and dtype"]),
        (lambda y: y[:4], ["float32[4]", "float32[8]", "shape and dtype"]),
        (lambda y: [y, y], ["returned 2 outvals", "one value per output"]),
    ],
    ids=["dtype", "shape", "count"],
)
def test_handler_returning_wrong_outputs_inside_cond(result, fragments):
    def wrong(interpreter, ctx, eqn, invals):
        out = result(jnp.sin(invals[0]))
        return HandlerResult(ctx, out if isinstance(out, list) else [out])

    expect(
        (ValueError, TypeError),
        lambda: jax.jit(reinterpret(user_cond_sin, identity_with(sin=wrong)))(0, X),
        "'sin'",
        at("COND_SIN"),
        *fragments,
    )


# ---------------------------------------------------------------------------
# shard_map options.
# ---------------------------------------------------------------------------


def shard_map_with(**options):
    return identity_with(
        sin=add_one_at_sin,
        shard_map=functools.partial(default_shard_map_handler, **options),
    )


def user_shard_map(x, mesh):
    body = jax.shard_map(jnp.sin, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return body(x)  # <SM>


def test_reduce_ctx_changing_the_context_structure(mesh):
    interpreter = shard_map_with(reduce_ctx=lambda ctx: {"count": ctx})
    expect(
        ValueError,
        lambda: reinterpret(user_shard_map, interpreter)(jnp.int32(0), X, mesh),
        "reduce_ctx",
        "'shard_map'",
        at("SM"),
        "same structure",
        "jax.tree.map",
    )


def test_declare_ctx_in_specs_with_the_wrong_structure(mesh):
    interpreter = shard_map_with(declare_ctx_in_specs=lambda ctx: {"a": P(), "b": P()})
    expect(
        ValueError,
        lambda: reinterpret(user_shard_map, interpreter)({"a": jnp.int32(0)}, X, mesh),
        "declare_ctx_in_specs",
        "'shard_map'",
        at("SM"),
        "PartitionSpec",
        "structure",
    )


def test_declare_ctx_in_specs_returning_a_tuple_for_one_leaf(mesh):
    interpreter = shard_map_with(declare_ctx_in_specs=lambda ctx: (P(), P()))
    expect(
        ValueError,
        lambda: reinterpret(user_shard_map, interpreter)(jnp.int32(0), X, mesh),
        "declare_ctx_in_specs",
        "'shard_map'",
        at("SM"),
        "one PartitionSpec",
    )


def test_varying_context_leaving_with_a_replicated_out_spec(mesh):
    def add_shard_index(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx + lax.axis_index("x"), [jnp.sin(invals[0])])

    expect(
        ValueError,
        lambda: reinterpret(user_shard_map, identity_with(sin=add_shard_index))(0, X, mesh),
        "'shard_map'",
        at("SM"),
        "('x',)",
        "reduce_ctx",
        "declare_ctx_out_specs",
    )


# ---------------------------------------------------------------------------
# Control flow.
# ---------------------------------------------------------------------------


def user_scan(xs):
    return lax.scan(lambda c, x: (c * x, c), 1.0, xs)  # <SCAN>


def test_unhandled_control_flow_under_raise():
    interpreter = Interpreter(default_dispatcher().unregister_handler("scan"))
    expect(
        NotImplementedError,
        lambda: reinterpret(user_scan, interpreter)(0, X),
        "'scan'",
        at("SCAN"),
        "register_handler('scan', handler)",
        "InterpreterPolicy.IGNORE",
    )


def record_sin(interpreter, ctx, eqn, invals):
    y = jnp.sin(invals[0])
    return HandlerResult({**ctx, "last": y}, [y])


def user_while(x):
    state = (0, x)
    return lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, jnp.sin(s[1])), state)  # <WHILE>


def test_loop_body_adding_context_leaves_without_initializer():
    expect(
        ValueError,
        lambda: reinterpret(user_scan_sin, identity_with(sin=record_sin))({}, X),
        "'scan'",
        at("SCAN_SIN"),
        "ctx['last']",
        "initializer",
    )


def test_initializer_leaving_a_leaf_uninitialized():
    interpreter = identity_with(
        sin=record_sin,
        **{"while": functools.partial(default_while_handler, initializer=lambda before, s: s)},
    )
    expect(
        ValueError,
        lambda: reinterpret(user_while, interpreter)({}, X),
        "'while'",
        at("WHILE"),
        "Uninitialized: ctx['last']",
        "starting value",
    )


def user_while_sin_condition(x):
    return lax.while_loop(lambda c: jnp.sin(c) < 0.5, lambda c: c + 0.25, x)  # <WHILE_COND>


def test_while_condition_changing_the_context():
    expect(
        ValueError,
        lambda: reinterpret(user_while_sin_condition, identity_with(sin=add_one_at_sin))(
            0, jnp.float32(0.0)
        ),
        "'while'",
        at("WHILE_COND"),
        "changes the context",
        "thread_condition=True",
    )


def user_switch(i, x):
    return lax.switch(i, [jnp.cos, jnp.sin, jnp.tanh], x)  # <SWITCH>


def test_switch_branches_returning_different_contexts():
    expect(
        ValueError,
        lambda: reinterpret(user_switch, identity_with(sin=record_sin))({}, 1, X),
        "'cond'",
        at("SWITCH"),
        "branch 0 vs branch 1",
        "ctx['last']: absent vs float32[8]",
        "same structure",
    )


def test_scan_carry_initializer_with_the_wrong_dtype():
    # The initializer builds the loop's first context: its leaves must have the
    # shapes and dtypes the body returns.
    def wrong_dtype(before, sentinel):
        return {**sentinel, "last": jnp.zeros((), jnp.float16)}

    interpreter = identity_with(
        sin=record_sin, scan=functools.partial(default_scan_handler, initializer=wrong_dtype)
    )
    expect(
        ValueError,
        lambda: reinterpret(user_scan_sin, interpreter)({}, X),
        "'scan'",
        at("SCAN_SIN"),
        "ctx['last']: float16[] vs float32[]",
        "initializer",
    )


# ---------------------------------------------------------------------------
# Building the machine wrongly.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrap", "name"),
    [
        (lambda fn: reinterpret(fn, Interpreter(default_dispatcher())), "reinterpret"),
        (count_primitives, "count_primitives"),
        (find_nans, "find_nans"),
        (checked, "checked"),
        (lambda fn: reap(fn, tag="t"), "reap"),
        (lambda fn: plant(fn, tag="t"), "plant"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_wrapping_something_that_is_not_callable(wrap, name):
    # A user who passes the result instead of the function (`f(x)` for `f`).
    message = expect(TypeError, lambda: wrap(jnp.sin(X))(X), name, "callable")
    assert "swap" not in message or name == "reinterpret"


def test_interpreter_given_a_dict_of_handlers():
    expect(
        TypeError,
        lambda: Interpreter({"sin": add_one_at_sin}),
        "Dispatcher",
        "dict",
        "Dispatcher({primitive: handler})",
    )


def test_interpreter_policy_given_as_a_string():
    expect(
        TypeError,
        lambda: Interpreter(default_dispatcher(), "raise"),
        "InterpreterPolicy",
        "'raise'",
    )
    assert Interpreter(default_dispatcher(), InterpreterPolicy.WARN).policy.name == "WARN"


def test_registering_a_handler_that_is_not_callable():
    expect(
        TypeError,
        lambda: Dispatcher().register_handler("sin", add_one_at_sin(None, 0, None, [X])),
        "'sin'",
        "handler(interpreter, ctx, eqn, invals)",
    )


def test_unregistering_a_handler_that_is_not_there():
    expect(KeyError, lambda: default_dispatcher().unregister_handler("sin"), "'sin'", "'scan'")


def test_define_effect_without_a_name():
    expect(TypeError, lambda: define_effect(""), "define_effect", "non-empty string")


# ---------------------------------------------------------------------------
# kups.harvest.
# ---------------------------------------------------------------------------


def user_sow_twice(x):
    h = sow(x * 2.0, tag="t", name="h")  # <SOW_FIRST>
    return sow(jnp.sin(h), tag="t", name="h")  # <SOW_SECOND>


def test_strict_name_sown_twice():
    expect(
        ValueError,
        lambda: reap(user_sow_twice, tag="t")(X),
        "'h'",
        "tag 't'",
        "strict",
        at("SOW_FIRST"),
        at("SOW_SECOND"),
        "mode='clobber'",
    )


def user_append_in_while(x):
    def body(state):
        i, v = state
        return i + 1, sow(v * 0.5, tag="t", name="steps", mode="append")  # <APPEND_SOW>

    return lax.while_loop(lambda s: s[0] < 3, body, (0, x))  # <APPEND_WHILE>


def test_append_inside_a_while_loop():
    expect(
        ValueError,
        lambda: reap(user_append_in_while, tag="t")(X),
        "'steps'",
        "mode='append'",
        at("APPEND_SOW"),
        at("APPEND_WHILE"),
        "use a scan",
    )


def user_strict_in_scan(xs):
    def body(c, x):
        return c + sow(x, tag="t", name="x", mode="strict"), None  # <STRICT_SCAN>

    return lax.scan(body, 0.0, xs)[0]


def test_strict_inside_a_scan():
    expect(
        ValueError,
        lambda: reap(user_strict_in_scan, tag="t")(X),
        "'x'",
        "mode='strict'",
        at("STRICT_SCAN"),
        "mode='append'",
    )


def user_cond_sows(x):
    return lax.cond(  # <COND_SOWS>
        x[0] > 0,
        lambda a: sow(a, tag="t", name="v"),
        lambda a: sow(a[:2], tag="t", name="v").sum() + a,
        x,
    )


def test_cond_branches_sowing_different_shapes():
    expect(
        ValueError,
        lambda: reap(user_cond_sows, tag="t")(X),
        "'v' (tag 't')",
        "float32[2] vs float32[8]",
        at("COND_SOWS"),
        "same structure",
    )


def test_plant_of_a_name_never_sown():
    expect(
        ValueError,
        lambda: plant(user_sow_twice, tag="t")({"hh": X}, X),
        "['hh']",
        "never sows",
        "['h']",
    )


def user_sow_once(x):
    return sow(x, tag="t", name="h") * 2.0  # <SOW_ONCE>


def test_plant_of_a_value_with_the_wrong_shape():
    expect(
        ValueError,
        lambda: plant(user_sow_once, tag="t")({"h": X[:3]}, X),
        "'h'",
        at("SOW_ONCE"),
        "(3,)",
        "(8,)",
        "reap returns",
    )


def test_sow_with_an_unknown_mode():
    expect(
        ValueError,
        lambda: sow(X, tag="t", name="h", mode="stack"),
        "mode='stack'",
        "'strict', 'append', 'clobber'",
    )


# ---------------------------------------------------------------------------
# kups.checks.
# ---------------------------------------------------------------------------


def user_float_predicate(x):
    check(jnp.sum(x), "sum is zero")  # <CHECK_FLOAT>
    return x


def user_array_predicate(x):
    check(x > -2.0, "too small")  # <CHECK_ARRAY>
    return x


def user_fmt_mismatch(x):
    check(jnp.all(x > 0), "bad values {} and {}", x[0])  # <CHECK_FMT>
    return x


def user_fmt_named(x):
    check(jnp.all(x > 0), "bad value {value}", x[0])  # <CHECK_NAMED>
    return x


@pytest.mark.parametrize(
    ("user", "marker", "error", "fragments"),
    [
        (user_float_predicate, "CHECK_FLOAT", TypeError, ["float32[]", "x > 0"]),
        (user_array_predicate, "CHECK_ARRAY", ValueError, ["bool[8]", "jnp.all"]),
        (user_fmt_mismatch, "CHECK_FMT", ValueError, ["argument 1", "fmt_args"]),
        (user_fmt_named, "CHECK_NAMED", ValueError, ["{value}", "{}"]),
    ],
    ids=["float_predicate", "array_predicate", "fmt_mismatch", "fmt_named_field"],
)
def test_bad_check(user, marker, error, fragments):
    expect(error, lambda: checked(user)(X), "check(", at(marker), *fragments)
    # The mistake is reported at trace time, under jit too.
    expect(error, lambda: jax.jit(checked(user))(X), at(marker))


def user_positive(x):
    check(jnp.all(x > 0), "not positive")
    return x


def test_error_get_inside_jit():
    def user(x):
        _, error = checked(user_positive)(x)
        return error.get()

    expect(TypeError, lambda: jax.jit(user)(X), "Error.get()", "traced", "outside jit")


# ---------------------------------------------------------------------------
# The first steps: names, the context, the jaxpr, stale traces, tracebacks.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("sine", "'sin'"), ("dot", "'dot_general'"), ("while_loop", "'while'"), ("Scan", "'scan'")],
)
def test_registering_a_name_that_is_no_primitive(name, suggestion):
    message = expect(
        ValueError,
        lambda: default_dispatcher().register_handler(name, add_one_at_sin),
        f"{name!r}",
        "never run",
        f"Did you mean {suggestion}",
        "jax.make_jaxpr",
        "Primitive object",
    )
    assert "Primitive object" in message
    # The constructor checks its mapping too.
    expect(ValueError, lambda: Dispatcher({name: add_one_at_sin}), f"{name!r}", suggestion)


def test_registering_the_suggested_name_works():
    def user(x):
        return jnp.sin(jnp.sin(x))

    out, ctx = reinterpret(user, identity_with(sin=add_one_at_sin))(0, X)
    assert ctx == 2
    np.testing.assert_allclose(out, user(X))


def test_registering_names_of_primitives_kups_and_users_make():
    # Every default handler's name, on every JAX kups supports (some are old names).
    dispatcher = default_dispatcher()
    for name, handler in dispatcher.handlers.items():
        dispatcher.register_handler(name, handler)
    # An effect primitive, and a user's own primitive, by name.
    effect = define_effect("kups_test_errors_effect")
    own = jax.extend.core.Primitive("kups_test_errors_own")
    own.def_impl(lambda x: x + 1.0)
    own.def_abstract_eval(lambda aval: aval)
    seen = []

    def record(interpreter, ctx, eqn, invals):
        seen.append(eqn.primitive.name)
        return HandlerResult(ctx, [invals[0] + 1.0])

    dispatcher.register_handler("kups_test_errors_effect", record)
    dispatcher.register_handler("kups_test_errors_own", record)

    def user(x):
        (x,) = effect.bind(x)
        return own.bind(x)

    out, _ = reinterpret(user, Interpreter(dispatcher))(0, X)
    np.testing.assert_allclose(out, X + 2.0)
    assert seen == ["kups_test_errors_effect", "kups_test_errors_own"]


def test_registering_the_name_of_a_primitive_not_yet_made():
    # The way out: register the Primitive object, which is always accepted.
    expect(
        ValueError,
        lambda: Dispatcher().register_handler("kups_test_errors_later", add_one_at_sin),
        "'kups_test_errors_later'",
        "register_handler(my_primitive, handler)",
        "create it (import its module) before",
    )
    later = jax.extend.core.Primitive("kups_test_errors_later")
    assert Dispatcher().register_handler(later, add_one_at_sin).is_registered(later)
    assert Dispatcher().register_handler("kups_test_errors_later", add_one_at_sin)


def user_two_args(model, xs):
    return model["w"] * xs


def test_calling_a_reinterpreted_function_without_the_context():
    wrapped = reinterpret(user_two_args, Interpreter(default_dispatcher()))
    model = {"w": jnp.float32(2.0)}
    expect(
        TypeError,
        lambda: wrapped(model, X),
        "user_two_args(model, xs)",
        "the first argument of a reinterpreted function is the context",
        "wrapped(ctx, *args)",
    )
    out, ctx = wrapped(None, model, X)
    np.testing.assert_allclose(out, 2.0 * X)
    assert ctx is None
    # A call that is wrong for another reason keeps the user's own error.
    expect(TypeError, lambda: wrapped(None, model, X, X), "positional argument")


def test_interpreter_given_a_function_instead_of_a_jaxpr():
    interpreter = Interpreter(default_dispatcher())
    jitted = jax.jit(jnp.sin)
    expect(
        TypeError,
        lambda: interpreter(jitted, 0, X),
        "interprets a jaxpr",
        "reinterpret(",
        "jax.make_jaxpr(",
    )
    expect(TypeError, lambda: interpreter("sin", 0, X), "was given a str", "jax.make_jaxpr")
    # Both fixes work.
    outs, _ = interpreter(jax.make_jaxpr(jitted)(X), 0, X)
    np.testing.assert_allclose(outs[0], jnp.sin(X))
    out, _ = reinterpret(jitted, interpreter)(0, X)
    np.testing.assert_allclose(out, jnp.sin(X))


def add_hundred_at_sin(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 100, [jnp.sin(invals[0])])


def add_one_at_cos(interpreter, ctx, eqn, invals):
    return HandlerResult(ctx + 1, [jnp.cos(invals[0])])


def test_changing_a_dispatcher_after_it_traced_under_jit():
    dispatcher = default_dispatcher().register_handler("sin", add_one_at_sin)
    # Eager use caches nothing: changing the dispatcher then is silent.
    reinterpret(jnp.sin, Interpreter(dispatcher))(0, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatcher.register_handler("cos", add_one_at_cos)
    jitted = jax.jit(reinterpret(jnp.sin, Interpreter(dispatcher)))
    assert int(jitted(0, X)[1]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatcher.register_handler("sin", add_one_at_sin)  # the same handler: no change
    with pytest.warns(UserWarning, match="already used to trace") as record:
        dispatcher.register_handler("sin", add_hundred_at_sin)
    message = str(record[0].message)
    assert "register_handler('sin', ...)" in message and "dispatcher.copy()" in message
    assert type(record[0].message).__name__ == "StaleTraceWarning"
    # The trap the warning is about: the jitted function keeps the old handler.
    assert int(jitted(0, X)[1]) == 1
    # The fix it names: a copy (not yet used to trace) and a new wrapper.
    fresh = dispatcher.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.unregister_handler("cos")  # a change, silent on a copy
    assert int(jax.jit(reinterpret(jnp.sin, Interpreter(fresh)))(0, X)[1]) == 100
    for change in (
        lambda: dispatcher.unregister_handler("cos"),
        lambda: dispatcher.register_fallback_handler(None),
        lambda: dispatcher.register_custom_matching_rule(lambda ctx, eqn, invals: False),
    ):
        with pytest.warns(UserWarning, match="already used to trace"):
            change()


KUPS_DIR = os.path.dirname(os.path.abspath(kups.__file__)) + os.sep


def kups_frames(exc: BaseException) -> list[str]:
    """The kups-internal frames (`file:function`) of `exc`'s traceback, as printed."""
    return [
        f"{frame.filename}:{frame.name}"
        for frame in traceback.extract_tb(exc.__traceback__)
        if frame.filename.startswith(KUPS_DIR) and not frame.filename.endswith("_demo.py")
    ]


class UserBug(Exception):
    pass


def user_scan_raising(xs):
    def body(carry, x):
        raise UserBug("the user's own bug")  # <USER_BUG>

    return lax.scan(body, 0.0, xs)[0]


def user_handler_raising(interpreter, ctx, eqn, invals):
    raise UserBug("the user's handler failed")  # <HANDLER_BUG>


def user_scan_sin_plain(xs):
    return lax.scan(lambda c, x: (c + jnp.sin(x), None), 0.0, xs)[0]


@pytest.mark.parametrize("case", ["fn", "handler"])
@pytest.mark.parametrize("under_jit", [False, True])
def test_tracebacks_hide_kups_frames(case, under_jit):
    wrapped = (
        reinterpret(user_scan_raising, Interpreter(default_dispatcher()))
        if case == "fn"
        else reinterpret(user_scan_sin_plain, identity_with(sin=user_handler_raising))
    )
    call = jax.jit(wrapped) if under_jit else wrapped
    with pytest.raises(UserBug) as info:
        call(0, X)
    assert kups_frames(info.value) == []
    lines = [(f.filename, f.lineno) for f in traceback.extract_tb(info.value.__traceback__)]
    marker = "USER_BUG" if case == "fn" else "HANDLER_BUG"
    assert lines[-1] == (__file__, LINES[marker])  # the user's line is still there
    # JAX's opt-out shows every frame, kups' too.
    with _filtering_off(), pytest.raises(UserBug) as info:
        call(0, X)
    assert len(kups_frames(info.value)) >= 2


@contextlib.contextmanager
def _filtering_off():
    previous = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", previous)


_KUPS_OPT_OUT = """
import jax, jax.numpy as jnp, traceback
from jax import lax
from kups.effects import Interpreter, default_dispatcher, reinterpret

def body(carry, x):
    raise ZeroDivisionError("user bug")

wrapped = reinterpret(lambda xs: lax.scan(body, 0.0, xs)[0], Interpreter(default_dispatcher()))
try:
    wrapped(0, jnp.ones(3))
except ZeroDivisionError as err:
    files = [frame.filename for frame in traceback.extract_tb(err.__traceback__)]
    print(sum("/kups/" in f for f in files), sum("/jax/" in f for f in files))
"""


def test_kups_opt_out_of_traceback_filtering_keeps_jax_filtering():
    env = dict(os.environ, KUPS_TRACEBACK_FILTERING="off")
    env.pop("JAX_TRACEBACK_FILTERING", None)
    result = subprocess.run(
        [sys.executable, "-c", _KUPS_OPT_OUT], env=env, capture_output=True, text=True, check=True
    )
    num_kups, num_jax = map(int, result.stdout.split())
    assert num_kups >= 2 and num_jax == 0


# ---------------------------------------------------------------------------
# Context specs, reduce_ctx's axis names, and the fixes the messages suggest:
# each suggested fix is applied as the message writes it, and must then run and
# give the right values.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["auto", "explicit"])
def data_mesh(request):
    kind = AxisType.Auto if request.param == "auto" else AxisType.Explicit
    return jax.make_mesh((4, 2), ("data", "y"), axis_types=(kind,) * 2)


def placed(mesh, value, spec):
    """`value` on `mesh`'s devices with `spec`, as an Explicit mesh needs it eagerly."""
    return jax.device_put(value, NamedSharding(mesh, spec))


def user_per_shard(x, mesh):
    body = jax.shard_map(jnp.sin, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return body(x)  # <SM_DATA>


def user_per_shard_partial(x, mesh):
    body = jax.shard_map(
        jnp.sin, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}
    )
    return body(x)  # <SM_PARTIAL>


def add_loss(interpreter, ctx, eqn, invals):
    """ctx['loss'] += the shard's sum of sin(x): differs between the shards of `data`."""
    out = jnp.sin(invals[0])
    return HandlerResult(
        {**ctx, "loss": ctx["loss"] + jnp.sum(out, dtype=ctx["loss"].dtype)}, [out]
    )


def add_shard_number(interpreter, ctx, eqn, invals):
    """ctx['loss'] += the shard's number in mesh order: differs over `data` and `y`."""
    number = lax.axis_index("data") * 2 + lax.axis_index("y")
    return HandlerResult({**ctx, "loss": ctx["loss"] + number}, [jnp.sin(invals[0])])


def add_one_to_each(interpreter, ctx, eqn, invals):
    return HandlerResult(jax.tree.map(lambda v: v + 1, ctx), [jnp.sin(invals[0])])


def run_with(mesh, sin, ctx, user=user_per_shard, **options):
    interpreter = identity_with(
        sin=sin, shard_map=functools.partial(default_shard_map_handler, **options)
    )
    x = placed(mesh, X, P("data"))
    out, new_ctx = reinterpret(user, interpreter)(ctx, x, mesh)
    np.testing.assert_allclose(out, jnp.sin(X), rtol=1e-6)
    return new_ctx


SHARD_SUMS = np.asarray(jnp.sin(X)).reshape(4, 2).sum(axis=1)  # one per shard of `data`
OPTION = re.compile(
    r"`(reduce_ctx|declare_ctx_in_specs|declare_ctx_out_specs)=(lambda ctx: [^`]*)`"
)


def suggested(message: str) -> list[tuple[str, object]]:
    """Every option the message writes out as code, evaluated as the user would paste it."""
    namespace = {"jax": jax, "PartitionSpec": P}
    return [(name, eval(code, namespace)) for name, code in OPTION.findall(message)]


def spec_error(mesh, ctx, sin=add_one_to_each, user=user_per_shard, marker="SM_DATA", **options):
    return expect(ValueError, lambda: run_with(mesh, sin, ctx, user, **options), at(marker))


def test_in_spec_longer_than_a_scalar_leaf(data_mesh):
    message = spec_error(
        data_mesh, {"count": jnp.int32(0)}, declare_ctx_in_specs=lambda ctx: P(("data",))
    )
    for fragment in ("declare_ctx_in_specs", "ctx['count']", "shape ()", "P('data',)", "scalar"):
        assert fragment in message
    # The fix it names: replicate it.
    assert "`PartitionSpec()`" in message
    ctx = run_with(
        data_mesh, add_one_to_each, {"count": jnp.int32(0)}, declare_ctx_in_specs=lambda ctx: P()
    )
    assert int(ctx["count"]) == 1


def test_in_and_out_specs_longer_than_a_scalar_leaf(data_mesh):
    both = {
        "declare_ctx_in_specs": lambda ctx: P(("data",)),
        "declare_ctx_out_specs": lambda ctx: P(("data",)),
    }
    message = spec_error(data_mesh, {"count": jnp.int32(0)}, **both)
    # The other fix it names: one entry per shard, the specs kept.
    assert "shape (4,), one entry per shard, and keep this spec" in message
    ctx = run_with(
        data_mesh, add_one_to_each, {"count": placed(data_mesh, jnp.arange(4), P())}, **both
    )
    np.testing.assert_array_equal(ctx["count"], np.arange(4) + 1)


def test_out_spec_longer_than_a_varying_scalar_leaf(data_mesh):
    ctx = {"loss": jnp.float32(0)}
    message = spec_error(
        data_mesh, ctx, sin=add_loss, declare_ctx_out_specs=lambda ctx: P(("data",))
    )
    for fragment in ("declare_ctx_out_specs", "ctx['loss']", "per-shard shape ()", "scalar"):
        assert fragment in message
    (replicate_name, replicate), (keep_name, keep) = suggested(message)
    assert replicate_name == keep_name == "reduce_ctx"
    # Replicated: the spec PartitionSpec() and the suggested psum.
    assert "`PartitionSpec()`" in message
    out = run_with(
        data_mesh, add_loss, ctx, declare_ctx_out_specs=lambda ctx: P(), reduce_ctx=replicate
    )
    np.testing.assert_allclose(out["loss"], SHARD_SUMS.sum(), rtol=1e-5)
    # One value per shard: the suggested leading axis, the spec kept.
    assert "shape (4,)" in message
    out = run_with(
        data_mesh, add_loss, ctx, declare_ctx_out_specs=lambda ctx: P(("data",)), reduce_ctx=keep
    )
    np.testing.assert_allclose(out["loss"], SHARD_SUMS, rtol=1e-5)


def test_out_spec_longer_than_a_vector_leaf(data_mesh):
    ctx = {"loss": jnp.zeros(2)}
    message = spec_error(
        data_mesh, ctx, sin=add_loss, declare_ctx_out_specs=lambda ctx: P("data", None)
    )
    assert "it has 1 dimension" in message and "Give it at most 1" in message
    out = run_with(data_mesh, add_loss, ctx, declare_ctx_out_specs=lambda ctx: P("data"))
    np.testing.assert_allclose(out["loss"], np.repeat(SHARD_SUMS, 2), rtol=1e-5)
    # Or replicated, with the psum it writes out.
    [(name, reduce)] = suggested(message)
    assert name == "reduce_ctx" and "`PartitionSpec()`" in message
    out = run_with(
        data_mesh, add_loss, ctx, declare_ctx_out_specs=lambda ctx: P(), reduce_ctx=reduce
    )
    np.testing.assert_allclose(out["loss"], [SHARD_SUMS.sum()] * 2, rtol=1e-5)


def test_spec_naming_an_axis_not_in_the_mesh(data_mesh):
    ctx = {"count": jnp.zeros(8, jnp.int32)}
    message = spec_error(
        data_mesh,
        ctx,
        declare_ctx_in_specs=lambda ctx: P("dta"),
        declare_ctx_out_specs=lambda ctx: P("dta"),
    )
    assert "'dta' is not an axis of the mesh (did you mean 'data'?)" in message
    assert "('data', 'y')" in message and "shape (8,)" in message
    fixed = {
        "declare_ctx_in_specs": lambda ctx: P("data"),
        "declare_ctx_out_specs": lambda ctx: P("data"),
    }
    out = run_with(
        data_mesh, add_one_to_each, {"count": placed(data_mesh, ctx["count"], P())}, **fixed
    )
    np.testing.assert_array_equal(out["count"], np.ones(8))


def test_spec_naming_an_axis_that_is_not_manual(data_mesh):
    ctx = {"count": jnp.zeros(2, jnp.int32)}
    message = spec_error(
        data_mesh,
        ctx,
        user=user_per_shard_partial,
        marker="SM_PARTIAL",
        declare_ctx_in_specs=lambda ctx: P("y"),
    )
    assert "mesh axis 'y' is not a manual axis of this shard_map" in message
    assert "('data',)" in message and "leave 'y' out" in message
    out = run_with(
        data_mesh,
        add_one_to_each,
        ctx,
        user=user_per_shard_partial,
        declare_ctx_in_specs=lambda ctx: P(),
    )
    np.testing.assert_array_equal(out["count"], np.ones(2))


def test_spec_using_an_axis_twice(data_mesh):
    ctx = {"count": jnp.zeros((4, 4), jnp.int32)}
    both = {
        "declare_ctx_in_specs": lambda ctx: P("data", "data"),
        "declare_ctx_out_specs": lambda ctx: P("data", "data"),
    }
    message = spec_error(data_mesh, ctx, **both)
    assert "mesh axis 'data' is used more than once" in message
    assert "name it in one entry only" in message
    once = {
        "declare_ctx_in_specs": lambda ctx: P("data", None),
        "declare_ctx_out_specs": lambda ctx: P("data", None),
    }
    out = run_with(
        data_mesh, add_one_to_each, {"count": placed(data_mesh, ctx["count"], P())}, **once
    )
    np.testing.assert_array_equal(out["count"], np.ones((4, 4)))


def test_in_spec_that_does_not_divide_the_leaf(data_mesh):
    both = {
        "declare_ctx_in_specs": lambda ctx: P("data"),
        "declare_ctx_out_specs": lambda ctx: P("data"),
    }
    message = spec_error(data_mesh, {"count": jnp.zeros(6, jnp.int32)}, **both)
    assert "dimension 0 has size 6" in message and "4 shards of mesh axes ('data',)" in message
    # Fix one: pad to a multiple of 4.
    assert "multiple of 4" in message
    padded = placed(data_mesh, jnp.zeros(8, jnp.int32), P())
    out = run_with(data_mesh, add_one_to_each, {"count": padded}, **both)
    np.testing.assert_array_equal(out["count"], np.ones(8))
    # Fix two: replicate it.
    assert "replicate the leaf with `PartitionSpec()`" in message
    out = run_with(
        data_mesh,
        add_one_to_each,
        {"count": jnp.zeros(6, jnp.int32)},
        declare_ctx_in_specs=lambda ctx: P(),
    )
    np.testing.assert_array_equal(out["count"], np.ones(6))


def test_out_spec_need_not_divide_the_leaf(data_mesh):
    # Leaving, the shards' leaves are concatenated: any per-shard size fits.
    out = run_with(
        data_mesh,
        add_one_to_each,
        {"count": jnp.zeros(3, jnp.int32)},
        declare_ctx_out_specs=lambda ctx: P("data"),
    )
    np.testing.assert_array_equal(out["count"], np.ones(12))


def replication_error(mesh, ctx, sin=add_loss, **options):
    message = expect(
        ValueError,
        lambda: run_with(mesh, sin, ctx, **options),
        at("SM_DATA"),
        "differs between the shards",
        "ctx['loss']",
    )
    return message, suggested(message)


@pytest.mark.parametrize("others", [False, True], ids=["alone", "with_other_leaves"])
def test_varying_scalar_suggestions_work(data_mesh, others):
    ctx = {"loss": jnp.float32(0), **({"steps": jnp.int32(0), "name": "run"} if others else {})}
    message, options = replication_error(data_mesh, ctx)
    assert "a scalar has no dimension to shard" in message and "shape (4,)" in message
    # A psum also sums what the leaf entered with: the message says when it is right.
    assert "once per shard: right when it enters as zero" in message
    assert [name for name, _ in options] == ["reduce_ctx", "reduce_ctx", "declare_ctx_out_specs"]
    (_, reduce), *keep = options
    out = run_with(data_mesh, add_loss, ctx, reduce_ctx=reduce)
    np.testing.assert_allclose(out["loss"], SHARD_SUMS.sum(), rtol=1e-5)
    out_kept = run_with(data_mesh, add_loss, ctx, **dict(keep))
    np.testing.assert_allclose(out_kept["loss"], SHARD_SUMS, rtol=1e-5)
    if others:  # the other leaves untouched by either fix
        assert int(out["steps"]) == int(out_kept["steps"]) == 0
        assert out["name"] == out_kept["name"] == "run"


def test_scalar_varying_over_two_axes_suggestions_work(data_mesh):
    ctx = {"loss": jnp.int32(0)}
    message, options = replication_error(data_mesh, ctx, sin=add_shard_number)
    assert "('data', 'y')" in message and "shape (8,), entry i from shard i" in message
    (_, reduce), *keep = options
    out = run_with(data_mesh, add_shard_number, ctx, reduce_ctx=reduce)
    assert int(out["loss"]) == sum(range(8))
    out = run_with(data_mesh, add_shard_number, ctx, **dict(keep))
    np.testing.assert_array_equal(out["loss"], np.arange(8))


@pytest.mark.parametrize("others", [False, True], ids=["alone", "with_other_leaves"])
def test_varying_vector_suggestions_work(data_mesh, others):
    ctx = {"loss": jnp.zeros(2), **({"steps": jnp.int32(0)} if others else {})}
    message, options = replication_error(data_mesh, ctx)
    assert "concatenated along dimension 0" in message
    assert [name for name, _ in options] == ["reduce_ctx", "declare_ctx_out_specs"]
    (_, reduce), (_, declare) = options
    out = run_with(data_mesh, add_loss, ctx, reduce_ctx=reduce)
    np.testing.assert_allclose(out["loss"], [SHARD_SUMS.sum()] * 2, rtol=1e-5)
    out = run_with(data_mesh, add_loss, ctx, declare_ctx_out_specs=declare)
    np.testing.assert_allclose(out["loss"], np.repeat(SHARD_SUMS, 2), rtol=1e-5)
    if others:
        assert int(out["steps"]) == 0


@pytest.mark.parametrize(
    "collective, cause",
    [
        (lambda v: lax.psum(v, "dta"), AssertionError),
        (lambda v: lax.pmax(v, ("data", "dta")), AssertionError),
        (lambda v: lax.all_gather(v, "dta"), NameError),
        (lambda v: v + lax.axis_index("dta"), NameError),
    ],
    ids=["psum", "pmax_two_axes", "all_gather", "axis_index"],
)
@pytest.mark.parametrize("under_jit", [False, True])
def test_reduce_ctx_with_a_misspelled_axis(data_mesh, collective, cause, under_jit):
    interpreter = shard_map_with(reduce_ctx=lambda ctx: jax.tree.map(collective, ctx))
    wrapped = reinterpret(user_per_shard, interpreter)
    call = jax.jit(wrapped, static_argnums=2) if under_jit else wrapped
    x = placed(data_mesh, X, P("data"))
    with pytest.raises(ValueError, match=r"reduce_ctx for the shard_map .*'dta'") as info:
        call(jnp.float32(0), x, data_mesh)
    message = str(info.value)
    assert at("SM_DATA") in message
    assert "(did you mean 'data'?)" in message and "not a manual axis here" in message
    assert "('data', 'y') of this shard_map" in message and "enclosing" not in message
    causes = []  # JAX's own error is chained (behind JAX's note on where the op was traced)
    error = info.value.__cause__
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(type(error) is cause for error in causes), causes
    # The name it suggests works.
    fixed = shard_map_with(reduce_ctx=lambda ctx: jax.tree.map(lambda v: lax.psum(v, "data"), ctx))
    out, count = reinterpret(user_per_shard, fixed)(jnp.float32(0), x, data_mesh)
    np.testing.assert_allclose(out, jnp.sin(X), rtol=1e-6)
    assert float(count) == 4.0  # one sin per shard, summed over the 4 shards of data


def user_nested_shard_maps(x, mesh):
    def outer(block):
        inner = jax.shard_map(jnp.sin, in_specs=P(), out_specs=P(), axis_names={"y"})
        return inner(block)  # <SM_INNER>

    return jax.shard_map(
        outer, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}
    )(x)


def test_reduce_ctx_misspelled_axis_lists_the_enclosing_manual_axes(data_mesh):
    typo = shard_map_with(reduce_ctx=lambda ctx: jax.tree.map(lambda v: lax.psum(v, "yy"), ctx))
    x = placed(data_mesh, X, P("data"))
    expect(
        ValueError,
        lambda: reinterpret(user_nested_shard_maps, typo)(jnp.float32(0), x, data_mesh),
        at("SM_INNER"),
        "'yy' (did you mean 'y'?)",
        "('y',) of this shard_map and ('data',) of the enclosing shard_maps",
    )


@pytest.mark.parametrize(
    "reduce, error, text",
    [
        (
            lambda ctx: (_ for _ in ()).throw(AssertionError("the user's own")),
            AssertionError,
            "the user's own",
        ),
        (lambda ctx: undefined_name, NameError, "undefined_name"),  # noqa: F821
        (
            lambda ctx: jax.tree.map(lambda v: lax.all_gather(v, "x", axis=3), ctx),
            ValueError,
            "out of bounds",
        ),
    ],
    ids=["assertion", "name_error", "value_error"],
)
def test_reduce_ctx_other_errors_pass_through_unchanged(mesh, reduce, error, text):
    interpreter = shard_map_with(reduce_ctx=reduce)
    with pytest.raises(error, match=text) as info:
        reinterpret(user_shard_map, interpreter)(jnp.float32(0), X, mesh)
    assert "not a manual axis" not in str(info.value)


# ---------------------------------------------------------------- kups.harvest (issue 24)


def test_a_strict_sow_sown_twice_suggests_nest():
    def layer(x):
        return sow(jnp.tanh(x), tag="act", name="out")

    def model(x):
        return layer(layer(x))

    message = expect(
        ValueError,
        lambda: reap(model, tag="act")(jnp.float32(0.5)),
        "name 'out' of tag 'act' is sown twice with mode='strict'",
        "kups.harvest.nest(fn, scope=...)",
    )
    assert "test_errors.py" in message  # both sows are located in the user's file


def test_plant_of_a_filtered_out_name_does_not_contradict_itself():
    def f(x):
        return sow(x, tag="t", name="x") + sow(x, tag="t", name="y")

    message = expect(
        ValueError,
        lambda: plant(f, tag="t", blocklist=["x"])({"x": 1.0}, jnp.float32(2.0)),
        "plant(tag='t', blocklist=['x']) was given ['x'], which the function sows under tag "
        "'t' but allowlist/blocklist leave out",
        "that this call acts on are: ['y']",
    )
    assert "never sows" not in message
    message = expect(
        ValueError,
        lambda: plant(f, tag="t", allowlist=["y"])({"x": 1.0, "z": 2.0}, jnp.float32(2.0)),
        "['z'], which the function never sows under tag 't'",
        "['x'], which the function sows under tag 't' but allowlist/blocklist leave out",
    )
    assert "none" not in message


def returns_a_string(x):
    return "not an array"


RETURNS_A_STRING = (
    f"function returns_a_string at {__file__}:{returns_a_string.__code__.co_firstlineno}"
)


@pytest.mark.parametrize(
    "wrap, args",
    [
        (lambda f: reinterpret(f, Interpreter(default_dispatcher())), (0, 1.0)),
        (lambda f: reap(f, tag="t"), (1.0,)),
        (lambda f: plant(f, tag="t"), ({}, 1.0)),
        (lambda f: harvest(f, tag="t"), ({}, 1.0)),
        (lambda f: nest(f, scope="s"), (1.0,)),
        (lambda f: checked(f), (1.0,)),
        (lambda f: find_nans(f), (1.0,)),
        (lambda f: nan_sites(f), (1.0,)),
        (lambda f: count_primitives(f), (1.0,)),
        (lambda f: count_flops(f), (1.0,)),
    ],
    ids=[
        "reinterpret",
        "reap",
        "plant",
        "harvest",
        "nest",
        "checked",
        "find_nans",
        "nan_sites",
        "count_primitives",
        "count_flops",
    ],
)
def test_a_jitted_wrapper_of_a_function_with_a_bad_output_names_the_users_file(wrap, args):
    """JAX describes a traced function by its source; each wrapper is described by
    the user's function, as plain `jax.jit(f)` is, not by kups' or JAX's files."""
    with pytest.raises(TypeError) as plain:
        jax.jit(returns_a_string)(1.0)
    assert str(plain.value).startswith(RETURNS_A_STRING)
    wrapped = wrap(returns_a_string)
    with pytest.raises(TypeError) as info:
        jax.jit(wrapped)(*args)
    assert str(info.value).startswith(RETURNS_A_STRING), str(info.value)
    assert wrapped.__name__ == "returns_a_string"


def test_a_jitted_reap_grads_of_a_function_with_a_bad_output_says_what_jax_grad_says():
    with pytest.raises(TypeError) as plain:
        jax.jit(jax.grad(returns_a_string))(1.0)
    with pytest.raises(TypeError) as info:
        jax.jit(reap_grads(returns_a_string, tag="t"))(1.0)
    assert str(info.value) == str(plain.value)
    assert "kups" not in str(info.value)
