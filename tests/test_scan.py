"""`default_scan_handler`: CARRY and RESULT threading, initializers, updaters,
zero-length scans, `reverse`, `unroll`, consts, several carries and xs, and its
errors. Expected values come from plain JAX or are computed by hand."""

import functools
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kups.effects import (
    HandlerResult,
    Interpreter,
    ScanSemantics,
    Uninitialized,
    default_dispatcher,
    default_scan_handler,
    reinterpret,
)

XS = jnp.array([0.5, -1.0, 2.0, 0.25, 1.5], jnp.float32)
LINES: dict[str, int] = {}


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def count_sin(interpreter, ctx, eqn, invals):
    """`ctx` is a number: one more per `sin`."""
    return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


def count_sin_dict(interpreter, ctx, eqn, invals):
    """`ctx["count"]` one more per `sin`; other leaves untouched."""
    return HandlerResult({**ctx, "count": ctx["count"] + 1}, [jnp.sin(invals[0])])


def record_sin(interpreter, ctx, eqn, invals):
    """Counts `sin` and stores its latest output in a new leaf `ctx["last"]`."""
    y = jnp.sin(invals[0])
    return HandlerResult({**ctx, "count": ctx["count"] + 1, "last": y}, [y])


def zeros_like_new(ctx_before, sentinel):
    """An initializer: every Uninitialized leaf becomes zeros."""
    return jax.tree.map(
        lambda leaf: jnp.zeros(leaf.shape, leaf.dtype) if isinstance(leaf, Uninitialized) else leaf,
        sentinel,
        is_leaf=lambda leaf: isinstance(leaf, Uninitialized),
    )


def interpreter_with(sin_handler, **scan_options):
    dispatcher = default_dispatcher().register_handler("sin", sin_handler)
    if scan_options:
        dispatcher.register_handler("scan", functools.partial(default_scan_handler, **scan_options))
    return Interpreter(dispatcher)


def sum_sin(xs, *, reverse=False, unroll=1):
    """carry_{i+1} = carry_i + sin(xs[i]); ys[i] = carry_i * xs[i]."""

    def body(carry, x):
        return carry + jnp.sin(x), carry * x

    return lax.scan(body, jnp.zeros(xs.shape[1:], xs.dtype), xs, reverse=reverse, unroll=unroll)


# ---------------------------------------------------------------------------
# CARRY with a context of fixed structure.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ctx0", [0, jnp.int32(7), np.int32(2)])
def test_carry_counter(ctx0):
    out, ctx = reinterpret(sum_sin, interpreter_with(count_sin))(ctx0, XS)
    expected = sum_sin(XS)
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-6)
    np.testing.assert_allclose(out[1], expected[1], rtol=1e-6)
    assert int(ctx) == int(ctx0) + XS.shape[0]


def test_carry_counter_under_jit():
    out, ctx = jax.jit(reinterpret(sum_sin, interpreter_with(count_sin)))(jnp.int32(1), XS)
    np.testing.assert_allclose(out[0], jnp.sum(jnp.sin(XS)), rtol=1e-6)
    assert int(ctx) == 1 + XS.shape[0]


def test_carry_context_with_static_leaves_and_module():
    class Ctx(eqx.Module):
        count: jax.Array
        label: str = eqx.field(static=True)
        activation: object = jnp.tanh

    def handler(interpreter, ctx, eqn, invals):
        return HandlerResult(
            Ctx(ctx.count + 1, ctx.label, ctx.activation), [ctx.activation(jnp.sin(invals[0]))]
        )

    out, ctx = reinterpret(sum_sin, interpreter_with(handler))(Ctx(jnp.int32(0), "run"), XS)
    assert isinstance(ctx, Ctx) and ctx.label == "run" and ctx.activation is jnp.tanh
    assert int(ctx.count) == XS.shape[0]
    np.testing.assert_allclose(out[0], jnp.sum(jnp.tanh(jnp.sin(XS))), rtol=1e-6)


def test_carry_value_depends_on_iteration():
    """The context is a true loop carry: each iteration sees the previous one's."""

    def handler(interpreter, ctx, eqn, invals):
        y = jnp.sin(invals[0])
        return HandlerResult(ctx * 2.0 + y, [y])

    _out, ctx = reinterpret(sum_sin, interpreter_with(handler))(1.0, XS)
    expected = 1.0
    for x in np.asarray(XS):
        expected = expected * 2.0 + np.sin(x)
    np.testing.assert_allclose(ctx, expected, rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 2, True])
def test_carry_reverse_and_unroll(reverse, unroll):
    fn = functools.partial(sum_sin, reverse=reverse, unroll=unroll)

    def handler(interpreter, ctx, eqn, invals):
        # The context records the order in which iterations ran.
        y = jnp.sin(invals[0])
        return HandlerResult({"order": ctx["order"] * 10.0 + invals[0]}, [y])

    xs = jnp.array([1.0, 2.0, 3.0])
    out, ctx = reinterpret(fn, interpreter_with(handler))({"order": 0.0}, xs)
    expected = fn(xs)
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-6)
    np.testing.assert_allclose(out[1], expected[1], rtol=1e-6)
    assert float(ctx["order"]) == (321.0 if reverse else 123.0)


def test_consts_multiple_carries_and_xs():
    def fn(xs, ws, scale, shift):
        def body(carry, x):
            a, b = carry
            x1, x2 = x
            a = a * scale + jnp.sin(x1)  # scale, shift: consts of the body
            b = b + jnp.sin(x2 * shift)
            return (a, b), (a - b, x1 * b)

        return lax.scan(body, (jnp.zeros(2), jnp.ones(2)), (xs, ws))

    xs = jnp.arange(12.0).reshape(6, 2) / 7.0
    ws = jnp.cos(jnp.arange(12.0)).reshape(6, 2)
    scale, shift = jnp.array([0.5, 1.5]), jnp.float32(0.75)
    interpreted = reinterpret(fn, interpreter_with(count_sin))
    out, ctx = interpreted(0, xs, ws, scale, shift)
    expected = fn(xs, ws, scale, shift)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(ctx) == 2 * 6
    out_jit, ctx_jit = jax.jit(interpreted)(0, xs, ws, scale, shift)
    for got, want in zip(jax.tree.leaves(out_jit), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(ctx_jit) == 12


def test_scan_without_xs():
    def fn(x):
        return lax.scan(lambda c, _: (jnp.sin(c), c), x, None, length=4)

    out, ctx = reinterpret(fn, interpreter_with(count_sin))(0, jnp.float32(1.0))
    expected = fn(jnp.float32(1.0))
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-6)
    np.testing.assert_allclose(out[1], expected[1], rtol=1e-6)
    assert int(ctx) == 4


@pytest.mark.parametrize("threading", [ScanSemantics.CARRY, ScanSemantics.RESULT])
def test_zero_length_fixed_structure(threading):
    xs = jnp.zeros((0, 3))
    out, ctx = reinterpret(sum_sin, interpreter_with(count_sin_dict, threading=threading))(
        {"count": jnp.int32(4)}, xs
    )
    assert out[0].shape == (3,) and out[1].shape == (0, 3)
    np.testing.assert_array_equal(out[0], jnp.zeros(3))
    assert int(ctx["count"]) == 4
    assert set(ctx) == {"count"}


# ---------------------------------------------------------------------------
# CARRY where the body adds leaves: initializer and updater.
# ---------------------------------------------------------------------------


def test_initializer_receives_sentinel():
    calls = []

    def initializer(ctx_before, sentinel):
        calls.append((ctx_before, sentinel))
        return zeros_like_new(ctx_before, sentinel)

    xs = jnp.ones((5, 2))
    ctx0 = {"count": jnp.int32(3), "tag": "static"}
    out, ctx = reinterpret(sum_sin, interpreter_with(record_sin, initializer=initializer))(ctx0, xs)
    assert len(calls) == 1
    ctx_before, sentinel = calls[0]
    assert ctx_before is ctx0
    assert set(sentinel) == {"count", "tag", "last"}
    assert sentinel["tag"] == "static"
    # Leaves that existed before the loop hold their value from before the loop.
    assert int(sentinel["count"]) == 3
    # The new leaf is Uninitialized with the body's shape and dtype.
    assert isinstance(sentinel["last"], Uninitialized)
    assert isinstance(sentinel["last"], jax.ShapeDtypeStruct)
    assert sentinel["last"].shape == (2,) and sentinel["last"].dtype == jnp.float32
    # CARRY with the default updater: `last` is the last iteration's sin.
    assert int(ctx["count"]) == 3 + 5
    np.testing.assert_allclose(ctx["last"], jnp.sin(xs[-1]), rtol=1e-6)
    assert ctx["tag"] == "static"
    np.testing.assert_allclose(out[0], jnp.sum(jnp.sin(xs), axis=0), rtol=1e-6)


def test_initializer_values_are_used():
    def initializer(ctx_before, sentinel):
        return {**sentinel, "count": jnp.int32(100), "last": jnp.full((2,), 9.0)}

    _out, ctx = reinterpret(sum_sin, interpreter_with(record_sin, initializer=initializer))(
        {"count": jnp.int32(3)}, jnp.ones((4, 2))
    )
    assert int(ctx["count"]) == 104


def test_updater_merges_each_iteration():
    seen = []

    def updater(carried, new):
        seen.append((set(carried), set(new)))
        return {**new, "last": carried["last"] + new["last"]}  # a running sum

    xs = jnp.arange(10.0).reshape(5, 2) / 3.0
    interpreter = interpreter_with(record_sin, initializer=zeros_like_new, updater=updater)
    _out, ctx = reinterpret(sum_sin, interpreter)({"count": jnp.int32(0)}, xs)
    np.testing.assert_allclose(ctx["last"], jnp.sum(jnp.sin(xs), axis=0), rtol=1e-5)
    assert int(ctx["count"]) == 5
    assert seen and all(s == ({"count", "last"}, {"count", "last"}) for s in seen)
    _out_jit, ctx_jit = jax.jit(reinterpret(sum_sin, interpreter))({"count": jnp.int32(0)}, xs)
    np.testing.assert_allclose(ctx_jit["last"], jnp.sum(jnp.sin(xs), axis=0), rtol=1e-5)


def test_updater_on_fixed_structure():
    """An updater also applies when the body keeps the context's structure."""

    def updater(carried, new):
        return jnp.maximum(carried, new * 2)

    _out, ctx = reinterpret(sum_sin, interpreter_with(count_sin, updater=updater))(jnp.int32(1), XS)
    expected = 1
    for _ in range(XS.shape[0]):
        expected = max(expected, (expected + 1) * 2)
    assert int(ctx) == expected


def test_zero_length_returns_initializer_context():
    def initializer(ctx_before, sentinel):
        return {**sentinel, "last": jnp.full(sentinel["last"].shape, -3.0)}

    _out, ctx = reinterpret(sum_sin, interpreter_with(record_sin, initializer=initializer))(
        {"count": jnp.int32(5)}, jnp.zeros((0, 2))
    )
    assert int(ctx["count"]) == 5
    np.testing.assert_array_equal(ctx["last"], jnp.full((2,), -3.0))


def test_initializer_only_called_when_structure_changes():
    calls = []

    def initializer(ctx_before, sentinel):
        calls.append(1)
        return sentinel

    reinterpret(sum_sin, interpreter_with(count_sin, initializer=initializer))(0, XS)
    assert calls == []


# ---------------------------------------------------------------------------
# RESULT: new leaves stacked, entry i belonging to xs[i]; old leaves carried.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_result_stacks_new_leaves_aligned_with_xs(reverse):
    def fn(xs):
        return lax.scan(lambda c, x: (c + 1.0, jnp.sin(x) * 2.0), 0.0, xs, reverse=reverse)

    xs = jnp.arange(12.0).reshape(6, 2) / 5.0
    interpreter = interpreter_with(record_sin, threading=ScanSemantics.RESULT)
    out, ctx = reinterpret(fn, interpreter)({"count": jnp.int32(2)}, xs)
    assert ctx["last"].shape == (6, 2)
    # Entry i is the sin of xs[i], whatever order the iterations ran in.
    np.testing.assert_allclose(ctx["last"], jnp.sin(xs), rtol=1e-6)
    assert int(ctx["count"]) == 2 + 6  # an existing leaf is carried
    np.testing.assert_allclose(out[1], jnp.sin(xs) * 2.0, rtol=1e-6)
    _out_jit, ctx_jit = jax.jit(reinterpret(fn, interpreter))({"count": jnp.int32(2)}, xs)
    np.testing.assert_allclose(ctx_jit["last"], jnp.sin(xs), rtol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
def test_result_entries_match_scan_outputs(reverse):
    """A stacked leaf recorded from the carry lines up with the scan's own ys."""

    def fn(xs):
        def body(carry, x):
            y = jnp.sin(carry + x)
            return carry + y, y

        return lax.scan(body, jnp.float32(0.1), xs, reverse=reverse)

    interpreter = interpreter_with(record_sin, threading=ScanSemantics.RESULT)
    out, ctx = reinterpret(fn, interpreter)({"count": jnp.int32(0)}, XS)
    expected = fn(XS)
    np.testing.assert_allclose(out[1], expected[1], rtol=1e-6)
    np.testing.assert_allclose(ctx["last"], expected[1], rtol=1e-6)
    # By hand, for the forward scan.
    if not reverse:
        carry, ys = 0.1, []
        for x in np.asarray(XS):
            ys.append(np.sin(carry + x))
            carry += ys[-1]
        np.testing.assert_allclose(ctx["last"], ys, rtol=1e-5)


def test_result_zero_length_gives_empty_stack():
    interpreter = interpreter_with(record_sin, threading=ScanSemantics.RESULT)
    out, ctx = reinterpret(sum_sin, interpreter)({"count": jnp.int32(1)}, jnp.zeros((0, 3)))
    assert out[1].shape == (0, 3)
    assert ctx["last"].shape == (0, 3) and ctx["last"].dtype == jnp.float32
    assert int(ctx["count"]) == 1


def test_result_with_unroll_and_several_new_leaves():
    def handler(interpreter, ctx, eqn, invals):
        y = jnp.sin(invals[0])
        return HandlerResult({**ctx, "y": y, "n": jnp.sum(y > 0).astype(jnp.int32)}, [y])

    fn = functools.partial(sum_sin, unroll=2)
    xs = jnp.arange(-6.0, 6.0).reshape(4, 3)
    out, ctx = reinterpret(fn, interpreter_with(handler, threading=ScanSemantics.RESULT))({}, xs)
    np.testing.assert_allclose(out[0], fn(xs)[0], rtol=1e-6)
    np.testing.assert_allclose(ctx["y"], jnp.sin(xs), rtol=1e-6)
    np.testing.assert_array_equal(ctx["n"], jnp.sum(jnp.sin(xs) > 0, axis=1))


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def scan_at_known_line(xs):
    LINES["scan"] = _next_line()
    return lax.scan(lambda c, x: (c + jnp.sin(x), None), jnp.zeros(xs.shape[1:]), xs)


def test_missing_initializer_is_a_clear_error():
    with pytest.raises(ValueError, match="initializer") as info:
        reinterpret(scan_at_known_line, interpreter_with(record_sin))(
            {"count": jnp.int32(0)}, jnp.ones((3, 2))
        )
    message = str(info.value)
    assert "'scan'" in message
    assert f"test_scan.py:{LINES['scan']}" in message
    assert "ctx['last']" in message


def test_initializer_leaving_uninitialized_is_a_clear_error():
    with pytest.raises(ValueError, match="Uninitialized") as info:
        reinterpret(scan_at_known_line, interpreter_with(record_sin, initializer=lambda b, s: s))(
            {"count": jnp.int32(0)}, jnp.ones((3, 2))
        )
    message = str(info.value)
    assert "'scan'" in message and "initializer" in message
    assert "ctx['last']" in message
    assert f"test_scan.py:{LINES['scan']}" in message


def test_initializer_returning_other_structure_is_a_clear_error():
    def initializer(ctx_before, sentinel):
        return {**sentinel, "last": jnp.zeros((2,), jnp.int32)}  # the body makes it f32

    with pytest.raises(ValueError, match="initializer") as info:
        reinterpret(scan_at_known_line, interpreter_with(record_sin, initializer=initializer))(
            {"count": jnp.int32(0)}, jnp.ones((3, 2))
        )
    message = str(info.value)
    assert "ctx['last']: int32[2] vs float32[2]" in message
    assert f"test_scan.py:{LINES['scan']}" in message


def test_updater_returning_other_structure_is_a_clear_error():
    with pytest.raises(ValueError, match="updater") as info:
        reinterpret(
            scan_at_known_line,
            interpreter_with(count_sin_dict, updater=lambda carried, new: {**new, "x": 1.0}),
        )({"count": jnp.int32(0)}, jnp.ones((3, 2)))
    assert "ctx['x']" in str(info.value)


def test_result_rejects_initializer():
    with pytest.raises(ValueError, match="RESULT"):
        reinterpret(
            scan_at_known_line,
            interpreter_with(
                record_sin, threading=ScanSemantics.RESULT, initializer=zeros_like_new
            ),
        )({"count": jnp.int32(0)}, jnp.ones((3, 2)))


def test_result_existing_leaf_changing_dtype_is_a_clear_error():
    def handler(interpreter, ctx, eqn, invals):
        return HandlerResult({"count": ctx["count"] + 0.5}, [jnp.sin(invals[0])])

    with pytest.raises(ValueError, match="ctx\\['count'\\]") as info:
        reinterpret(scan_at_known_line, interpreter_with(handler, threading=ScanSemantics.RESULT))(
            {"count": jnp.int32(0)}, jnp.ones((3, 2))
        )
    assert f"test_scan.py:{LINES['scan']}" in str(info.value)


def test_threading_must_be_scan_semantics():
    with pytest.raises(TypeError, match="ScanSemantics"):
        reinterpret(scan_at_known_line, interpreter_with(count_sin, threading="carry"))(
            0, jnp.ones((3, 2))
        )


class ModuleCtx(eqx.Module):
    count: jax.Array
    last: jax.Array | None = None


def record_sin_module(interpreter, ctx, eqn, invals):
    y = jnp.sin(invals[0])
    return HandlerResult(ModuleCtx(ctx.count + 1, y), [y])


@pytest.mark.parametrize("threading", [ScanSemantics.CARRY, ScanSemantics.RESULT])
def test_module_field_filled_in_by_the_body(threading):
    """A `None` field that the body fills in is a new leaf."""
    sentinels = []

    def initializer(ctx_before, sentinel):
        sentinels.append(sentinel)
        return ModuleCtx(sentinel.count, jnp.full(sentinel.last.shape, 5.0, sentinel.last.dtype))

    options = {"initializer": initializer} if threading is ScanSemantics.CARRY else {}
    interpreter = interpreter_with(record_sin_module, threading=threading, **options)
    out, ctx = reinterpret(sum_sin, interpreter)(ModuleCtx(jnp.int32(1)), XS)
    np.testing.assert_allclose(out[0], jnp.sum(jnp.sin(XS)), rtol=1e-6)
    assert isinstance(ctx, ModuleCtx) and int(ctx.count) == 1 + XS.shape[0]
    if threading is ScanSemantics.CARRY:
        (sentinel,) = sentinels
        assert isinstance(sentinel.last, Uninitialized) and int(sentinel.count) == 1
        np.testing.assert_allclose(ctx.last, jnp.sin(XS[-1]), rtol=1e-6)
    else:
        np.testing.assert_allclose(ctx.last, jnp.sin(XS), rtol=1e-6)


def test_result_without_xs_stacks_length_entries():
    def fn(x):
        return lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=4)[0]

    interpreter = interpreter_with(record_sin, threading=ScanSemantics.RESULT)
    out, ctx = reinterpret(fn, interpreter)({"count": jnp.int32(0)}, jnp.float32(1.0))
    expected, values = 1.0, []
    for _ in range(4):
        expected = np.sin(expected)
        values.append(expected)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(ctx["last"], values, rtol=1e-6)


def test_nested_result_scans_stack_both_axes():
    def fn(xs):
        def row(carry, xs_row):
            return carry, lax.scan(lambda c, x: (c, jnp.sin(x)), 0.0, xs_row, reverse=True)[1]

        return lax.scan(row, 0.0, xs)[1]

    xs = jnp.arange(12.0).reshape(3, 4) / 4.0
    interpreter = interpreter_with(record_sin, threading=ScanSemantics.RESULT)
    out, ctx = jax.jit(reinterpret(fn, interpreter))({"count": jnp.int32(0)}, xs)
    np.testing.assert_allclose(out, jnp.sin(xs), rtol=1e-6)
    # Entry [i, j] belongs to xs[i, j], the inner scan running in reverse.
    np.testing.assert_allclose(ctx["last"], jnp.sin(xs), rtol=1e-6)
    assert int(ctx["count"]) == 12
