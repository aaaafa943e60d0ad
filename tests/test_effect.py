"""`define_effect`: an identity primitive that JAX never drops, checked against
plain JAX (the same functions without the effect) as the oracle."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Primitive, jaxprs_in_params
from jax.interpreters.partial_eval import dce_jaxpr
from jax.sharding import PartitionSpec as P

from kups.effects import define_effect

tag_p = define_effect("tag")


@pytest.fixture(autouse=True)
def type_check_every_jaxpr():
    # With checks on, JAX type-checks the jaxprs it builds, including the rule
    # that only effects in `custom_derivatives_allowed_effects` may appear
    # inside `custom_jvp`/`custom_vjp` (JAX 0.10.2 otherwise enforces it only
    # for `custom_vjp` with `optimize_remat=True`).
    with jax.enable_checks(True):
        yield


# ---------------------------------------------------------------- helpers


def tag(x, **params):
    """Binds the effect on one array and returns its output."""
    (out,) = tag_p.bind(x, **params)
    return out


def tag_unused(x, **params):
    """Binds the effect and ignores its output: only the effect keeps it."""
    tag_p.bind(x, **params)
    return x


def eqns_of(jaxpr, primitive):
    """Every equation of `primitive` in `jaxpr` and its sub-jaxprs."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is primitive:
            found.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            found.extend(eqns_of(sub, primitive))
    return found


def count(jaxpr, primitive=tag_p):
    return len(eqns_of(jaxpr, primitive))


def primitive_names(jaxpr):
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    names = collections.Counter()
    for eqn in jaxpr.eqns:
        names[eqn.primitive.name] += 1
        for sub in jaxprs_in_params(eqn.params):
            names.update(primitive_names(sub))
    return names


def assert_trees_equal(actual, expected):
    """Bit-for-bit equality of two pytrees of arrays, dtypes included."""
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype
        assert a.shape == e.shape
        np.testing.assert_array_equal(a, e, strict=True)


def hlo_opcodes(text):
    """Multiset of HLO opcodes in a compiled module's text."""
    ops = collections.Counter()
    for line in text.splitlines():
        match = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S.*?\s([a-z][\w\-]*)\(", line)
        if match:
            ops[match.group(1)] += 1
    return ops


def normalized_hlo(text):
    """A compiled module's computations without source metadata and without
    the numbering XLA appends to instruction names (`%mul.15` -> `%mul`)."""
    computations = text[re.search(r"^(%|ENTRY)", text, flags=re.M).start() :]
    computations = re.sub(r",? metadata=\{[^}]*\}", "", computations)
    return re.sub(
        r"\b[A-Za-z_][\w\-.]*", lambda m: re.sub(r"[._]\d+", "", m.group(0)), computations
    )


def without_parameters(text):
    """`normalized_hlo` without the entry computation's parameters."""
    text = re.sub(r"^(ENTRY %\S+) \(.*?\) ->", r"\1 () ->", text, flags=re.M)
    return re.sub(r"^\s*%\S+ = \S+ parameter\(\d+\)\n", "", text, flags=re.M)


def entry_parameters(text):
    """Names of the entry computation's parameters in a compiled module's text."""
    (signature,) = re.findall(r"^ENTRY %\S+ \((.*?)\) ->", text, flags=re.M)
    return [re.sub(r"\.\d+$", "", arg.split(":")[0]) for arg in signature.split(", ") if arg]


def stablehlo_ops(text):
    """Multiset of StableHLO/MLIR operation names in a lowered module's text."""
    return collections.Counter(re.findall(r"\b(stablehlo\.[a-z_]+|func\.call|sdy\.[a-z_]+)", text))


# Pairs of (with effect, without effect) programs used by several tests. The
# effect is bound both on values that are used and on values that are not.


def body_math(x, effect):
    y = jnp.sin(x) * 1.5
    y = effect(y, name="y", where=("body", 1))
    z = jnp.exp(y) + x**3
    if effect is tag:
        tag_unused(z * 2.0, name="dead")
    return jnp.sum(z * y)


def f_plain(x):
    return body_math(x, lambda v, **_: v)


def f_tagged(x):
    return body_math(x, tag)


def scan_program(x, effect):
    def body(carry, xi):
        carry = effect(carry * xi + jnp.sin(carry), name="carry")
        if effect is tag:
            tag_unused(jnp.cos(carry), name="unused")
        return carry, carry**2

    carry, ys = jax.lax.scan(body, x, jnp.linspace(0.5, 1.5, 4))
    return carry.sum() + ys.sum()


def cond_program(x, effect):
    def yes(v):
        if effect is tag:
            tag_unused(v * 3.0, name="yes_unused")
        return effect(jnp.sin(v), name="yes")

    def no(v):
        if effect is tag:
            tag_unused(v + 1.0, name="no_unused")
        return jnp.cos(v) * 2.0

    return jax.lax.cond(jnp.sum(x) > 0.0, yes, no, x).sum()


def while_program(x, effect):
    def cond_fun(state):
        i, _ = state
        return i < 5

    def body_fun(state):
        i, v = state
        if effect is tag:
            tag_unused(v * 2.0, name="unused")
        return i + 1, effect(jnp.sin(v) + 0.5 * v, name="v")

    return jax.lax.while_loop(cond_fun, body_fun, (0, x))[1].sum()


def checkpoint_program(x, effect):
    @jax.checkpoint
    def inner(v):
        w = jnp.sin(v) * v
        if effect is tag:
            tag_unused(w * 2.0, name="unused")
        return effect(jnp.exp(w), name="w")

    return inner(x).sum()


identity = lambda v, **_: v  # noqa: E731

PROGRAMS = {
    "math": body_math,
    "scan": scan_program,
    "cond": cond_program,
    "while": while_program,
    "checkpoint": checkpoint_program,
}

X = jnp.linspace(-1.0, 2.0, 6, dtype=jnp.float32)


# ---------------------------------------------------------------- identity


def test_returns_distinct_primitives_even_for_the_same_name():
    first = define_effect("same")
    second = define_effect("same")
    assert isinstance(first, Primitive)
    assert first is not second
    assert first != second
    assert first.name == second.name == "same"
    assert first.multiple_results and second.multiple_results
    assert "same" in repr(first) and repr(first) != repr(second)
    # The two are told apart in jaxprs too.
    jaxpr = jax.make_jaxpr(lambda x: second.bind(*first.bind(x)))(1.0)
    assert [eqn.primitive for eqn in jaxpr.eqns] == [first, second]
    assert not set(jaxpr.eqns[0].effects) & set(jaxpr.eqns[1].effects)


def test_name_must_be_a_nonempty_string():
    with pytest.raises(TypeError, match="non-empty string"):
        define_effect("")
    with pytest.raises(TypeError, match="non-empty string"):
        define_effect(3)  # pyright: ignore[reportArgumentType]


def test_eager_bind_returns_the_same_arrays():
    x = jnp.arange(3.0)
    y = jnp.ones((2, 2), jnp.int32)
    out = tag_p.bind(x, y, name="eager")
    assert isinstance(out, list)
    assert len(out) == 2
    assert out[0] is x and out[1] is y
    assert tag_p.bind() == []


def test_static_params_appear_in_the_jaxpr():
    params = dict(tag="act", name="layer", index=3, path=("a", 1), flags=frozenset({1}))
    jaxpr = jax.make_jaxpr(lambda x: tag(x, **params))(jnp.ones(3))
    (eqn,) = jaxpr.eqns
    assert eqn.primitive is tag_p
    assert eqn.params == params
    assert eqn.effects
    assert eqn.outvars[0].aval == eqn.invars[0].aval


def test_unhashable_static_param_is_a_clear_error():
    with pytest.raises(TypeError, match=r"unhashable static parameter names=\['a'\]"):
        tag_p.bind(jnp.ones(2), names=["a"])
    with pytest.raises(TypeError, match="unhashable static parameter"):
        jax.jit(lambda x: tag(x, value=jnp.ones(2)))(jnp.ones(2))


@pytest.mark.parametrize(
    "value",
    [
        jnp.float32(1.5),
        jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
        jnp.array([True, False]),
        jnp.ones((0, 4), jnp.bfloat16),
        jnp.array([1 + 2j], jnp.complex64),
    ],
    ids=["f32-scalar", "i32", "bool", "bf16-empty", "c64"],
)
def test_jit_is_the_identity_and_keeps_avals(value):
    out = jax.jit(lambda v: tag_p.bind(v, v + v, name="jit"))(value)
    assert_trees_equal(out, [value, value + value])
    jaxpr = jax.make_jaxpr(lambda v: tag_p.bind(v, name="jit"))(value)
    (eqn,) = eqns_of(jaxpr, tag_p)
    assert eqn.outvars[0].aval == eqn.invars[0].aval


def test_weak_type_and_key_arrays_pass_through():
    jaxpr = jax.make_jaxpr(lambda v: tag(v))(1.0)
    assert jaxpr.out_avals[0].weak_type
    key = jax.random.key(0)
    out = jax.jit(lambda k: jax.random.normal(tag(k, name="key"), (3,)))(key)
    assert_trees_equal(out, jax.random.normal(key, (3,)))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_programs_equal_plain_jax(name, jit):
    program = PROGRAMS[name]

    def tagged(v):
        return program(v, tag)

    def plain(v):
        return program(v, identity)

    wrap = jax.jit if jit else (lambda fn: fn)
    assert_trees_equal(wrap(tagged)(X), wrap(plain)(X))
    assert count(jax.make_jaxpr(tagged)(X)) >= 2


def test_switch_and_fori_loop():
    def tagged(x, index):
        branches = [
            lambda v: tag(v * 2.0, branch=0),
            lambda v: tag_unused(jnp.sin(v), branch=1),
            lambda v: jnp.cos(tag(v, branch=2)),
        ]
        y = jax.lax.switch(index, branches, x)
        return jax.lax.fori_loop(0, 3, lambda i, c: tag(c * 1.1 + i, loop=True), y)

    def plain(x, index):
        branches = [lambda v: v * 2.0, jnp.sin, jnp.cos]
        y = jax.lax.switch(index, branches, x)
        return jax.lax.fori_loop(0, 3, lambda i, c: c * 1.1 + i, y)

    for index in range(3):
        assert_trees_equal(jax.jit(tagged)(X, index), jax.jit(plain)(X, index))
    assert count(jax.make_jaxpr(tagged)(X, 0)) == 4


# ---------------------------------------------------------------- vmap


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_vmap_equals_plain(name):
    program = PROGRAMS[name]
    xs = jnp.stack([X, -X, X * 0.5])
    tagged = jax.vmap(lambda v: program(v, tag))
    plain = jax.vmap(lambda v: program(v, identity))
    assert_trees_equal(tagged(xs), plain(xs))
    assert_trees_equal(jax.jit(tagged)(xs), jax.jit(plain)(xs))
    assert count(jax.make_jaxpr(tagged)(xs)) >= 2


def test_vmap_keeps_batch_dims_and_unbatched_args():
    def fn(x, y):
        return tuple(tag_p.bind(x, y, name="pair"))

    x = jnp.arange(12.0).reshape(3, 4)
    y = jnp.arange(5.0)
    out = jax.vmap(fn, in_axes=(1, None), out_axes=(1, None))(x, y)
    assert_trees_equal(out, (x, y))
    jaxpr = jax.make_jaxpr(jax.vmap(fn, in_axes=(1, None), out_axes=(1, None)))(x, y)
    (eqn,) = eqns_of(jaxpr, tag_p)
    # The batch axis stays where it was (axis 1) and the unbatched argument
    # stays unbatched: nothing moves or broadcasts them.
    assert [v.aval.shape for v in eqn.invars] == [(3, 4), (5,)]
    assert set(primitive_names(jaxpr)) == {"tag"}
    nested = jax.vmap(jax.vmap(lambda v: tag(v) * 2.0))(x)
    assert_trees_equal(nested, x * 2.0)


def test_vmap_of_loops_with_batched_predicates():
    def program(effect):
        def fn(x):
            def body(v):
                if effect is tag:
                    tag_unused(v, name="body")
                return effect(v * 1.5 + 1.0, name="next")

            y = jax.lax.while_loop(lambda v: v < 4.0, body, x)
            return jax.lax.cond(y > 5.0, lambda v: effect(v - 1.0, name="big"), jnp.sin, y)

        return jax.vmap(fn)

    assert_trees_equal(program(tag)(X), program(identity)(X))
    assert_trees_equal(jax.jit(program(tag))(X), jax.jit(program(identity))(X))


# ---------------------------------------------------------------- autodiff


@pytest.mark.parametrize("name", ["math", "scan", "cond", "checkpoint"])
def test_grad_is_bitwise_equal_to_plain(name):
    program = PROGRAMS[name]
    tagged = lambda v: program(v, tag)  # noqa: E731
    plain = lambda v: program(v, identity)  # noqa: E731
    assert_trees_equal(jax.grad(tagged)(X), jax.grad(plain)(X))
    assert_trees_equal(jax.jit(jax.grad(tagged))(X), jax.jit(jax.grad(plain))(X))
    assert_trees_equal(jax.value_and_grad(tagged)(X), jax.value_and_grad(plain)(X))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_jvp_is_bitwise_equal_to_plain(name):
    program = PROGRAMS[name]
    tangent = jnp.cos(X)
    tagged = jax.jvp(lambda v: program(v, tag), (X,), (tangent,))
    plain = jax.jvp(lambda v: program(v, identity), (X,), (tangent,))
    assert_trees_equal(tagged, plain)


def test_vjp_linearize_and_hessian_equal_plain():
    cotangent = jnp.float32(0.75)
    out_t, vjp_t = jax.vjp(f_tagged, X)
    out_p, vjp_p = jax.vjp(f_plain, X)
    assert_trees_equal((out_t, vjp_t(cotangent)), (out_p, vjp_p(cotangent)))
    lin_out_t, lin_t = jax.linearize(f_tagged, X)
    lin_out_p, lin_p = jax.linearize(f_plain, X)
    assert_trees_equal((lin_out_t, lin_t(X)), (lin_out_p, lin_p(X)))
    assert_trees_equal(jax.hessian(f_tagged)(X), jax.hessian(f_plain)(X))
    assert_trees_equal(jax.jacfwd(f_tagged)(X), jax.jacfwd(f_plain)(X))


def test_each_bind_appears_once_under_jvp_and_grad():
    # `f_tagged` binds twice; a tangent that carried the effect would show
    # more equations.
    assert count(jax.make_jaxpr(f_tagged)(X)) == 2
    assert count(jax.make_jaxpr(lambda v, t: jax.jvp(f_tagged, (v,), (t,)))(X, X)) == 2
    assert count(jax.make_jaxpr(jax.grad(f_tagged))(X)) == 2
    # The linear (tangent) program holds no effect at all.
    _, f_lin = jax.linearize(f_tagged, X)
    assert count(jax.make_jaxpr(f_lin)(X)) == 0


def test_grad_with_integer_and_tuple_inputs():
    def tagged(x, n):
        x, n = tag_p.bind(x, n, name="mixed")
        return jnp.sum(x * n)

    x, n = jnp.arange(3.0), jnp.arange(3)
    assert_trees_equal(jax.grad(tagged)(x, n), jax.grad(lambda x, n: jnp.sum(x * n))(x, n))


def test_linear_transpose_is_the_identity_on_cotangents():
    def tagged(x):
        return tag(x * 2.0, name="linear") * 3.0

    transposed = jax.linear_transpose(tagged, X)
    plain = jax.linear_transpose(lambda x: x * 2.0 * 3.0, X)
    assert_trees_equal(transposed(X), plain(X))
    # Like tangents, cotangents pass through without binding the effect.
    assert count(jax.make_jaxpr(transposed)(X)) == 0


# --------------------------------------- never dropped, also under grad


def grad_jaxpr(fn):
    return jax.make_jaxpr(jax.grad(lambda v: fn(v).sum()))(X)


def test_unused_effect_survives_grad_inside_scan():
    def fn(x):
        def body(carry, xi):
            tag_unused(carry * xi, name="in_scan")
            return carry * xi, None

        return jax.lax.scan(body, x, jnp.arange(3.0))[0]

    assert count(grad_jaxpr(fn)) == 1
    assert_trees_equal(jax.grad(lambda v: fn(v).sum())(X), jnp.zeros_like(X))


def test_unused_effect_survives_grad_inside_nested_scan():
    def fn(x):
        def inner(carry, xi):
            tag_unused(carry + xi, name="deep")
            return carry * 1.5, None

        def outer(carry, _):
            return jax.lax.scan(inner, carry, jnp.arange(2.0))[0], None

        return jax.lax.scan(outer, x, None, length=2)[0]

    assert count(grad_jaxpr(fn)) == 1
    assert count(jax.make_jaxpr(jax.vmap(jax.grad(lambda v: fn(v).sum())))(X[:, None])) == 1


def test_unused_effect_survives_grad_inside_cond():
    def fn(x):
        return jax.lax.cond(
            x.sum() > 0, lambda v: tag_unused(v * 2.0, name="t"), lambda v: v * 3.0, x
        )

    assert count(grad_jaxpr(fn)) == 1


def test_unused_effect_survives_grad_inside_while_jvp():
    def fn(x):
        def body(state):
            i, v = state
            tag_unused(v, name="w")
            return i + 1, v * 1.5

        return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    jaxpr = jax.make_jaxpr(lambda v, t: jax.jvp(fn, (v,), (t,)))(X, X)
    assert count(jaxpr) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_effect_in_a_loop_body_under_checkpoint_is_recomputed(jit):
    # JAX splits a `while_loop` under `jax.checkpoint` and differentiation with
    # no residuals: an effect whose outputs the tangents read is computed again
    # there, not saved (it was an AssertionError inside JAX).
    def fn(effect):
        def body(state):
            i, v = state
            return i + 1, effect(jnp.sin(v), name="w") * v

        return lambda x: jax.lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    def linearized(f):
        out = lambda x: jax.linearize(jax.checkpoint(f), x)[1](jnp.ones_like(x))  # noqa: E731
        return jax.jit(out) if jit else out

    assert_trees_equal(linearized(fn(tag))(X), linearized(fn(identity))(X))
    assert count(jax.make_jaxpr(linearized(fn(tag)))(X)) == 2


@pytest.mark.parametrize(
    "policy",
    [None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.everything_saveable],
    ids=["default", "nothing_saveable", "everything_saveable"],
)
def test_unused_effect_survives_grad_inside_checkpoint(policy):
    def fn(x):
        def inner(v):
            tag_unused(jnp.sin(v), name="remat")
            return jnp.sin(v) * v

        return jax.checkpoint(inner, policy=policy)(x)

    # Bound on the forward pass, and again where the body is recomputed unless
    # the policy saves its outputs (as JAX binds `jax.debug.callback`).
    saved = policy is jax.checkpoint_policies.everything_saveable
    assert count(grad_jaxpr(fn)) == (1 if saved else 2)
    plain = lambda v: jax.checkpoint(lambda u: jnp.sin(u) * u, policy=policy)(v).sum()  # noqa: E731
    assert_trees_equal(jax.grad(lambda v: fn(v).sum())(X), jax.grad(plain)(X))


def test_custom_jvp_body_and_rule():
    def make(effect):
        @jax.custom_jvp
        def fn(x):
            if effect is tag:
                tag_unused(x * 2.0, name="primal_unused")
            return effect(jnp.sin(x), name="primal")

        @fn.defjvp
        def fn_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return fn(x), effect(jnp.cos(x), name="rule") * t

        return fn

    tagged, plain = make(tag), make(identity)
    assert count(jax.make_jaxpr(tagged)(X)) == 2
    assert_trees_equal(jax.jit(tagged)(X), jax.jit(plain)(X))
    grad_t = jax.grad(lambda v: tagged(v).sum())
    grad_p = jax.grad(lambda v: plain(v).sum())
    assert_trees_equal(grad_t(X), grad_p(X))
    # The primal body (its two binds) runs inside the rule; the rule binds once.
    assert count(jax.make_jaxpr(grad_t)(X)) == 3


def test_custom_vjp_body_fwd_and_bwd():
    def make(effect):
        @jax.custom_vjp
        def fn(x):
            if effect is tag:
                tag_unused(x * 2.0, name="primal_unused")
            return effect(jnp.sin(x), name="primal")

        def fn_fwd(x):
            return fn(x), jnp.cos(x)

        def fn_bwd(residual, cotangent):
            return (effect(residual, name="bwd") * cotangent,)

        fn.defvjp(fn_fwd, fn_bwd)
        return fn

    tagged, plain = make(tag), make(identity)
    assert count(jax.make_jaxpr(tagged)(X)) == 2
    assert_trees_equal(jax.jit(tagged)(X), jax.jit(plain)(X))
    grad_t = jax.grad(lambda v: tagged(v).sum())
    grad_p = jax.grad(lambda v: plain(v).sum())
    assert_trees_equal(grad_t(X), grad_p(X))
    assert_trees_equal(jax.jit(grad_t)(X), jax.jit(grad_p)(X))
    assert count(jax.make_jaxpr(grad_t)(X)) == 3


def test_custom_vjp_with_optimize_remat():
    def make(effect):
        def fwd(x):
            if effect is tag:
                tag_unused(x, name="fwd_unused")
            return effect(jnp.sin(x), name="fwd"), jnp.cos(x)

        fn = jax.custom_vjp(lambda x: jnp.sin(x))
        fn.defvjp(fwd, lambda residual, ct: (residual * ct,), optimize_remat=True)
        return fn

    tagged, plain = make(tag), make(identity)
    grad_t = jax.grad(lambda v: tagged(v).sum())
    grad_p = jax.grad(lambda v: plain(v).sum())
    assert_trees_equal(jax.jit(grad_t)(X), jax.jit(grad_p)(X))
    assert count(jax.make_jaxpr(grad_t)(X)) == 2


def test_custom_vjp_inside_scan_under_grad():
    @jax.custom_vjp
    def fn(x):
        tag_unused(x, name="inside")
        return x * 2.0

    fn.defvjp(lambda x: (fn(x), None), lambda _, ct: (ct * 2.0,))

    def loss(x):
        return jax.lax.scan(lambda c, _: (fn(c), None), x, None, length=3)[0].sum()

    assert count(jax.make_jaxpr(jax.grad(loss))(X)) == 1
    assert_trees_equal(jax.grad(loss)(X), jnp.full_like(X, 8.0))


def test_dce_keeps_the_effect():
    def fn(x):
        tag_unused(jnp.cos(x), name="dead")
        return jnp.sin(x), tag(x * 2.0, name="alive")

    jaxpr = jax.make_jaxpr(fn)(X).jaxpr
    dead, used_inputs = dce_jaxpr(jaxpr, [False, False])
    assert count(dead) == 2
    assert used_inputs == [True]
    # The oracle: the same DCE removes the effect-free work.
    assert "sin" not in primitive_names(dead)
    assert {"cos", "mul"} <= set(primitive_names(dead))


def test_dce_keeps_the_effect_in_loops():
    def fn(x):
        def body(carry, xi):
            tag_unused(carry * xi, name="loop")
            return carry + xi, jnp.sin(carry)

        return jax.lax.scan(body, x, jnp.ones((3, *X.shape)))

    jaxpr = jax.make_jaxpr(fn)(X).jaxpr
    dead, _ = dce_jaxpr(jaxpr, [False, False])
    assert count(dead) == 1
    assert "sin" not in primitive_names(dead)


# ---------------------------------------------------------------- compiled


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_compiled_program_is_unchanged(name):
    program = PROGRAMS[name]
    tagged = jax.jit(lambda v: program(v, tag))
    plain = jax.jit(lambda v: program(v, identity))
    lowered_t, lowered_p = tagged.lower(X), plain.lower(X)
    # Unordered: no token arguments or results are threaded through.
    assert "token" not in lowered_t.as_text()
    text_t, text_p = lowered_t.compile().as_text(), lowered_p.compile().as_text()
    assert hlo_opcodes(text_t) == hlo_opcodes(text_p)
    assert sum(hlo_opcodes(text_t).values()) > 3
    assert normalized_hlo(text_t) == normalized_hlo(text_p)


def test_lowered_program_only_adds_the_unused_work():
    # The lowering itself emits nothing: an identity bound on a used value
    # lowers to exactly the program without it.
    lowered_t = jax.jit(lambda v: jnp.sin(tag(v * 2.0)) + 1.0).lower(X).as_text()
    lowered_p = jax.jit(lambda v: jnp.sin(v * 2.0) + 1.0).lower(X).as_text()
    assert stablehlo_ops(lowered_t) == stablehlo_ops(lowered_p)
    assert stablehlo_ops(lowered_t)["stablehlo.sine"] == 1


def test_effect_keeps_an_otherwise_unused_argument_alive():
    # The one visible cost: jit's own dead-code elimination keeps the inputs
    # of the effect, so an argument read only by the effect stays a parameter
    # of the compiled program (XLA still removes any work feeding it).
    def tagged(x, y):
        tag_p.bind(jnp.sin(y), name="dead")
        return x * 2.0

    tagged = jax.jit(tagged)
    plain = jax.jit(lambda x, y: x * 2.0)
    text_t = tagged.lower(X, X).compile().as_text()
    text_p = plain.lower(X, X).compile().as_text()
    assert entry_parameters(text_t) == ["x", "y"]
    assert entry_parameters(text_p) == ["x"]
    assert hlo_opcodes(text_t)["sine"] == 0
    assert_trees_equal(tagged(X, X), plain(X, X))


@pytest.mark.parametrize("name", ["math", "scan", "cond", "checkpoint"])
def test_compiled_grad_is_unchanged(name):
    program = PROGRAMS[name]
    grad_t = jax.jit(jax.grad(lambda v: program(v, tag)))
    grad_p = jax.jit(jax.grad(lambda v: program(v, identity)))
    text_t = grad_t.lower(X).compile().as_text()
    text_p = grad_p.lower(X).compile().as_text()
    assert hlo_opcodes(text_t) == hlo_opcodes(text_p)
    assert normalized_hlo(text_t) == normalized_hlo(text_p)


def test_compiled_grad_keeps_the_primal_input_of_an_unused_effect():
    # `jax.grad` of a linear scan needs no primal value, so plain JAX drops
    # the argument; the effect reads it in the forward scan, so it stays an
    # (unused) parameter. Everything else compiles to the same program.
    def program(x, effect):
        def body(carry, xi):
            if effect is tag:
                tag_unused(carry * xi, name="in_scan")
            return carry * xi, None

        return jax.lax.scan(body, x, jnp.arange(3.0))[0].sum()

    text_t = jax.jit(jax.grad(lambda v: program(v, tag))).lower(X).compile().as_text()
    text_p = jax.jit(jax.grad(lambda v: program(v, identity))).lower(X).compile().as_text()
    assert entry_parameters(text_t) == ["v"]
    assert entry_parameters(text_p) == []
    assert without_parameters(normalized_hlo(text_t)) == without_parameters(normalized_hlo(text_p))


# ---------------------------------------------------------------- shard_map


def shard_program(effect, mesh):

    def body(x, w):
        # `x` varies over x and y, `w` is replicated: the effect must keep
        # each one's varying manual axes.
        x_out, w_out = effect(x, w)
        if effect is tag_pair:
            tag_unused(jnp.sin(w_out), name="unused")
            assert jax.typeof(x_out).mat.varying == jax.typeof(x).mat.varying == {"x", "y"}
            assert jax.typeof(w_out).mat.varying == jax.typeof(w).mat.varying == frozenset()
        total = jax.lax.psum(jnp.sum(x_out * w_out), ("x", "y"))
        return x_out * 2.0 + total, w_out

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P("x", "y"), P()), out_specs=(P("x", "y"), P()), check_vma=True
    )


def tag_pair(x, w):
    return tag_p.bind(x, w, name="pair")


def no_tag_pair(x, w):
    return x, w


SX = jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) / 10.0
SW = jnp.float32(0.5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_shard_map_identity_and_vma(jit, mesh42):
    wrap = jax.jit if jit else (lambda fn: fn)
    tagged = wrap(shard_program(tag_pair, mesh42))
    plain = wrap(shard_program(no_tag_pair, mesh42))
    assert_trees_equal(tagged(SX, SW), plain(SX, SW))
    assert count(jax.make_jaxpr(tagged)(SX, SW)) == 2


def test_shard_map_vma_mismatch_is_still_caught(mesh42):
    # The oracle: were the effect to widen the varying axes, `check_vma=True`
    # would reject the replicated out-spec, as it rejects a real varying value.

    def body(x, w):
        (w,) = tag_p.bind(w)
        return w + jax.lax.axis_index("x").astype(jnp.float32)

    with pytest.raises(ValueError, match="vary"):
        jax.shard_map(body, mesh=mesh42, in_specs=(P("x"), P()), out_specs=P(), check_vma=True)(
            SX, SW
        )


def test_shard_map_grad_keeps_unused_effect_and_matches(mesh42):
    def loss(effect):
        program = shard_program(effect, mesh42)
        return lambda x, w: jnp.sum(program(x, w)[0] ** 2) + program(x, w)[1]

    grad_t = jax.grad(loss(tag_pair), argnums=(0, 1))
    grad_p = jax.grad(loss(no_tag_pair), argnums=(0, 1))
    assert_trees_equal(jax.jit(grad_t)(SX, SW), jax.jit(grad_p)(SX, SW))
    assert_trees_equal(grad_t(SX, SW), grad_p(SX, SW))
    # Two calls of the program, two binds each, once each under grad.
    assert count(jax.make_jaxpr(grad_t)(SX, SW)) == 4


def test_shard_map_scan_grad_keeps_unused_effect(mesh42):

    def body(x):
        def step(carry, _):
            tag_unused(carry, name="shard_scan")
            return carry * 1.5, None

        return jax.lax.scan(step, x, None, length=2)[0]

    fn = jax.shard_map(body, mesh=mesh42, in_specs=P("x"), out_specs=P("x"), check_vma=True)
    grad = jax.grad(lambda x: fn(x).sum())
    assert count(jax.make_jaxpr(grad)(SX)) == 1
    assert_trees_equal(jax.jit(grad)(SX), jnp.full_like(SX, 2.25))


def test_partial_manual_shard_map(mesh42):

    def program(effect):
        def body(x):
            (y,) = effect(x)
            return y * 3.0

        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh42,
                in_specs=P("x"),
                out_specs=P("x"),
                axis_names={"x"},
                check_vma=True,
            )
        )

    tagged = program(lambda x: tag_p.bind(x, name="partial"))
    plain = program(lambda x: (x,))
    assert_trees_equal(tagged(SX), plain(SX))
    assert_trees_equal(jax.grad(lambda x: tagged(x).sum())(SX), jnp.full_like(SX, 3.0))
    assert count(jax.make_jaxpr(tagged)(SX)) == 1


def test_vmap_of_shard_map(mesh42):
    program = shard_program(tag_pair, mesh42)
    plain = shard_program(no_tag_pair, mesh42)
    xs = jnp.stack([SX, SX * 2.0])
    assert_trees_equal(
        jax.jit(jax.vmap(program, in_axes=(0, None)))(xs, SW),
        jax.jit(jax.vmap(plain, in_axes=(0, None)))(xs, SW),
    )


# ---------------------------------------------------------------- nesting


def test_deep_nesting_under_jit_vmap_grad():
    def program(effect):
        def inner(v):
            def step(carry, xi):
                carry = jax.lax.cond(
                    xi > 1.0,
                    lambda c: effect(jnp.sin(c), name="cond"),
                    lambda c: c * 0.5,
                    carry,
                )
                if effect is tag:
                    tag_unused(carry, name="unused")
                return carry, None

            return jax.lax.scan(step, v, jnp.arange(3.0))[0]

        return lambda v: jax.checkpoint(inner)(v).sum()

    tagged = jax.jit(jax.vmap(jax.grad(program(tag))))
    plain = jax.jit(jax.vmap(jax.grad(program(identity))))
    xs = jnp.stack([X, X + 1.0])
    # JAX 0.10.2's type checker rejects this program even without the effect
    # (`_check_closed_call() got an unexpected keyword argument 'name'`).
    with jax.enable_checks(False):
        assert_trees_equal(tagged(xs), plain(xs))
        # Each effect forward and in the recomputation of the checkpoint.
        assert count(jax.make_jaxpr(tagged)(xs)) == 4
