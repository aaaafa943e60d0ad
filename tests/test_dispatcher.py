"""The dispatcher: keys, chaining, matching rules, the fallback handler and
`default_dispatcher()`."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core.primitives import cos_p, sin_p, while_p

from kups.effects import (
    Dispatcher,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    contains_subjaxprs,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)


def count_handler(interpreter, ctx, eqn, invals):
    """Re-binds the equation and adds one to the context."""
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    return HandlerResult(ctx + 1, result.outvals)


def other_handler(interpreter, ctx, eqn, invals):
    """Re-binds the equation and adds a hundred to the context."""
    result = default_primitive_handler(interpreter, ctx, eqn, invals)
    return HandlerResult(ctx + 100, result.outvals)


def sin_twice(x):
    return jnp.sin(jnp.sin(x)) + jnp.cos(x)


X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def run(dispatcher, fn=sin_twice, *args, policy=InterpreterPolicy.RAISE):
    return reinterpret(fn, Interpreter(dispatcher, policy))(0, *(args or (X,)))


# ---------------------------------------------------------------------------
# Keys: a name and its Primitive are the same key.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("register_as", ["sin", sin_p])
@pytest.mark.parametrize("query_as", ["sin", sin_p])
def test_name_and_primitive_are_the_same_key(register_as, query_as):
    dispatcher = Dispatcher().register_handler(register_as, count_handler)
    assert dispatcher.is_registered(query_as)
    assert not dispatcher.is_registered("cos")
    assert not dispatcher.is_registered(cos_p)
    out, ctx = run(dispatcher)
    assert int(ctx) == 2
    np.testing.assert_allclose(out, sin_twice(X), rtol=1e-6)


def test_registering_the_primitive_replaces_the_name():
    dispatcher = Dispatcher().register_handler("sin", count_handler)
    dispatcher.register_handler(sin_p, other_handler)
    assert list(dispatcher.handlers) == ["sin"]
    _, ctx = run(dispatcher)
    assert int(ctx) == 200


def test_constructor_mapping_mixes_names_and_primitives():
    dispatcher = Dispatcher({sin_p: count_handler, "cos": other_handler})
    assert dispatcher.is_registered("sin") and dispatcher.is_registered(cos_p)
    _, ctx = run(dispatcher)
    assert int(ctx) == 2 + 100


def test_registration_chains_and_mutates():
    dispatcher = Dispatcher()
    returned = (
        dispatcher.register_handler("sin", count_handler)
        .register_handler(cos_p, other_handler)
        .register_custom_matching_rule(lambda ctx, eqn, invals: False)
        .unregister_handler("cos")
    )
    assert returned is dispatcher
    assert dispatcher.is_registered("sin")
    assert not dispatcher.is_registered("cos")
    assert dispatcher.register_fallback_handler(None) is dispatcher


@pytest.mark.parametrize("key", ["sin", sin_p])
def test_unregister_absent_raises_key_error(key):
    dispatcher = Dispatcher().register_handler("cos", count_handler)
    with pytest.raises(KeyError, match="sin"):
        dispatcher.unregister_handler(key)
    assert dispatcher.is_registered("cos")


@pytest.mark.parametrize("key", ["sin", sin_p])
def test_unregister_removes_the_handler(key):
    dispatcher = Dispatcher().register_handler("sin", count_handler)
    dispatcher.unregister_handler(key)
    assert not dispatcher.is_registered("sin")
    _, ctx = run(dispatcher)
    assert ctx == 0
    with pytest.raises(KeyError):
        dispatcher.unregister_handler(key)


def test_register_rejects_non_callable_handler_and_bad_key():
    with pytest.raises(TypeError, match="callable"):
        Dispatcher().register_handler("sin", 3)
    with pytest.raises(TypeError, match="primitive"):
        Dispatcher().register_handler(3.5, count_handler)
    with pytest.raises(TypeError, match="callable"):
        Dispatcher().register_custom_matching_rule("not a rule")
    with pytest.raises(TypeError, match="callable"):
        Dispatcher().register_fallback_handler("not a handler")


# ---------------------------------------------------------------------------
# Custom matching rules: accepted but unhandled equations follow the policy.
# ---------------------------------------------------------------------------


def accept_sin(ctx, eqn, invals):
    return eqn.primitive.name == "sin"


def test_matching_rule_receives_ctx_eqn_and_invals():
    seen = []

    def rule(ctx, eqn, invals):
        seen.append((ctx, eqn.primitive.name, len(invals), len(eqn.invars)))
        return False

    dispatcher = Dispatcher().register_handler("cos", count_handler)
    dispatcher.register_custom_matching_rule(rule)
    run(dispatcher, lambda x: jnp.cos(x) * 2.0, X)
    # `cos` has a handler and never reaches the rule; `mul` does, after `cos` ran.
    assert [(name, n, m) for _, name, n, m in seen] == [("mul", 2, 2)]
    assert int(seen[0][0]) == 1


def test_matching_rule_accepts_unhandled_raise():
    dispatcher = Dispatcher().register_custom_matching_rule(accept_sin)
    with pytest.raises(NotImplementedError) as info:
        run(dispatcher)
    message = str(info.value)
    assert "'sin'" in message
    assert "test_dispatcher.py" in message
    assert "register_handler('sin', handler)" in message
    assert "custom matching rule" in message
    assert "control-flow" not in message  # sin is not control flow


def test_matching_rule_accepts_unhandled_warn_rebinds():
    dispatcher = Dispatcher().register_custom_matching_rule(accept_sin)
    with pytest.warns(UserWarning, match="'sin'") as record:
        out, ctx = run(dispatcher, policy=InterpreterPolicy.WARN)
    assert len([w for w in record if "'sin'" in str(w.message)]) == 2
    np.testing.assert_allclose(out, sin_twice(X), rtol=1e-6)
    assert ctx == 0


def test_matching_rule_accepts_unhandled_ignore_rebinds():
    dispatcher = Dispatcher().register_custom_matching_rule(accept_sin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, ctx = run(dispatcher, policy=InterpreterPolicy.IGNORE)
    np.testing.assert_allclose(out, sin_twice(X), rtol=1e-6)
    assert ctx == 0


def test_handler_takes_precedence_over_matching_rule():
    dispatcher = Dispatcher().register_custom_matching_rule(accept_sin)
    dispatcher.register_handler("sin", count_handler)
    _, ctx = run(dispatcher)
    assert int(ctx) == 2


def test_rejecting_rule_leaves_equation_rebound():
    dispatcher = Dispatcher().register_custom_matching_rule(lambda ctx, eqn, invals: False)
    out, ctx = run(dispatcher)
    np.testing.assert_allclose(out, sin_twice(X), rtol=1e-6)
    assert ctx == 0


# ---------------------------------------------------------------------------
# The fallback handler.
# ---------------------------------------------------------------------------


def test_fallback_sees_every_unhandled_equation():
    names = []

    def fallback(interpreter, ctx, eqn, invals):
        names.append(eqn.primitive.name)
        return count_handler(interpreter, ctx, eqn, invals)

    dispatcher = Dispatcher().register_fallback_handler(fallback)
    out, ctx = run(dispatcher)
    expected = [e.primitive.name for e in jax.make_jaxpr(sin_twice)(X).eqns]
    assert names == expected
    assert sorted(names) == ["add", "cos", "sin", "sin"]
    assert int(ctx) == len(expected)
    np.testing.assert_allclose(out, sin_twice(X), rtol=1e-6)
    assert dispatcher.fallback_handler is fallback


def test_registered_handler_wins_over_fallback():
    dispatcher = Dispatcher({"sin": other_handler}).register_fallback_handler(count_handler)
    _, ctx = run(dispatcher)
    assert int(ctx) == 2 * 100 + 2  # two sins by their handler, cos and add by the fallback


def test_fallback_reaches_inside_control_flow_but_not_the_control_flow_itself():
    names = []

    def fallback(interpreter, ctx, eqn, invals):
        names.append(eqn.primitive.name)
        return count_handler(interpreter, ctx, eqn, invals)

    def fn(x):
        return lax.scan(lambda c, xi: (c + jnp.sin(xi), None), 0.0, x)[0]

    dispatcher = default_dispatcher().register_fallback_handler(fallback)
    out, ctx = run(dispatcher, fn, X)
    assert "scan" not in names
    assert {"sin", "add"} <= set(names)
    # Each body equation runs `length` times with the context as a carry.
    body_eqns = len(jax.make_jaxpr(fn)(X).eqns[0].params["jaxpr"].eqns)
    assert int(ctx) == body_eqns * X.shape[0]
    np.testing.assert_allclose(out, jnp.sum(jnp.sin(X)), rtol=1e-6)


def test_fallback_none_restores_rebinding():
    dispatcher = Dispatcher().register_fallback_handler(count_handler)
    dispatcher.register_fallback_handler(None)
    assert dispatcher.fallback_handler is None
    _, ctx = run(dispatcher)
    assert ctx == 0


def test_fallback_not_used_for_unhandled_control_flow():
    calls = []

    def fallback(interpreter, ctx, eqn, invals):
        calls.append(eqn.primitive.name)
        return default_primitive_handler(interpreter, ctx, eqn, invals)

    dispatcher = Dispatcher().register_fallback_handler(fallback)
    with pytest.raises(NotImplementedError, match="'jit'"):
        run(dispatcher, jax.jit(jnp.sin), X)
    assert calls == []


# ---------------------------------------------------------------------------
# default_dispatcher()
# ---------------------------------------------------------------------------

CONTROL_FLOW = ["jit", "scan", "while", "cond", "remat2", "custom_jvp_call", "custom_vjp_call"]


def test_default_dispatcher_registers_control_flow():
    dispatcher = default_dispatcher()
    closed_call = jax.extend.core.primitives.closed_call_p.name  # eval_jaxpr from JAX 0.11
    for name in [*CONTROL_FLOW, closed_call, "shard_map", "custom_linear_solve"]:
        assert dispatcher.is_registered(name), name
    assert dispatcher.is_registered(while_p)
    assert not dispatcher.is_registered("sin")
    assert contains_subjaxprs in dispatcher.matching_rules


def test_default_dispatcher_is_fresh_each_call():
    first, second = default_dispatcher(), default_dispatcher()
    assert first is not second
    first.register_handler("sin", count_handler)
    first.unregister_handler("scan")
    first.register_custom_matching_rule(accept_sin)
    first.register_fallback_handler(count_handler)
    assert not second.is_registered("sin")
    assert second.is_registered("scan")
    assert len(second.matching_rules) == 1
    assert second.fallback_handler is None
    third = default_dispatcher()
    assert not third.is_registered("sin") and third.is_registered("scan")
    assert third.handlers == second.handlers


def test_default_dispatcher_is_identity_on_control_flow():
    def fn(x, i):
        y = jax.jit(jnp.sin)(x)
        y = lax.scan(lambda c, xi: (c * xi, c), 1.0, y)[1]
        y = lax.switch(i, [jnp.cos, jnp.sin, jnp.tanh], y)
        y = jax.checkpoint(lambda a: jnp.exp(a))(y)
        return lax.fori_loop(0, 3, lambda _, c: c * 0.5, y)

    interpreter = Interpreter(default_dispatcher())
    for i in range(3):
        out, ctx = reinterpret(fn, interpreter)({"a": 1.0}, X, i)
        np.testing.assert_allclose(out, fn(X, i), rtol=1e-6)
        assert ctx == {"a": 1.0}


def test_unknown_control_flow_in_default_dispatcher_follows_policy():
    dispatcher = default_dispatcher().unregister_handler("scan")

    def fn(x):
        return lax.scan(lambda c, xi: (c + xi, None), 0.0, x)[0]

    with pytest.raises(NotImplementedError, match="'scan'"):
        run(dispatcher, fn, X)
    out, ctx = run(dispatcher, fn, X, policy=InterpreterPolicy.IGNORE)
    np.testing.assert_allclose(out, jnp.sum(X), rtol=1e-6)
    assert ctx == 0


# ---------------------------------------------------------------------------
# contains_subjaxprs: control flow versus combiners.
# ---------------------------------------------------------------------------


def _eqn_of(fn, *args, name):
    for eqn in jax.make_jaxpr(fn)(*args).eqns:
        if eqn.primitive.name == name:
            return eqn
    raise AssertionError(f"no {name} equation")


@pytest.mark.parametrize(
    ("fn", "name", "expected"),
    [
        (lambda x: lax.scan(lambda c, xi: (c + xi, None), 0.0, x)[0], "scan", True),
        (lambda x: lax.while_loop(lambda c: c[0] < 2.0, lambda c: c + 1.0, x), "while", True),
        (lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), "cond", True),
        (jax.jit(jnp.sin), "jit", True),
        (jax.checkpoint(jnp.sin), "checkpoint", True),
        (lambda x: x.at[jnp.array([0, 0])].add(1.0), "scatter-add", False),
        (lambda x: lax.sort((x, x), num_keys=1)[1], "sort", False),
        (
            lambda x: lax.reduce(x, 0.0, lambda a, b: a * b + 1.0, (0,)),
            "reduce",
            False,
        ),
        (jnp.sin, "sin", False),
    ],
)
def test_contains_subjaxprs(fn, name, expected):
    if name == "checkpoint":
        eqn = jax.make_jaxpr(fn)(X).eqns[0]
    else:
        eqn = _eqn_of(fn, X, name=name)
    assert contains_subjaxprs(None, eqn, []) is expected


def test_combiners_are_rebound_not_unhandled():
    def fn(x):
        y = x.at[jnp.array([0, 0, 2])].add(jnp.array([1.0, 2.0, 3.0]))
        z = lax.reduce(y, 1.0, lambda a, b: a * b + 1.0, (0,))
        return lax.sort((y, x), num_keys=1)[1] + z

    out, ctx = run(default_dispatcher(), fn, X)
    np.testing.assert_allclose(out, fn(X), rtol=1e-6)
    assert ctx == 0


def test_matching_rule_wins_over_fallback():
    """An equation a rule accepts is unhandled (the policy decides); it does not go
    to the fallback."""
    calls = []

    def fallback(interpreter, ctx, eqn, invals):
        calls.append(eqn.primitive.name)
        return count_handler(interpreter, ctx, eqn, invals)

    dispatcher = Dispatcher().register_custom_matching_rule(accept_sin)
    dispatcher.register_fallback_handler(fallback)
    with pytest.raises(NotImplementedError, match="'sin'"):
        run(dispatcher)
    out, ctx = run(dispatcher, policy=InterpreterPolicy.IGNORE)
    np.testing.assert_allclose(out, sin_twice(X), rtol=1e-6)
    assert "sin" not in calls and sorted(set(calls)) == ["add", "cos"]
    assert int(ctx) == 2  # cos and add, by the fallback


# ---------------------------------------------------------------------------
# Names are checked; a dispatcher used to trace warns when changed.
# ---------------------------------------------------------------------------


def test_names_are_checked_but_primitives_are_not():
    with pytest.raises(ValueError, match="Did you mean 'cos'"):
        Dispatcher().register_handler("cosine", count_handler)
    fresh = jax.extend.core.Primitive("kups_test_dispatcher_fresh")
    assert Dispatcher().register_handler(fresh, count_handler).is_registered(fresh)
    # Only registration checks: asking about or removing a name never raises.
    assert not Dispatcher().is_registered("cosine")
    assert Dispatcher().handler_for("cosine") is None


def test_a_name_no_equation_of_this_jax_has_is_refused_with_the_name_it_has():
    # Each of these was accepted and never ran: equations of jax.jit are named
    # `jit`, of jax.checkpoint `remat2`, and from JAX 0.11 of closed_call `eval_jaxpr`.
    renamed = {"pjit": "jit", "checkpoint": "remat2", "custom_vjp_call_jaxpr": "custom_vjp_call"}
    if jax.__version_info__ >= (0, 11):
        renamed.update(closed_call="eval_jaxpr", call="eval_jaxpr")
    for old, new in renamed.items():
        with pytest.raises(ValueError, match=f"Register it under '{new}'"):
            default_dispatcher().register_handler(old, count_handler)
    # The names that equations have are registered, and their handlers run.
    names = {
        jax.jit(jnp.sin): "jit",
        jax.checkpoint(jnp.sin): "remat2",
    }
    for fn, name in names.items():
        (eqn,) = jax.make_jaxpr(fn)(X).jaxpr.eqns
        assert eqn.primitive.name == name
        seen = []

        def spy(interpreter, ctx, eqn, invals, name=name, seen=seen):
            seen.append(eqn.primitive.name)
            return default_dispatcher().handler_for(name)(interpreter, ctx, eqn, invals)

        dispatcher = default_dispatcher().register_handler(name, spy)
        reinterpret(fn, Interpreter(dispatcher))(0, X)
        assert seen == [name]


def test_copy_keeps_handlers_and_is_not_marked_as_traced():
    dispatcher = default_dispatcher().register_handler("sin", count_handler)
    dispatcher.register_fallback_handler(other_handler)
    jax.jit(reinterpret(jnp.sin, Interpreter(dispatcher)))(0, X)
    copy = dispatcher.copy()
    assert copy.handlers == dispatcher.handlers
    assert copy.fallback_handler is other_handler
    assert copy.matching_rules == dispatcher.matching_rules
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.register_handler("sin", other_handler)
    assert dispatcher.handler_for("sin") is count_handler
    with pytest.warns(UserWarning, match="dispatcher.copy()"):
        dispatcher.register_handler("sin", other_handler)


def test_vmap_and_grad_of_eager_calls_do_not_mark_the_dispatcher():
    dispatcher = default_dispatcher().register_handler("sin", count_handler)
    wrapped = reinterpret(jnp.sin, Interpreter(dispatcher))
    jax.vmap(wrapped, in_axes=(None, 0))(0, X)
    jax.grad(lambda x: wrapped(0, x)[0])(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatcher.register_handler("cos", count_handler)
    jax.make_jaxpr(wrapped)(0, X)  # staging: the jaxpr keeps today's handlers
    with pytest.warns(UserWarning, match="already used to trace"):
        dispatcher.register_handler("cos", other_handler)
