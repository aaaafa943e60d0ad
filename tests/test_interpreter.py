"""The interpreter's walk: source info, name stacks, freeing values, consts,
literals and dropped outputs."""

import contextlib
import functools
import gc
import inspect
import re
import sys
import traceback
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Literal, jaxprs_in_params

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    reinterpret,
    skip_when_untouched,
    source_line,
    source_location,
)

X = jnp.array([0.5, -1.5, 2.5, 0.25], jnp.float32)
LINES: dict[str, int] = {}


def _next_line() -> int:
    """The line after the caller's current one."""
    return sys._getframe(1).f_lineno + 1


def count_handler(interpreter, ctx, eqn, invals):
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    return HandlerResult(ctx + 1, result.outvals)


# ---------------------------------------------------------------------------
# Source info: errors and handlers see the user's line.
# ---------------------------------------------------------------------------


def user_fn(x):
    y = x * 2.0
    LINES["sin"] = _next_line()
    return jnp.sin(y)


def user_scan_fn(x):
    def body(carry, xi):
        LINES["scan_sin"] = _next_line()
        return carry + jnp.sin(xi), None

    return lax.scan(body, 0.0, x)[0]


class Boom(Exception):
    pass


def boom_handler(interpreter, ctx, eqn, invals):
    raise Boom(f"boom at {source_line(eqn)}")


def _user_frames(exc: BaseException) -> list[tuple[str, int]]:
    """Every (file, line) in the tracebacks of `exc` and its causes."""
    frames = []
    while exc is not None:
        frames += [(f.f_code.co_filename, line) for f, line in traceback.walk_tb(exc.__traceback__)]
        exc = exc.__cause__
    return frames


@pytest.mark.parametrize(("fn", "key"), [(user_fn, "sin"), (user_scan_fn, "scan_sin")])
def test_raising_handler_points_at_user_line(fn, key):
    interpreter = Interpreter(default_dispatcher().register_handler("sin", boom_handler))
    with pytest.raises(Boom) as info:
        reinterpret(fn, interpreter)(0, X)
    line = LINES[key]
    assert f"test_interpreter.py:{line}" in str(info.value)
    # The traceback JAX attaches (as it does for `eval_jaxpr`) ends at the user's line.
    assert (__file__, line) in _user_frames(info.value)
    formatted = "".join(traceback.format_exception(info.value))
    assert f'"{__file__}", line {line}' in formatted


def test_handler_sees_source_location():
    seen = []

    def handler(interpreter, ctx, eqn, invals):
        seen.append(source_location(eqn))
        return default_primitive_handler(interpreter, ctx, eqn, invals)

    interpreter = Interpreter(default_dispatcher().register_handler("sin", handler))
    reinterpret(user_fn, interpreter)(0, X)
    reinterpret(user_scan_fn, interpreter)(0, X)
    assert seen == [(__file__, LINES["sin"]), (__file__, LINES["scan_sin"])]


def test_rebind_error_points_at_user_line():
    """An equation that fails when re-bound (not in a handler) names the user's line."""

    def failing_callback(a):
        raise Boom("callback failed")

    def fn(x):
        LINES["bad"] = _next_line()
        return jax.pure_callback(failing_callback, x, x)

    with pytest.raises(Exception, match="callback failed") as info:
        reinterpret(fn, Interpreter(default_dispatcher()))(0, X)
    assert (__file__, LINES["bad"]) in _user_frames(info.value)


# ---------------------------------------------------------------------------
# Name stacks and source info of re-bound equations.
# ---------------------------------------------------------------------------


def scoped_fn(x):
    with jax.named_scope("outer_scope"):
        y = jnp.cos(x)

        def body(carry, xi):
            with jax.named_scope("body_scope"):
                return carry + jnp.exp(xi) + jnp.sin(xi), None

        z = lax.scan(body, 0.0, y)[0]
        w = jax.jit(lambda a: jnp.tanh(a) * 2.0)(z)
    with jax.named_scope("tail_scope"):
        LINES["tail"] = _next_line()
        return w + jnp.sin(y).sum()


def _eqns(jaxpr, prefix=()):
    for eqn in jaxpr.eqns:
        yield prefix, eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub, (*prefix, eqn.primitive.name))


def _stacks(fn, *args):
    """`{(enclosing primitives, primitive): name stack}` of every equation."""
    return {
        (where, eqn.primitive.name): str(eqn.source_info.name_stack)
        for where, eqn in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)
        if eqn.primitive.name
        in {"cos", "exp", "sin", "tanh", "log1p", "scan", "jit", "cond", "while", "remat2"}
        | {"reduce_sum"}
    }


@pytest.mark.parametrize("handle_sin", [False, True])
def test_rebound_equations_keep_name_stacks(handle_sin):
    dispatcher = default_dispatcher()
    if handle_sin:
        dispatcher.register_handler("sin", count_handler)
    interpreted = reinterpret(scoped_fn, Interpreter(dispatcher))
    stacks = _stacks(interpreted, 0, X)
    assert stacks[((), "cos")] == "outer_scope"
    assert stacks[((), "scan")] == "outer_scope"
    assert stacks[((), "jit")] == "outer_scope"
    assert stacks[(("scan",), "exp")] == "body_scope"
    assert stacks[(("scan",), "sin")] == "body_scope"
    assert stacks[((), "sin")] == "tail_scope"
    assert stacks[((), "reduce_sum")] == "tail_scope"
    # The oracle: the same stacks as the function traced by plain JAX.
    assert stacks == _stacks(scoped_fn, X)


def scoped_cond_while_fn(x):
    with jax.named_scope("outer_scope"):

        def branch(y):
            with jax.named_scope("in_cond"):
                return jnp.sin(y)

        def body(state):
            with jax.named_scope("in_while"):
                return state[0] + 1.0, jnp.exp(state[1])

        def condition(state):
            with jax.named_scope("in_condition"):
                return jnp.tanh(state[1][0]) < state[0]

        y = lax.cond(x[0] > 0, branch, lambda y: y, x)
        z = lax.while_loop(condition, body, (0.0, y))[1]
        return jax.checkpoint(lambda a: jnp.log1p(a))(z)


def test_name_stacks_in_cond_while_and_checkpoint_bodies():
    dispatcher = default_dispatcher().register_handler("sin", count_handler)
    interpreted = reinterpret(scoped_cond_while_fn, Interpreter(dispatcher))
    stacks = _stacks(interpreted, 0, X)
    assert stacks[(("cond",), "sin")] == "in_cond"
    assert stacks[(("while",), "exp")] == "in_while"
    assert stacks[(("while",), "tanh")] == "in_condition"
    assert stacks[((), "while")] == "outer_scope"
    assert stacks == _stacks(scoped_cond_while_fn, X)


def test_caller_name_scope_is_prefixed():
    interpreted = reinterpret(scoped_fn, Interpreter(default_dispatcher()))

    def caller(ctx, x):
        with jax.named_scope("caller"):
            return interpreted(ctx, x)

    stacks = _stacks(caller, 0, X)
    assert stacks[((), "cos")] == "caller/outer_scope"
    assert stacks[((), "sin")] == "caller/tail_scope"


def test_rebound_equations_keep_user_source_line():
    interpreted = reinterpret(scoped_fn, Interpreter(default_dispatcher()))
    jaxpr = jax.make_jaxpr(interpreted)(0, X).jaxpr
    (sin,) = [e for e in jaxpr.eqns if e.primitive.name == "sin"]
    assert source_location(sin) == (__file__, LINES["tail"])


# ---------------------------------------------------------------------------
# Values are freed after their last use.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _collecting_new_objects_only():
    """The objects of the tests run before set aside (`gc.freeze`), so that each
    `gc.collect()` inside looks at the objects made since (a full collection takes
    a second late in a run)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_values_freed_after_last_use():
    refs: dict[str, weakref.ref] = {}
    alive: dict[str, dict[str, bool]] = {}

    def record(name):
        def handler(interpreter, ctx, eqn, invals):
            gc.collect()
            alive[name] = {k: r() is not None for k, r in refs.items()}
            result = default_primitive_handler(interpreter, ctx, eqn, invals)
            refs[name] = weakref.ref(result.outvals[0])
            return result

        return handler

    def fn(x):
        a = jnp.sin(x)  # read only by cos
        b = jnp.cos(a)  # read by exp and by the final add
        jnp.log1p(x)  # never read
        c = jnp.exp(b)
        d = jnp.tanh(c)
        return d + b

    names = ["sin", "cos", "log1p", "exp", "tanh"]
    dispatcher = Dispatcher({name: record(name) for name in names})
    x = jnp.linspace(0.0, 1.0, 1024)
    with _collecting_new_objects_only():
        out, _ = reinterpret(fn, Interpreter(dispatcher))(0, x)
    np.testing.assert_allclose(out, fn(x), rtol=1e-6)
    assert alive["cos"] == {"sin": True}
    assert alive["log1p"] == {"sin": False, "cos": True}
    assert alive["exp"] == {"sin": False, "cos": True, "log1p": False}
    assert alive["tanh"] == {"sin": False, "cos": True, "log1p": False, "exp": True}


def test_live_arrays_do_not_grow_along_a_chain():
    counts = []

    def probe(interpreter, ctx, eqn, invals):
        gc.collect()
        counts.append(len(jax.live_arrays()))
        return default_primitive_handler(interpreter, ctx, eqn, invals)

    def chain(x):
        for _ in range(12):
            x = jnp.sin(x) * 1.5
        return x

    x = jnp.linspace(0.0, 1.0, 256)
    with _collecting_new_objects_only():
        out, _ = reinterpret(chain, Interpreter(Dispatcher({"sin": probe})))(0, x)
    np.testing.assert_allclose(out, chain(x), rtol=1e-5)
    assert len(counts) == 12
    # Each step's input replaces the previous one; nothing accumulates.
    assert max(counts) - min(counts) <= 1, counts


# ---------------------------------------------------------------------------
# Consts, literals, DropVar outputs.
# ---------------------------------------------------------------------------


def test_consts_reach_handlers_and_results():
    weights = jnp.array([1.0, -2.0, 3.0, 0.5])
    seen = []

    def mul_handler(interpreter, ctx, eqn, invals):
        if not isinstance(invals[0], jax.core.Tracer):
            seen.append([np.asarray(v) for v in invals])
        return count_handler(interpreter, ctx, eqn, invals)

    def fn(x):
        return x * weights + np.float32(1.0)

    closed = jax.make_jaxpr(fn)(X)
    assert len(closed.consts) == 1  # the test exercises constvars
    interpreter = Interpreter(Dispatcher({"mul": mul_handler}))
    outs, ctx = interpreter(closed, 0, X)
    np.testing.assert_allclose(outs[0], X * weights + 1.0)
    assert ctx == 1
    (recorded,) = seen
    np.testing.assert_array_equal(recorded[1], weights)
    out, ctx = jax.jit(reinterpret(fn, interpreter))(0, X)
    np.testing.assert_allclose(out, X * weights + 1.0)
    assert int(ctx) == 1


def test_open_jaxpr_with_constvars_is_not_accepted_silently():
    """An open `Jaxpr` has no const values; interpreting one without constvars works."""
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 1.0)(X)
    assert not closed.jaxpr.constvars
    outs, ctx = Interpreter(Dispatcher())(closed.jaxpr, "ctx", X)
    np.testing.assert_allclose(outs[0], jnp.sin(X) + 1.0)
    assert ctx == "ctx"


def test_literal_inputs_and_outputs():
    seen = []

    def add_handler(interpreter, ctx, eqn, invals):
        seen.append((type(eqn.invars[1]) is Literal, np.asarray(invals[1]).item()))
        return count_handler(interpreter, ctx, eqn, invals)

    def fn(x):
        return x, 2.5, x + 1.25

    closed = jax.make_jaxpr(fn)(X)
    assert type(closed.jaxpr.outvars[1]) is Literal
    outs, ctx = Interpreter(Dispatcher({"add": add_handler}))(closed, 0, X)
    np.testing.assert_array_equal(outs[0], X)
    assert float(outs[1]) == 2.5
    np.testing.assert_allclose(outs[2], X + 1.25)
    assert seen == [(True, 1.25)]
    assert ctx == 1


def _drop_second_output(closed: ClosedJaxpr, name: str) -> ClosedJaxpr:
    """`closed` with the second output of its `name` equation a DropVar, and only
    that equation's first output returned."""
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    (i,) = [k for k, e in enumerate(eqns) if e.primitive.name == name]
    kept, dropped = eqns[i].outvars[0], eqns[i].outvars[1]
    eqns[i] = eqns[i].replace(outvars=[kept, DropVar(dropped.aval), *eqns[i].outvars[2:]])
    return ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=[kept]), closed.consts)


def test_dropvar_output_of_rebound_equation():
    closed = _drop_second_output(jax.make_jaxpr(lambda x: jnp.split(x, 2))(X), "split")
    outs, ctx = Interpreter(Dispatcher())(closed, 0, X)
    np.testing.assert_array_equal(outs[0], X[:2])
    assert ctx == 0


def test_dropvar_output_of_handled_equation():
    calls = []

    def split_handler(interpreter, ctx, eqn, invals):
        calls.append(len(eqn.outvars))
        return count_handler(interpreter, ctx, eqn, invals)

    closed = _drop_second_output(jax.make_jaxpr(lambda x: jnp.split(x, 2))(X), "split")
    outs, ctx = Interpreter(Dispatcher({"split": split_handler}))(closed, 0, X)
    np.testing.assert_array_equal(outs[0], X[2:] * 0 + X[:2])
    assert calls == [2] and ctx == 1


def test_dropvar_output_of_control_flow():
    def fn(x):
        return lax.scan(lambda c, xi: (c + jnp.sin(xi), c * xi), 0.0, x)

    closed = _drop_second_output(jax.make_jaxpr(fn)(X), "scan")
    dispatcher = default_dispatcher().register_handler("sin", count_handler)
    outs, ctx = Interpreter(dispatcher)(closed, 0, X)
    np.testing.assert_allclose(outs[0], jnp.sum(jnp.sin(X)), rtol=1e-6)
    assert int(ctx) == X.shape[0]


# ---------------------------------------------------------------------------
# The call itself.
# ---------------------------------------------------------------------------


def test_wrong_number_of_arguments():
    closed = jax.make_jaxpr(lambda x, y: x + y)(X, X)
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        Interpreter(Dispatcher())(closed, 0, X)


def test_policy_must_be_an_interpreter_policy():
    with pytest.raises(TypeError, match="InterpreterPolicy"):
        Interpreter(Dispatcher(), policy="raise")
    assert Interpreter(Dispatcher(), InterpreterPolicy.WARN).policy is InterpreterPolicy.WARN


def test_label_appears_in_errors_and_repr():
    interpreter = Interpreter(Dispatcher(), label="my-effect")
    assert "my-effect" in repr(interpreter)
    with pytest.raises(NotImplementedError, match="my-effect"):
        reinterpret(jax.jit(jnp.sin), interpreter)(0, X)


def test_context_is_any_pytree_and_passes_through_untouched():
    ctx = {"name": "static", "fn": jnp.sin, "values": (jnp.zeros(2), None)}
    out, new_ctx = reinterpret(lambda x: jnp.sin(x) * 2.0, Interpreter(default_dispatcher()))(
        ctx, X
    )
    np.testing.assert_allclose(out, jnp.sin(X) * 2.0)
    assert new_ctx is ctx


def test_interpreting_an_interpreted_function():
    inner = reinterpret(
        user_fn, Interpreter(default_dispatcher().register_handler("sin", count_handler))
    )
    outer_interpreter = Interpreter(default_dispatcher().register_handler("sin", count_handler))
    (out, inner_ctx), outer_ctx = reinterpret(inner, outer_interpreter)(10, 0, X)
    np.testing.assert_allclose(out, jnp.sin(X * 2.0), rtol=1e-6)
    assert int(inner_ctx) == 1
    # The outer interpreter sees the sin that the inner handler binds.
    assert int(outer_ctx) == 11


@jax.custom_jvp
def _soft(x):
    return jnp.log1p(jnp.exp(x))


_soft.defjvp(lambda p, t: (_soft(p[0]), jax.nn.sigmoid(p[0]) * t[0]))


@jax.custom_vjp
def _scaled(x):
    return x * 3.0


_scaled.defvjp(lambda x: (_scaled(x), None), lambda _, g: (g * 3.0,))


def every_control_flow(x, with_while=True):
    y = jax.jit(jnp.sin)(x)
    y = lax.scan(lambda c, xi: (c + xi, c * xi), 0.0, y)[1]
    y = lax.cond(jnp.sum(y) > 0, jnp.cos, jnp.sin, y)
    if with_while:  # not reverse-differentiable
        y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.9), (0, y))[1]
    y = jax.checkpoint(jnp.tanh)(y)
    return jnp.sum(_scaled(_soft(y)))


def test_ignore_policy_rebinds_every_control_flow_primitive():
    """With no handler at all, IGNORE re-binds each control-flow equation through
    `get_bind_params` (custom_jvp/custom_vjp included), and `grad` still works."""
    interpreted = reinterpret(
        every_control_flow, Interpreter(Dispatcher(), InterpreterPolicy.IGNORE)
    )
    out, ctx = interpreted("ctx", X)
    np.testing.assert_allclose(out, every_control_flow(X), rtol=1e-6)
    assert ctx == "ctx"
    grad = jax.grad(lambda x: interpreted("ctx", x, with_while=False)[0])(X)
    want = jax.grad(lambda x: every_control_flow(x, with_while=False))(X)
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    out_jit = jax.jit(lambda x: interpreted("ctx", x)[0])(X)
    np.testing.assert_allclose(out_jit, every_control_flow(X), rtol=1e-6)


def test_raise_policy_names_the_first_unhandled_primitive():
    with pytest.raises(NotImplementedError, match="'jit'"):
        reinterpret(every_control_flow, Interpreter(Dispatcher()))(0, X)
    dispatcher = Dispatcher({"jit": default_dispatcher().handler_for("jit")})
    with pytest.raises(NotImplementedError, match="'scan'"):
        reinterpret(every_control_flow, Interpreter(dispatcher))(0, X)


# ---------------------------------------------------------------------------
# The wrapped function looks like the user's, with a leading context.
# ---------------------------------------------------------------------------


def affine(x, y, scale=2.0):
    """Scales x and adds y."""
    return x * scale + y


def identity_wrap(fn):
    return reinterpret(fn, Interpreter(default_dispatcher()))


def test_wrapped_signature_is_the_users_with_a_leading_ctx():
    wrapped = identity_wrap(affine)
    assert str(inspect.signature(wrapped)) == "(ctx, /, x, y, scale=2.0)"
    assert wrapped.__name__ == "affine"
    assert wrapped.__qualname__ == "affine"
    assert wrapped.__doc__ == "Scales x and adds y."
    assert wrapped.__module__ == __name__
    assert not hasattr(wrapped, "__wrapped__")
    # A parameter of the user's named ctx keeps its name; the context's changes.
    uses_ctx = identity_wrap(lambda ctx, x: ctx * x)
    assert str(inspect.signature(uses_ctx)) == "(ctx_, /, ctx, x)"
    np.testing.assert_allclose(uses_ctx(None, 2.0, X)[0], 2.0 * X)

    # The wrapper returns (out, ctx): the user's return annotation is not its own.
    def annotated(x: jax.Array) -> jax.Array:
        return x

    signature = inspect.signature(identity_wrap(annotated))
    assert list(signature.parameters) == ["ctx", "x"]
    assert signature.parameters["x"].annotation is jax.Array
    assert signature.return_annotation is inspect.Signature.empty
    # A callable without a readable signature.
    assert str(inspect.signature(identity_wrap(max))) == "(ctx, /, *args, **kwargs)"
    # A partial: its remaining parameters, the function's name and doc.
    partial = identity_wrap(functools.partial(affine, scale=3.0))
    assert str(inspect.signature(partial)) == "(ctx, /, x, y, *, scale=3.0)"
    assert partial.__name__ == "affine" and partial.__doc__ == affine.__doc__
    np.testing.assert_allclose(partial(0, X, X)[0], 4.0 * X)


def test_wrapped_equinox_module_reads_its_call_signature():
    class Scale(eqx.Module):
        weight: jax.Array

        def __call__(self, x, bias=0.0):
            return self.weight * x + bias

    wrapped = identity_wrap(Scale(jnp.float32(3.0)))
    assert str(inspect.signature(wrapped)) == "(ctx, /, x, bias=0.0)"
    assert wrapped.__name__ == "Scale"
    np.testing.assert_allclose(wrapped(0, X)[0], 3.0 * X)


def test_jit_donate_argnums_of_the_wrapped_function():
    wrapped = identity_wrap(affine)
    x, y = jnp.array(X), jnp.array(X)
    out, ctx = jax.jit(wrapped, donate_argnums=2)(jnp.int32(0), x, y)
    np.testing.assert_allclose(out, X * 2.0 + X)
    assert int(ctx) == 0
    assert y.is_deleted() and not x.is_deleted()  # the donated buffer is y's, not x's
    # By name too, as jax.jit resolves it through the signature.
    x, y = jnp.array(X), jnp.array(X)
    jax.jit(wrapped, donate_argnames="x")(jnp.int32(0), x, y)
    assert x.is_deleted() and not y.is_deleted()


def test_jit_static_argnums_of_the_wrapped_function():
    traced = []

    def scaled(x, scale):
        traced.append(scale)
        return x * scale

    jitted = jax.jit(identity_wrap(scaled), static_argnums=2)
    np.testing.assert_allclose(jitted(0, X, 3.0)[0], 3.0 * X)
    np.testing.assert_allclose(jitted(0, X, 3.0)[0], 3.0 * X)
    np.testing.assert_allclose(jitted(0, X, 4.0)[0], 4.0 * X)
    assert traced == [3.0, 4.0]  # static: one trace per value, as a Python float
    by_name = jax.jit(identity_wrap(scaled), static_argnames="scale")
    np.testing.assert_allclose(by_name(0, X, scale=5.0)[0], 5.0 * X)


def test_equinox_filter_jit_takes_the_wrapped_function():
    class Linear(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            return self.weight * x

    wrapped = identity_wrap(Linear(jnp.float32(2.0)))
    with warnings.catch_warnings():
        # equinox warns when a function field leads through `__wrapped__` to arrays.
        warnings.simplefilter("error")
        out, ctx = eqx.filter_jit(wrapped)(jnp.int32(0), X)
    np.testing.assert_allclose(out, 2.0 * X)
    assert int(ctx) == 0


# ---------------------------------------------------------------------------
# skip_when_untouched
# ---------------------------------------------------------------------------


def _scans(x):
    """Two scans: the first binds a `sin`, the second only a `cos`."""
    x = lax.scan(lambda c, v: (c + jnp.sin(v), v), 0.0, x)[0]
    return lax.scan(lambda c, v: (c * jnp.cos(v), v), x, X)[0]


def _calls_counted(handler, calls):
    def counting(interpreter, ctx, eqn, invals):
        calls.append(eqn.primitive.name)
        return handler(interpreter, ctx, eqn, invals)

    return counting


@pytest.mark.parametrize("marked", [False, True])
def test_a_marked_handler_is_not_called_for_a_body_no_handler_touches(marked):
    calls = []
    scan = _calls_counted(default_scan_handler, calls)
    dispatcher = default_dispatcher().register_handler(
        "scan", skip_when_untouched(scan) if marked else scan
    )
    dispatcher.register_handler("sin", count_handler)
    out, count = jax.jit(reinterpret(_scans, Interpreter(dispatcher)))(0, X)
    assert int(count) == 4  # one sin per iteration of the first scan
    np.testing.assert_array_equal(out, jax.jit(_scans)(X))
    # Unmarked, the handler runs for both scans; marked, only for the one with a sin.
    assert calls == (["scan"] if marked else ["scan", "scan"])


def test_skip_when_untouched_keeps_the_handler_and_refuses_what_is_not_one():
    marked = skip_when_untouched(count_handler)
    assert skip_when_untouched(marked) is marked
    assert marked.__wrapped__ is count_handler and "count_handler" in repr(marked)
    with pytest.raises(TypeError, match="skip_when_untouched needs a handler"):
        skip_when_untouched("scan")


# ---------------------------------------------------------------------------
# Runs of equations no handler touches, staged as one call
# ---------------------------------------------------------------------------


def _chain(x, n=24):
    """`n` equations, one `lax` call each."""
    for i in range(n):
        x = lax.sin(x) if i % 3 == 0 else (lax.mul(x, x) if i % 3 == 1 else lax.add(x, 1.5))
    return x


def _runs_program(x):
    return _chain(lax.cumsum(_chain(x)))


def _rebind(interpreter, ctx, eqn, invals):
    """Touches its equation (it is the user's), and leaves the context as it is."""
    return default_primitive_handler(interpreter, ctx, eqn, invals)


def _untouched_calls(jaxpr):
    return [e for e in jaxpr.eqns if e.params.get("name") == "kups_untouched"]


def _names(jaxpr):
    return [e.primitive.name for e in jaxpr.eqns]


def _hlo_ops(fn, *args):
    """The opcodes of `fn`'s optimized HLO, in order (names and metadata left out)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    return re.findall(r"= \S+ ([a-z][a-z0-9\-]*)\(", entry)


def test_a_long_run_no_handler_touches_is_staged_as_one_call():
    interpreted = reinterpret(
        _runs_program, Interpreter(default_dispatcher().register_handler("cumsum", _rebind))
    )
    staged = jax.make_jaxpr(interpreted)(None, X)
    calls = _untouched_calls(staged)
    # Before and after the handled cumsum: one call each, holding the user's
    # equations as they were traced.
    assert _names(staged) == [calls[0].primitive.name, "cumsum", calls[0].primitive.name]
    plain = jax.make_jaxpr(_runs_program)(X)
    inner = [next(iter(jaxprs_in_params(call.params))) for call in calls]
    assert [*_names(inner[0]), "cumsum", *_names(inner[1])] == _names(plain)
    assert [e.source_info.traceback.frames[0].line_num for e in inner[0].eqns] == [
        e.source_info.traceback.frames[0].line_num for e in plain.jaxpr.eqns[:24]
    ]
    # XLA inlines the calls: the compiled program is the user's, bit for bit.
    assert _hlo_ops(lambda x: interpreted(None, x)[0], X) == _hlo_ops(_runs_program, X)
    np.testing.assert_array_equal(jax.jit(interpreted)(None, X)[0], jax.jit(_runs_program)(X))
    # Transformations see through the calls.
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(lambda x: interpreted(None, x)[0]))(X[None]),
        jax.jit(jax.vmap(_runs_program))(X[None]),
    )
    np.testing.assert_array_equal(
        jax.jit(jax.grad(lambda x: interpreted(None, x)[0].sum()))(X),
        jax.jit(jax.grad(lambda x: _runs_program(x).sum()))(X),
    )


def test_a_run_with_an_equation_jax_lowers_to_others_compiles():
    # `jnp.nonzero(..., size=)` is a "hijax" equation from JAX 0.12: JAX lowers it
    # to other equations before compiling, which a run bound as one call would
    # have to ask for. It is bound on its own, between runs.
    def program(x):
        first = jnp.nonzero(x > 0, size=2)[0]
        return _chain(lax.cumsum(_chain(x))) + x[first].sum()

    interpreted = reinterpret(
        program, Interpreter(default_dispatcher().register_handler("cumsum", _rebind))
    )
    x = X.at[0].set(-1.0)
    np.testing.assert_array_equal(jax.jit(interpreted)(None, x)[0], jax.jit(program)(x))
    scanned = reinterpret(
        lambda xs: lax.scan(lambda c, x: (c + program(x).sum(), None), 0.0, xs)[0],
        Interpreter(default_dispatcher().register_handler("cumsum", _rebind)),
    )
    xs = jnp.stack([x, X])
    expected = jax.jit(lambda xs: lax.scan(lambda c, x: (c + program(x).sum(), None), 0.0, xs)[0])
    np.testing.assert_array_equal(scanned(None, xs)[0], expected(xs))


def test_the_context_threads_past_staged_runs():
    interpreted = reinterpret(
        _runs_program, Interpreter(default_dispatcher().register_handler("cumsum", count_handler))
    )
    out, count = jax.jit(interpreted)(0, X)
    assert int(count) == 1
    np.testing.assert_array_equal(out, jax.jit(_runs_program)(X))


def test_runs_are_not_staged_in_an_identity_interpretation_nor_eagerly(monkeypatch):
    identity = reinterpret(_runs_program, Interpreter(default_dispatcher()))
    assert _names(jax.make_jaxpr(identity)(None, X)) == _names(jax.make_jaxpr(_runs_program)(X))
    # Eagerly, each equation runs on its own, as in the user's program.
    from kups.effects import _compat

    calls = []
    monkeypatch.setattr(_compat, "call_jaxpr", lambda *a: calls.append(a) or [])
    interpreted = reinterpret(
        _runs_program, Interpreter(default_dispatcher().register_handler("cumsum", _rebind))
    )
    np.testing.assert_array_equal(interpreted(None, X)[0], _runs_program(X))
    assert calls == []


def test_runs_stop_at_effects_and_short_ones_are_rebound():
    def program(x):
        x = _chain(x, 20)
        jax.debug.callback(lambda v: None, x, ordered=True)
        x = lax.cumsum(_chain(x, 20))
        return _chain(x, 4)  # too short to be worth a call

    interpreted = reinterpret(
        program, Interpreter(default_dispatcher().register_handler("cumsum", _rebind))
    )
    staged = jax.make_jaxpr(interpreted)(None, X)
    jit_name = _untouched_calls(staged)[0].primitive.name
    assert _names(staged) == [
        jit_name,
        "debug_callback",
        jit_name,
        "cumsum",
        *_names(jax.make_jaxpr(lambda x: _chain(x, 4))(X)),
    ]
    np.testing.assert_array_equal(jax.jit(interpreted)(None, X)[0], jax.jit(program)(X))


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_runs_inside_shard_map_and_under_a_mesh(axis_type):
    kind = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((8,), ("i",), axis_types=(kind,))
    P = jax.sharding.PartitionSpec

    def body(x):
        return _runs_program(x) * lax.axis_index("i")

    def program(x):
        x = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
        # Across the sharded axis, not along it (Explicit sharding forbids that).
        return _chain(lax.cumsum(_chain(x.reshape(8, 2)), axis=1))

    x = jax.device_put(jnp.linspace(-1.0, 1.0, 16), jax.NamedSharding(mesh, P("i")))
    interpreted = reinterpret(
        program, Interpreter(default_dispatcher().register_handler("cumsum", count_handler))
    )
    with jax.set_mesh(mesh) if axis_type == "explicit" else contextlib.nullcontext():
        out, count = jax.jit(interpreted)(0, x)
        expected = jax.jit(program)(x)
        staged = jax.make_jaxpr(interpreted)(0, x)
    assert int(count) == 2  # one cumsum in the body (the same on every shard), one after
    np.testing.assert_array_equal(out, expected)
    assert out.sharding.is_equivalent_to(expected.sharding, 1)
    assert len(_untouched_calls(staged)) == 2
    (shard_map,) = [e for e in staged.eqns if e.primitive.name == "shard_map"]
    assert len(_untouched_calls(next(iter(jaxprs_in_params(shard_map.params))))) == 2


def _opaque_sin(interpreter, ctx, eqn, invals):
    interpreter.cannot_enter(eqn, "count", "what it runs is not counted")
    return default_primitive_handler(interpreter, ctx, eqn, invals)


@pytest.mark.parametrize("hint", [None, "my_count(fn, policy=...)"])
def test_cannot_enter_follows_the_policy_and_names_the_way_out(hint):
    def f(x):
        return jnp.sin(x) * 2.0  # sin-here

    closed = jax.make_jaxpr(f)(1.0)
    dispatcher = default_dispatcher().register_handler("sin", _opaque_sin)

    def run(policy):
        interpreter = Interpreter(dispatcher, policy, "my_count", policy_hint=hint)
        return interpreter(closed, None, 1.0)[0][0]

    with pytest.raises(NotImplementedError) as raised:
        run(InterpreterPolicy.RAISE)
    message = str(raised.value)
    with open(__file__) as source:
        lines = source.read().splitlines()
    sin_line = next(i for i, text in enumerate(lines, 1) if text.endswith("# sin-here"))
    assert re.match(
        rf"my_count cannot count inside the primitive 'sin' at \S*test_interpreter.py:{sin_line}:",
        message,
    )
    assert ": what it runs is not counted. To run it unchanged and go on, " in message
    assert (hint or "build the Interpreter with policy=InterpreterPolicy.IGNORE") in message
    with pytest.warns(UserWarning, match=r"my_count cannot count inside .* runs unchanged"):
        assert run(InterpreterPolicy.WARN) == f(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(InterpreterPolicy.IGNORE) == f(1.0)
