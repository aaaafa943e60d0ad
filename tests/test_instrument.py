"""`kups.instrument.count_primitives`, checked against counts worked out by hand
from each program's structure: which primitives each line binds, and how often
the control flow around it runs."""

import inspect
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.random import define_prng_impl
from jax.sharding import PartitionSpec as P

from kups import instrument
from kups.checks import check, checked
from kups.effects import InterpreterPolicy
from kups.instrument import PrimitiveCounts, count_flops, count_primitives
from library_primitive import library_call, library_fn_call

X = jnp.float32(0.5)


def assert_trees_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def counts_of(fn, *args, **kwargs):
    """The counts of `fn`, eagerly and under `jax.jit`, checked to agree."""
    out, counts = count_primitives(fn)(*args, **kwargs)
    assert_trees_close(out, fn(*args, **kwargs))
    # filter_jit: non-array arguments stay static, as they are for count_primitives.
    jit_out, jit_counts = eqx.filter_jit(count_primitives(fn))(*args, **kwargs)
    assert_trees_close(jit_out, out)
    assert isinstance(counts, PrimitiveCounts)
    assert isinstance(jit_counts, PrimitiveCounts)
    assert all(type(count) is int for count in counts.values())
    assert all(jnp.asarray(count).dtype == jnp.int32 for count in jit_counts.values())
    assert {name: int(count) for name, count in jit_counts.items()} == counts
    return counts


# ------------------------------------------------------------ straight-line code


def test_straight_line():
    def f(x):
        return jnp.sin(x) * jnp.cos(x) + x  # sin, cos, mul, add

    assert counts_of(f, X) == {"sin": 1, "cos": 1, "mul": 1, "add": 1}


def test_repeated_primitive():
    def f(x):
        return jnp.sin(jnp.sin(jnp.sin(x)))

    assert counts_of(f, X) == {"sin": 3}


def test_no_primitive():
    out, counts = count_primitives(lambda x: x)(X)
    assert out == X
    assert counts == {}


def test_integer_and_static_arguments():
    # `n` is a Python int, hence static: `x * n` is one `mul` by a literal.
    def f(x, n, *, scale):
        return x * n + scale

    counts = counts_of(f, X, 3, scale=2.0)
    assert counts == {"mul": 1, "add": 1}


# ------------------------------------------------------------ control flow, alone


def test_jit():
    @jax.jit
    def inner(x):
        return jnp.sin(x) + 1.0  # sin, add

    def f(x):
        return inner(inner(x)) * 2.0  # two calls, then mul

    assert counts_of(f, X) == {"sin": 2, "add": 2, "mul": 1}


@pytest.mark.parametrize("length", [0, 1, 5])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan(length, reverse):
    def f(xs):
        def body(carry, x):
            return carry + jnp.sin(x), jnp.cos(x)  # add, sin, cos per iteration

        return lax.scan(body, jnp.float32(0), xs, reverse=reverse)

    xs = jnp.linspace(0.0, 1.0, length)
    assert counts_of(f, xs) == {"add": length, "sin": length, "cos": length}


def test_scan_with_unroll_and_consts():
    def f(xs, scale):
        def body(carry, x):
            return carry * scale + x, None  # mul, add per iteration

        return lax.scan(body, jnp.float32(1), xs, unroll=2)[0]

    assert counts_of(f, jnp.ones(4), jnp.float32(2)) == {"mul": 4, "add": 4}


def test_fori_loop():
    def f(x):
        # Static bounds make a scan whose body also increments the index (add).
        return lax.fori_loop(0, 4, lambda i, v: v * 2.0, x)

    assert counts_of(f, X) == {"add": 4, "mul": 4}


@pytest.mark.parametrize("trips", [0, 1, 3])
def test_while(trips):
    def f(x, n):
        def cond(state):
            return state[0] < n  # lt: one time more than the body

        def body(state):
            i, v = state
            return i + 1, jnp.sin(v)  # add, sin

        return lax.while_loop(cond, body, (jnp.int32(0), x))

    counts = counts_of(f, X, jnp.int32(trips))
    assert counts == {"lt": trips + 1, "add": trips, "sin": trips}


def test_fori_loop_with_traced_bounds_is_a_while():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, v: v * 2.0, x)

    counts = counts_of(f, X, jnp.int32(3))
    # The while loop's condition compares (lt) trips + 1 times; its body
    # increments the index (add) and multiplies, three times each.
    assert counts == {"lt": 4, "add": 3, "mul": 3}


@pytest.mark.parametrize("pred", [False, True])
def test_cond_counts_only_the_taken_branch(pred):
    def f(p, x):
        # The bool predicate becomes an int32 index (convert_element_type).
        return lax.cond(p, lambda x: jnp.sin(x) * x, jnp.cos, x)

    counts = counts_of(f, jnp.bool_(pred), X)
    taken = int(pred)
    # Primitives of the branch not taken are listed with zero.
    assert counts == {"convert_element_type": 1, "sin": taken, "mul": taken, "cos": 1 - taken}


@pytest.mark.parametrize("index", [0, 1, 2, 7])
def test_switch(index):
    def f(i, x):
        # The index is clamped into range (clamp), then one branch runs.
        return lax.switch(i, [jnp.sin, jnp.cos, lambda x: jnp.tan(x) + x], x)

    taken = min(index, 2)
    counts = counts_of(f, jnp.int32(index), X)
    assert counts == {
        "clamp": 1,
        "sin": int(taken == 0),
        "cos": int(taken == 1),
        "tan": int(taken == 2),
        "add": int(taken == 2),
    }


def test_checkpoint():
    def f(x):
        return jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)))(x) + x

    assert counts_of(f, X) == {"sin": 2, "add": 1}


def test_custom_jvp():
    @jax.custom_jvp
    def g(x):
        return jnp.sin(x) * 3.0

    g.defjvp(lambda primals, tangents: (g(primals[0]), tangents[0]))

    def f(x):
        return g(x) + g(x)

    assert counts_of(f, X) == {"sin": 2, "mul": 2, "add": 1}


def test_custom_vjp():
    @jax.custom_vjp
    def g(x):
        return jnp.exp(x)

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (ct,))

    def f(x):
        return g(g(x))

    assert counts_of(f, X) == {"exp": 2}


def test_shard_map_full_manual(mesh42):
    # 4 x 2 = 8 shards, each runs the body once.
    def f(x):
        return jax.shard_map(
            lambda a: jnp.sin(a) * a, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y")
        )(x)

    assert counts_of(f, jnp.ones((8, 4))) == {"sin": 8, "mul": 8}


def test_shard_map_partial_manual(mesh42):
    # Manual over x only: 4 shards.
    def f(x):
        return jax.shard_map(
            lambda a: jnp.sin(a) * a,
            mesh=mesh42,
            in_specs=P("x"),
            out_specs=P("x"),
            axis_names={"x"},
        )(x)

    assert counts_of(f, jnp.ones((8, 4))) == {"sin": 4, "mul": 4}


def test_shard_map_one_axis_mesh(mesh8):
    def f(x):
        return jax.shard_map(lambda a: jnp.cos(a), mesh=mesh8, in_specs=P("i"), out_specs=P("i"))(x)

    assert counts_of(f, jnp.ones(16)) == {"cos": 8}


def test_shard_map_with_collective(mesh42):
    def f(x):
        def body(a):
            # exp, then psum on each shard; JAX 0.10 binds a psum whose result is
            # invariant over the summed axis as `psum_invariant`.
            return lax.psum(jnp.exp(a), "y")

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x"))(x)

    assert counts_of(f, jnp.ones((8, 4))) == {"exp": 8, "psum_invariant": 8}


def test_shard_map_with_per_shard_trip_counts(mesh42):
    # Shard (x, y) runs the loop x times: 0 + 1 + 2 + 3 = 6 trips for each y.
    def f(x):
        def body(a):
            n = lax.axis_index("x")  # axis_index, once per shard

            def cond(state):
                # The invariant counter is cast to varying over x (pvary) to be
                # compared (lt) with the varying bound.
                return state[0] < n

            def step(state):
                return state[0] + 1, jnp.sin(state[1])

            return lax.while_loop(cond, step, (jnp.int32(0), a))[1]

        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    trips = 2 * (0 + 1 + 2 + 3)
    assert counts_of(f, jnp.ones((8, 4))) == {
        "axis_index": 8,
        "pvary": trips + 8,  # one more per shard
        "lt": trips + 8,
        "add": trips,
        "sin": trips,
    }


# ------------------------------------------------------------ nested control flow


@pytest.mark.parametrize("pred", [False, True])
def test_shard_map_in_cond(mesh42, pred):
    def f(p, x):
        sharded = jax.shard_map(
            lambda a: jnp.sin(a) * a, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y")
        )
        return lax.cond(p, sharded, jnp.cos, x)

    taken = int(pred)
    counts = counts_of(f, jnp.bool_(pred), jnp.ones((8, 4)))
    assert counts == {
        "convert_element_type": 1,
        "sin": 8 * taken,
        "mul": 8 * taken,
        "cos": 1 - taken,
    }


def test_scan_in_scan():
    def f(xs):
        def outer(carry, x):
            def inner(c, y):
                return c + jnp.sin(y), None  # add, sin: 3 * 4 times

            carry, _ = lax.scan(inner, carry, xs[:3] * x)  # mul: 4 times
            return carry, jnp.cos(carry)  # cos: 4 times

        return lax.scan(outer, jnp.float32(0), xs)

    counts = counts_of(f, jnp.linspace(0.1, 0.4, 4))
    # `xs[:3]` is a slice, once per outer iteration.
    assert counts == {"slice": 4, "mul": 4, "add": 12, "sin": 12, "cos": 4}


def test_while_in_scan_in_cond_under_jit():
    def loop(x, n):
        # Runs n times (add, mul); the condition (lt) n + 1 times.
        return lax.while_loop(
            lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] * 1.5), (jnp.int32(0), x)
        )[1]

    def scanned(x, ns):
        return lax.scan(lambda c, n: (loop(c, n), None), x, ns)[0]

    @jax.jit
    def f(p, x, ns):
        return lax.cond(p, scanned, lambda x, ns: jnp.exp(x), x, ns)

    ns = jnp.array([2, 0, 3], jnp.int32)
    trips = 2 + 0 + 3
    taken = counts_of(f, jnp.bool_(True), X, ns)
    assert taken == {
        "convert_element_type": 1,
        "lt": trips + 3,
        "add": trips,
        "mul": trips,
        "exp": 0,
    }
    other = counts_of(f, jnp.bool_(False), X, ns)
    assert other == {"convert_element_type": 1, "lt": 0, "add": 0, "mul": 0, "exp": 1}


def test_cond_in_while():
    def f(x, n):
        def body(state):
            i, v = state
            # rem, eq, then convert_element_type of the predicate to an index
            v = lax.cond(lax.rem(i, 2) == 0, jnp.sin, jnp.cos, v)
            return i + 1, v

        return lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), x))

    # i = 0..4: sin on 0, 2, 4 and cos on 1, 3.
    counts = counts_of(f, X, jnp.int32(5))
    assert counts == {
        "lt": 6,
        "rem": 5,
        "eq": 5,
        "convert_element_type": 5,
        "sin": 3,
        "cos": 2,
        "add": 5,
    }


def test_scan_in_shard_map_in_scan(mesh42):
    def f(init, xs):
        def body(a):
            return lax.scan(lambda c, _: (jnp.sin(c), None), a, length=3)[0]

        sharded = jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))

        def step(carry, x):
            return sharded(carry) * x, None  # mul: once per outer iteration

        return lax.scan(step, init, xs)[0]

    # 2 outer iterations x 8 shards x 3 inner iterations.
    assert counts_of(f, jnp.ones((8, 4)), jnp.ones(2)) == {"sin": 48, "mul": 2}


def test_checkpoint_and_custom_jvp_in_scan():
    @jax.custom_jvp
    def g(x):
        return jnp.tanh(x)

    g.defjvp(lambda primals, tangents: (g(primals[0]), tangents[0]))

    def f(xs):
        body = jax.checkpoint(lambda c, x: (g(c) + x, None))
        return lax.scan(body, jnp.float32(0), xs)[0]

    assert counts_of(f, jnp.ones(6)) == {"tanh": 6, "add": 6}


# ------------------------------------------------------------ transformations


def test_vmap_of_counted_function():
    def f(x):
        return jnp.sin(x) + 1.0

    out, counts = jax.vmap(count_primitives(f))(jnp.ones(3))
    np.testing.assert_allclose(out, f(jnp.ones(3)))
    # The counts do not depend on the batch: one sin, one add, per element.
    assert {name: np.asarray(c).tolist() for name, c in counts.items()} == {
        "sin": [1, 1, 1],
        "add": [1, 1, 1],
    }


def test_grad_through_counted_function():
    def f(x):
        return jnp.sin(x) * 2.0

    grad, counts = jax.grad(lambda x: count_primitives(f)(x), has_aux=True)(X)
    np.testing.assert_allclose(grad, 2.0 * jnp.cos(X), rtol=1e-6)
    assert {name: int(c) for name, c in counts.items()} == {"sin": 1, "mul": 1}


# ------------------------------------------------------------ PrimitiveCounts


def test_primitive_counts_is_a_plain_dict_in_name_order():
    counts = counts_of(lambda x: jnp.sin(jnp.cos(jnp.sin(x))) + x, X)
    assert isinstance(counts, dict)
    assert counts == {"add": 1, "cos": 1, "sin": 2}
    assert dict(counts) == {"sin": 2, "cos": 1, "add": 1}
    assert list(counts) == ["add", "cos", "sin"]
    assert counts.total() == 4


def test_primitive_counts_repr_is_a_table_sorted_by_count():
    counts = PrimitiveCounts({"add": 1, "sin": 12, "cos": 3, "mul": 3})
    lines = repr(counts).splitlines()
    assert lines[0] == "PrimitiveCounts("
    assert lines[-1] == ")"
    rows = [line.split() for line in lines[3:-1]]
    assert rows == [["sin", "12"], ["cos", "3"], ["mul", "3"], ["add", "1"]]
    assert lines[1].split() == ["primitive", "count"]
    # Right-aligned counts.
    assert len({len(line) for line in lines[1:-1]}) == 1
    assert repr(PrimitiveCounts()) == "PrimitiveCounts({})"


def test_primitive_counts_html():
    html = PrimitiveCounts({"a<b": 2, "sin": 5})._repr_html_()
    assert html.startswith("<table>")
    assert "<code>a&lt;b</code>" in html
    assert html.index("sin") < html.index("a&lt;b")  # sorted by count
    assert re.search(r"<td[^>]*>5</td>", html)


def test_primitive_counts_is_a_pytree():
    counts = PrimitiveCounts({"sin": 2, "add": 1})
    leaves, treedef = jax.tree.flatten(counts)
    assert leaves == [1, 2]
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert type(rebuilt) is PrimitiveCounts
    assert rebuilt == counts
    doubled = jax.tree.map(lambda c: 2 * c, counts)
    assert type(doubled) is PrimitiveCounts and doubled == {"sin": 4, "add": 2}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(counts)[0]]
    assert paths == ["['add']", "['sin']"]


def test_jitted_counts_print():
    _, counts = jax.jit(count_primitives(lambda x: jnp.sin(x) * x))(X)
    text = repr(counts)
    assert "sin" in text and "mul" in text
    assert re.search(r"sin\s+1\b", text)


def test_vmapped_counts_print_one_count_per_element():
    def doubling(x):
        return lax.while_loop(lambda v: v < 10.0, lambda v: v * 2.0, x)

    _, counts = jax.vmap(count_primitives(doubling))(jnp.array([1.0, 3.0, 20.0]))
    assert re.search(r"mul\s+\[4 2 0\]", repr(counts))
    assert "[5 3 1]" in counts._repr_html_()


# ------------------------------------------------------------ opaque control flow
# `library_call` is a control-flow primitive kups has no handler for (see
# tests/library_primitive.py): what it runs cannot be counted.

IGNORE, WARN, RAISE = InterpreterPolicy.IGNORE, InterpreterPolicy.WARN, InterpreterPolicy.RAISE


def opaque_counts_of(fn, *args, policy=IGNORE):
    """The counts of `fn` under `policy`, eagerly and under `jax.jit`, checked to
    agree (opaque calls too); warnings are errors unless `policy` is WARN."""
    with warnings.catch_warnings():
        if policy is not WARN:
            warnings.simplefilter("error")
        counted = count_primitives(fn, policy=policy)
        out, counts = counted(*args)
        assert_trees_close(out, fn(*args))
        jit_out, jit_counts = eqx.filter_jit(counted)(*args)
    assert_trees_close(jit_out, out)
    assert all(type(count) is int for count in counts.opaque.values())
    assert all(jnp.asarray(count).dtype == jnp.int32 for count in jit_counts.opaque.values())
    assert {name: int(count) for name, count in jit_counts.items()} == counts
    assert {name: int(count) for name, count in jit_counts.opaque.items()} == counts.opaque
    return counts


def around_library_calls(x, xs):
    y = library_call(lambda a: jnp.sin(a) * 2.0, x)[0]  # one opaque call

    def body(carry, x):
        carry = carry + x  # add, per iteration
        return library_call(jnp.cos, carry)[0], None  # one opaque call per iteration

    return jnp.exp(lax.scan(body, y, xs)[0])  # exp


def test_policy_must_be_an_interpreter_policy():
    with pytest.raises(TypeError, match=r"RAISE.*WARN.*IGNORE.*InterpreterPolicy\.IGNORE"):
        count_primitives(jnp.sin, policy="ignore")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="got None"):
        count_primitives(jnp.sin, policy=None)  # pyright: ignore[reportArgumentType]


def test_a_library_primitive_holding_a_function_is_opaque():
    # It holds `sin`'s Python function, not a jaxpr: what it runs cannot be counted.
    def f(x):
        return jnp.exp(library_fn_call(lambda v: (jnp.sin(v) * 2.0,), x)[0])

    with pytest.raises(NotImplementedError, match=r"primitive 'library_fn_call' at .*IGNORE"):
        count_primitives(f)(X)
    counts = opaque_counts_of(f, X)
    assert dict(counts) == {"exp": 1} and counts.opaque == {"library_fn_call": 1}


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_keys_made_inside_the_program_are_counted(impl):
    # `random_seed` and `random_wrap` hold their key type (functions JAX lowers
    # them with) in their params: JAX's own key types hide nothing of the program.
    def f(x, data):
        key = jax.random.key(0, impl=impl)
        k1, k2 = jax.random.split(key)
        k3 = jax.random.wrap_key_data(data, impl=impl)
        noise = jax.random.normal(jax.random.fold_in(k1, 3), (3,))
        return x + noise + jax.random.uniform(k2, (3,)) + jax.random.uniform(k3, (3,))

    data = jax.random.key_data(jax.random.key(1, impl=impl))
    x = jnp.ones(3)
    out, counts = count_primitives(f)(x, data)
    # Called eagerly, the effect is compiled as a whole: it equals jax.jit(f).
    np.testing.assert_array_equal(out, jax.jit(f)(x, data))
    jit_out, jit_counts = jax.jit(count_primitives(f))(x, data)
    np.testing.assert_array_equal(jit_out, jax.jit(f)(x, data))
    assert counts["random_seed"] == 1 and counts["random_wrap"] == 1
    assert counts["random_split"] == 1 and counts["random_fold_in"] == 1
    assert counts.opaque == {}
    assert {name: int(count) for name, count in jit_counts.items()} == counts


def test_a_key_type_of_the_users_own_is_opaque():
    # Its functions are the user's, run where JAX lowers `random_seed`: kups
    # cannot see them, and says so.
    def seed(s):
        return jnp.stack([s, s + 1]).astype(jnp.uint32)

    def split(key, shape):
        return jnp.broadcast_to(key, (*shape, 2))

    def random_bits(key, bit_width, shape):
        del key, bit_width
        return jnp.zeros(shape, jnp.uint32)

    mine = define_prng_impl(
        key_shape=(2,),
        seed=seed,
        split=split,
        random_bits=random_bits,
        fold_in=lambda key, data: key,
        name="mine",
        tag="mine",
    )

    def f(x):
        return x + jax.random.key_data(jax.random.key(0, impl=mine)).sum()

    with pytest.raises(NotImplementedError, match=r"primitive 'random_seed' at .*key type"):
        count_primitives(f)(X)
    counts = opaque_counts_of(f, X)
    assert counts.opaque == {"random_seed": 1}


def test_raise_names_the_opaque_primitive_and_the_way_out():
    for counted in (
        count_primitives(around_library_calls),
        jax.jit(count_primitives(around_library_calls, policy=RAISE)),
    ):
        with pytest.raises(NotImplementedError) as info:
            counted(X, jnp.ones(5))
        message = str(info.value)
        assert "'library_call'" in message
        assert "library_primitive.py" in message  # where it was bound
        assert "policy=InterpreterPolicy.IGNORE" in message
        assert ".opaque" in message


@pytest.mark.parametrize("policy", [IGNORE, WARN])
def test_opaque_calls_are_reported_and_everything_around_them_counted(policy):
    xs = jnp.linspace(0.0, 1.0, 5)
    if policy is WARN:
        with pytest.warns(UserWarning, match=r"cannot count inside .*'library_call'"):
            counts = opaque_counts_of(around_library_calls, X, xs, policy=WARN)
    else:
        counts = opaque_counts_of(around_library_calls, X, xs)
    # Nothing the library calls run (sin, mul, cos) is counted; what runs
    # around them is, exactly.
    assert counts == {"add": 5, "exp": 1}
    assert counts.opaque == {"library_call": 6}  # once, then once per iteration


@pytest.mark.parametrize("trips", [0, 3])
def test_opaque_call_in_while_counts_its_trips(trips):
    def f(x, n):
        def body(state):
            i, v = state
            return i + 1, library_call(jnp.sin, v)[0]  # add, one opaque call

        return lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), x))[1]

    counts = opaque_counts_of(f, X, jnp.int32(trips))
    assert counts == {"lt": trips + 1, "add": trips}
    assert counts.opaque == {"library_call": trips}


@pytest.mark.parametrize("pred", [False, True])
def test_opaque_call_in_cond_counts_only_when_taken(pred):
    def f(p, x):
        return lax.cond(p, lambda x: library_call(jnp.sin, x)[0], jnp.cos, x)

    counts = opaque_counts_of(f, jnp.bool_(pred), X)
    taken = int(pred)
    assert counts == {"convert_element_type": 1, "cos": 1 - taken}
    assert counts.opaque == {"library_call": taken}  # listed with 0 when not taken


def test_opaque_call_in_jit_in_scan_in_shard_map(mesh42):
    @jax.jit
    def step(carry, _):
        return library_call(lambda c: c * 2.0, carry)[0], None

    def body(block):
        return jnp.sin(lax.scan(step, block, None, length=3)[0])  # sin, once per shard

    def f(x):
        return jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)

    counts = opaque_counts_of(f, jnp.ones((8, 4)))
    assert counts == {"sin": 8}
    assert counts.opaque == {"library_call": 8 * 3}  # 8 shards, 3 iterations each


def test_only_the_outermost_opaque_call_is_seen():
    def f(x):
        return library_call(lambda a: library_call(jnp.sin, a)[0] * 2.0, x)[0] + x

    counts = opaque_counts_of(f, X)
    assert counts == {"add": 1}
    assert counts.opaque == {"library_call": 1}


def test_a_program_without_opaque_calls_counts_the_same_under_every_policy():
    def f(xs):
        return lax.scan(lambda c, x: (c + jnp.sin(x), None), jnp.float32(0), xs)[0]

    for policy in InterpreterPolicy:
        counts = opaque_counts_of(f, jnp.ones(4), policy=policy)
        assert counts == {"add": 4, "sin": 4} and counts.opaque == {}


def test_lineax_cg_with_a_function_operator():
    lx = pytest.importorskip("lineax")

    def solve(diagonal, b):
        # The operator closes over a traced array, so lineax's `linear_solve`
        # primitive holds it as a jaxpr; kups goes inside the primitive (see
        # tests/test_library_primitives.py and tests/test_ecosystem.py).
        operator = lx.FunctionLinearOperator(
            lambda v: diagonal * v,
            jax.ShapeDtypeStruct(b.shape, b.dtype),
            tags=lx.positive_semidefinite_tag,
        )
        return lx.linear_solve(operator, b, lx.CG(rtol=1e-6, atol=1e-6)).value

    def f(diagonals, b):
        return lax.scan(lambda c, d: (c + jnp.sin(solve(d, b)), None), jnp.zeros(3), diagonals)[0]

    diagonals = jnp.array([[2.0, 3.0, 4.0], [1.0, 5.0, 2.0]])
    b = jnp.array([1.0, 2.0, 3.0])
    counts = opaque_counts_of(f, diagonals, b, policy=RAISE)
    assert counts.opaque == {}
    assert counts["sin"] == 2 and counts["add"] >= 2
    # The solver's own loop runs inside the solve, and is counted.
    assert counts["mul"] > 2


def test_primitive_counts_show_opaque_calls():
    counts = PrimitiveCounts({"add": 3, "exp": 1}, opaque={"linear_solve": 2})
    lines = repr(counts).splitlines()
    assert [line.split() for line in lines[3:-1]] == [
        ["add", "3"],
        ["exp", "1"],
        ["not", "counted", "inside:"],
        ["linear_solve", "2"],
    ]
    assert "not counted inside" in counts._repr_html_()
    assert "<code>linear_solve</code>" in counts._repr_html_()
    # Opaque calls ran, but are not primitives whose insides were counted.
    assert counts.total() == 4
    only_opaque = PrimitiveCounts(opaque={"library_call": 1})
    assert "library_call" in repr(only_opaque)
    assert "not counted inside" not in repr(PrimitiveCounts({"add": 1}))


def test_primitive_counts_pytree_keeps_opaque_calls():
    counts = PrimitiveCounts({"sin": 2, "add": 1}, opaque={"library_call": 5})
    leaves, treedef = jax.tree.flatten(counts)
    assert leaves == [1, 2, 5]
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt == counts and rebuilt.opaque == {"library_call": 5}
    doubled = jax.tree.map(lambda c: 2 * c, counts)
    assert doubled == {"sin": 4, "add": 2} and doubled.opaque == {"library_call": 10}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(counts)[0]]
    assert paths == ["['add']", "['sin']", ".opaque['library_call']"]


# ------------------------------------------------------------ errors, docs


def test_wrapped_keeps_the_name_of_the_function():
    def my_function(x):
        return x

    assert count_primitives(my_function).__name__ == "my_function"


def test_docstring_examples_run():
    for obj in (instrument.count_primitives, instrument.PrimitiveCounts):
        for block in re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", re.S):
            exec(compile(block, f"<docstring of {obj.__name__}>", "exec"), {})


def test_exported_counted_function_round_trips():
    # PrimitiveCounts is registered with jax.export: a jitted counted function
    # exports, serializes, deserializes and returns the same counts.
    def f(x, limit):
        def body(state):
            i, y = state
            return i + 1, jnp.sin(y)

        return lax.while_loop(lambda state: state[0] < limit, body, (jnp.int32(0), x))[1]

    exported = jax.export.export(jax.jit(count_primitives(f)))(
        jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    )
    restored = jax.export.deserialize(exported.serialize())
    out, counts = restored.call(X, jnp.int32(4))
    expected_out, expected = count_primitives(f)(X, jnp.int32(4))
    assert type(counts) is PrimitiveCounts
    assert {name: int(count) for name, count in counts.items()} == expected
    assert expected == {"add": 4, "lt": 5, "sin": 4}
    assert counts.opaque == {}
    np.testing.assert_array_equal(out, expected_out)


def test_exported_counts_keep_opaque_calls():
    exported = jax.export.export(jax.jit(count_primitives(around_library_calls, policy=IGNORE)))(
        jax.ShapeDtypeStruct(X.shape, X.dtype), jax.ShapeDtypeStruct((5,), jnp.float32)
    )
    _, counts = jax.export.deserialize(exported.serialize()).call(X, jnp.ones(5))
    assert {name: int(count) for name, count in counts.opaque.items()} == {"library_call": 6}
    assert {name: int(count) for name, count in counts.items()} == {"add": 5, "exp": 1}


def test_reports_of_eval_shape_print_and_sum_to_shapes():
    _, counts = jax.eval_shape(count_primitives(jnp.sin), jnp.ones(3))
    assert "sin        abstract int32[]" in repr(counts)
    _, cost = jax.eval_shape(count_flops(jnp.sin), jnp.ones(3))
    assert "abstract float32[]" in repr(cost)
    assert cost.flops == jax.ShapeDtypeStruct((), jnp.float32)
    assert cost.unpriced == {}
    _, error = jax.eval_shape(
        checked(lambda x: (check(x.sum() > 0, "negative"), x)[1]), jnp.ones(3)
    )
    assert repr(error) == "Error(<traced>, 1 check sites)"
