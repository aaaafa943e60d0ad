"""`kups.instrument.count_flops`, checked against XLA's own cost analysis where it
is exact (loop-free programs) and against counts worked out by hand from each
program's structure where XLA and `jax.experimental.roofline` count a loop body
once."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from kups import instrument
from kups.effects import InterpreterPolicy
from kups.instrument import Cost, count_flops, count_primitives
from library_primitive import library_call

F32 = 4  # bytes


def xla_cost(fn, *args):
    """XLA's figures for the compiled `fn` (a dict on recent JAX, a list of one
    dict on older releases)."""
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, list):
        (analysis,) = analysis
    return {key: int(analysis.get(key, 0.0)) for key in ("flops", "transcendentals")}


def totals(cost):
    return cost.flops, cost.transcendentals, cost.bytes_accessed


# ---------------------------------------------------------------------------
# Loop-free programs: the same FLOPs and transcendentals as XLA.
# ---------------------------------------------------------------------------

A, B = jnp.ones((4, 8)), jnp.ones((8, 16))


def mlp(w1, w2, x):
    return jnp.sum(jnp.tanh(x @ w1) @ w2 + 1.0)


LOOP_FREE = {
    "matmul": (lambda a, b: a @ b, (A, B)),
    "batched einsum": (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        (jnp.ones((3, 4, 5)), jnp.ones((3, 5, 6))),
    ),
    "tanh of a product": (lambda a, b: jnp.tanh(a @ b) + 1.0, (A, B)),
    "transcendentals": (lambda x: jnp.exp(x) * jnp.log(x) + jnp.sin(x), (jnp.ones(100),)),
    "integer power": (lambda x: x**3, (jnp.ones(100),)),
    "reduction": (lambda x: jnp.sum(x, axis=1), (jnp.ones((10, 20)),)),
    "convolution, same padding": (
        lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME"),
        (jnp.ones((2, 3, 16, 16)), jnp.ones((5, 3, 3, 3))),
    ),
    "convolution, strided": (
        lambda x, k: lax.conv_general_dilated(x, k, (2, 2), "VALID"),
        (jnp.ones((2, 3, 16, 16)), jnp.ones((5, 3, 3, 3))),
    ),
    "mlp": (mlp, (jnp.ones((8, 32)), jnp.ones((32, 4)), jnp.ones((16, 8)))),
    "max pooling": (
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        (jnp.ones((1, 8, 8, 2)),),
    ),
    "sum pooling, same padding": (
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"),
        (jnp.ones((1, 8, 8, 2)),),
    ),
    "fft": (jnp.fft.fft, (jnp.ones((4, 16), jnp.complex64),)),
    "real fft": (jnp.fft.rfft, (jnp.ones(64),)),
    "scatter-subtract": (
        lambda x, i: x.at[i].subtract(1.0),
        (jnp.ones(16), jnp.array([1, 2], jnp.int32)),
    ),
}
# Not compared with XLA: its algebraic simplifier rewrites the elementwise tail of a
# backward pass (multiplications by one, broadcasts of the cotangent), so its count
# is that of another program. Its matrix products are the same.
GRAD_MLP = (jax.grad(mlp), (jnp.ones((8, 32)), jnp.ones((32, 4)), jnp.ones((16, 8))))


@pytest.mark.parametrize("name", LOOP_FREE)
def test_loop_free_programs_agree_with_xla(name):
    fn, args = LOOP_FREE[name]
    _, cost = count_flops(fn)(*args)
    expected = xla_cost(fn, *args)
    assert (cost.flops, cost.transcendentals) == (expected["flops"], expected["transcendentals"])


@pytest.mark.parametrize("name", ["one_minus_square", "fma"])
def test_the_newer_elementwise_primitives_agree_with_xla(name):
    if not hasattr(lax, name):
        pytest.skip(f"lax.{name} is not in JAX {jax.__version__}")
    x = jnp.linspace(0.1, 0.9, 16)
    fn = getattr(lax, name)
    args = (x,) if name == "one_minus_square" else (x, x, x)
    _, cost = count_flops(fn)(*args)
    expected = xla_cost(fn, *args)
    assert (cost.flops, cost.transcendentals) == (expected["flops"], expected["transcendentals"])
    assert cost.unpriced == {}


def test_the_gradient_of_a_tanh_network_and_of_a_pooling_is_priced():
    def pooled(x):
        y = lax.reduce_window(jnp.tanh(x), -jnp.inf, lax.max, (2, 2), (2, 2), "VALID")
        return jnp.sum(y)

    _, cost = count_flops(jax.grad(pooled))(jnp.ones((8, 8)))
    assert cost.unpriced == {}
    assert cost.by_primitive["select_and_scatter_add"][0] == 16 * 4
    _, cost = count_flops(GRAD_MLP[0])(*GRAD_MLP[1])
    assert cost.unpriced == {}


def test_a_primitive_with_no_cost_rule_is_listed_not_silently_free():
    def fn(x, w):
        return lax.ragged_dot(x, w, jnp.array([2, 2], jnp.int32))

    _, cost = count_flops(fn)(jnp.ones((4, 4)), jnp.ones((2, 4, 3)))
    assert cost.unpriced == {"ragged_dot_general": 1}
    assert "no cost rule, FLOPs not counted" in repr(cost)
    _, jitted = jax.jit(count_flops(fn))(jnp.ones((4, 4)), jnp.ones((2, 4, 3)))
    assert jitted.unpriced == {"ragged_dot_general": 1}
    # Moving data costs nothing, and is priced so.
    _, moves = count_flops(lambda x: jnp.concatenate([x.T, x]).reshape(-1))(jnp.ones((4, 4)))
    assert moves.flops == 0 and moves.unpriced == {}


def test_matmul_by_hand():
    _, cost = count_flops(lambda a, b: a @ b)(A, B)
    assert cost.flops == 2 * 4 * 8 * 16
    assert cost.transcendentals == 0
    assert cost.bytes_accessed == (4 * 8 + 8 * 16 + 4 * 16) * F32  # operands and output
    assert cost.by_primitive == {"dot_general": (1024, 0, 896)}


def test_a_sow_and_a_check_cost_nothing():
    from kups.checks import check
    from kups.harvest import sow

    def plain(x):
        return x * 2.0

    def instrumented(x):
        x = sow(x, tag="t", name="x")
        check(x[0] > -1.0, "negative")
        return x * 2.0

    x = jnp.ones(1000)
    _, cost = count_flops(instrumented)(x)
    _, plain_cost = count_flops(plain)(x)
    # The effects are listed, at no cost; the predicate's operations count.
    assert cost.by_primitive["kups_sow"] == (0, 0, 0)
    assert cost.by_primitive["kups_check"] == (0, 0, 0)
    assert cost.by_primitive["mul"] == plain_cost.by_primitive["mul"]
    others = {k: v for k, v in cost.by_primitive.items() if not k.startswith("kups_")}
    assert set(others) == {"mul", "slice", "squeeze", "gt"}
    assert cost.bytes_accessed == sum(v[2] for v in others.values())


def test_by_primitive_sums_to_the_totals():
    fn, args = GRAD_MLP
    _, cost = count_flops(fn)(*args)
    columns = list(zip(*cost.by_primitive.values(), strict=True))
    assert [sum(column) for column in columns] == list(totals(cost))
    assert cost.by_primitive["tanh"][1] == 16 * 32  # the forward tanh, once


def test_the_outputs_are_the_functions():
    fn, args = LOOP_FREE["mlp"]
    out, _ = count_flops(fn)(*args)
    np.testing.assert_array_equal(out, fn(*args))


# ---------------------------------------------------------------------------
# Loops: what ran, where XLA and roofline count the body once.
# ---------------------------------------------------------------------------

W, H = jnp.full((8, 8), 0.1), jnp.ones((4, 8))
STEP_FLOPS = 2 * 4 * 8 * 8  # h @ w
STEP_TANH = 4 * 8


def scan10(w, h):
    return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, None, length=10)[0]


def test_scan_counts_every_step():
    _, cost = count_flops(scan10)(W, H)
    assert cost.flops == 10 * STEP_FLOPS
    assert cost.transcendentals == 10 * STEP_TANH
    _, one_step = count_flops(lambda w, h: jnp.tanh(h @ w))(W, H)
    assert totals(cost) == tuple(10 * total for total in totals(one_step))


def test_xla_counts_a_scan_body_once():
    # The defect count_flops fixes (jax-ml/jax#13956): XLA's figure is one step's
    # product and tanh (and the loop counter's two ops), not ten.
    expected = xla_cost(scan10, W, H)
    assert expected["transcendentals"] == STEP_TANH
    assert STEP_FLOPS <= expected["flops"] < 2 * STEP_FLOPS
    assert count_flops(scan10)(W, H)[1].flops == 10 * STEP_FLOPS


def test_roofline_counts_a_scan_body_once_and_a_while_body_never():
    roofline = pytest.importorskip("jax.experimental.roofline")
    _, result = roofline.roofline(scan10)(W, H)
    assert result.unfused_flops == STEP_FLOPS  # one step of ten
    _, result = roofline.roofline(while_tanh)(W, H, 7)
    assert result.unfused_flops == 0
    assert count_flops(while_tanh)(W, H, jnp.int32(7))[1].flops == 7 * (STEP_FLOPS + 1) + 8


def while_tanh(w, h, trips):
    """`trips` steps of `h = tanh(h @ w)`: a fori_loop with a traced bound is a
    while loop, whose body also adds one to the index and whose condition (run
    `trips + 1` times) compares it with the bound."""
    return lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ w), h)


@pytest.mark.parametrize("trips", [0, 1, 7])
def test_while_loop_counts_its_dynamic_trip_count(trips):
    _, eager = count_flops(while_tanh)(W, H, jnp.int32(trips))
    _, jitted = jax.jit(count_flops(while_tanh))(W, H, jnp.int32(trips))
    # Each trip: the product, one index increment; each test of the condition: one lt.
    expected_flops = trips * (STEP_FLOPS + 1) + (trips + 1)
    assert eager.flops == jitted.flops == expected_flops
    assert eager.transcendentals == jitted.transcendentals == trips * STEP_TANH


def test_one_jitted_function_counts_each_trip_count():
    counted = jax.jit(count_flops(while_tanh))
    flops = [counted(W, H, jnp.int32(trips))[1].flops for trips in (2, 5)]
    assert flops == [trips * (STEP_FLOPS + 1) + trips + 1 for trips in (2, 5)]


def test_while_loop_with_a_data_dependent_condition():
    def halve_until_small(x):
        return lax.while_loop(lambda x: jnp.max(x) > 1.0, lambda x: x * 0.5, x)

    x = jnp.array([3.0, 20.0, 7.0])  # 20 -> 10 -> 5 -> 2.5 -> 1.25 -> 0.625: 5 trips
    _, cost = jax.jit(count_flops(halve_until_small))(x)
    # Each trip multiplies 3 elements; each of the 6 tests reduces 3 elements to one
    # (2 FLOPs) and compares (1).
    assert cost.flops == 5 * 3 + 6 * (2 + 1)


def test_fori_loop_with_static_bounds_is_a_scan():
    def f(w, h):
        return lax.fori_loop(0, 6, lambda i, h: jnp.tanh(h @ w), h)

    _, cost = count_flops(f)(W, H)
    assert cost.flops == 6 * (STEP_FLOPS + 1)  # the index increment counts too
    assert cost.transcendentals == 6 * STEP_TANH


def test_nested_loops_multiply():
    def f(w, h):
        inner = lambda h, _: (h @ w, None)  # noqa: E731
        outer = lambda h, _: (lax.scan(inner, h, None, length=3)[0], None)  # noqa: E731
        return lax.scan(outer, h, None, length=4)[0]

    assert count_flops(f)(W, H)[1].flops == 4 * 3 * STEP_FLOPS


# ---------------------------------------------------------------------------
# Branches, remat, custom derivatives.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pred", [True, False])
def test_cond_counts_the_taken_branch_only(pred):
    def f(pred, a, b):
        return lax.cond(
            pred,
            lambda a, b: jnp.exp(a @ b),
            lambda a, b: jnp.broadcast_to(a[:, :1] * 2.0, (4, 16)),
            a,
            b,
        )

    for counted in (count_flops(f), jax.jit(count_flops(f))):
        _, cost = counted(jnp.bool_(pred), A, B)
        # The branch taken, and the predicate's conversion to a branch index (1).
        if pred:
            assert (cost.flops, cost.transcendentals) == (1 + 1024, 4 * 16)
        else:
            assert (cost.flops, cost.transcendentals) == (1 + 4, 0)
        # The branch not taken is listed, at zero.
        assert set(cost.by_primitive) >= {"dot_general", "exp", "mul"}


def test_switch_counts_the_taken_branch_only():
    branches = [lambda x: jnp.sin(x), lambda x: x @ x, lambda x: x + x]
    x = jnp.ones((5, 5))
    flops = [count_flops(lambda i, x: lax.switch(i, branches, x))(i, x)[1] for i in range(3)]
    # Each: the branch, and the clamp of the index into range (one FLOP).
    assert [(cost.flops, cost.transcendentals) for cost in flops] == [
        (1, 25),
        (1 + 2 * 5 * 5 * 5, 0),
        (1 + 25, 0),
    ]


def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))


def test_checkpoint_under_grad_counts_the_recomputation():
    x = jnp.ones((16, 8))
    _, plain = count_flops(jax.grad(loss))(W, x)
    _, remat = count_flops(jax.grad(jax.checkpoint(loss)))(W, x)
    # Without remat the backward pass reuses the forward tanh; with it, the forward
    # product and tanh run again.
    assert plain.transcendentals == 16 * 8
    assert remat.transcendentals == 2 * 16 * 8
    recomputed = remat.by_primitive["dot_general"][0] - plain.by_primitive["dot_general"][0]
    assert recomputed == 2 * 16 * 8 * 8
    np.testing.assert_allclose(
        count_flops(jax.grad(jax.checkpoint(loss)))(W, x)[0], jax.grad(loss)(W, x)
    )


def test_checkpoint_in_a_scan_under_grad():
    def f(w, h):
        step = jax.checkpoint(lambda h, _: (jnp.tanh(h @ w), None))
        return jnp.sum(lax.scan(step, h, None, length=5)[0])

    _, cost = jax.jit(count_flops(jax.grad(f)))(W, H)
    # Each step's tanh runs forward, and again in the backward pass.
    assert cost.transcendentals == 2 * 5 * STEP_TANH


@jax.custom_jvp
def soft(x):
    return jnp.log1p(jnp.exp(x))  # two transcendentals per element


@soft.defjvp
def _soft_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return soft(x), jax.nn.sigmoid(x) * t  # logistic: one more


@jax.custom_vjp
def scaled_sin(x):
    return jnp.sin(x) * 3.0


def _scaled_sin_fwd(x):
    return scaled_sin(x), jnp.cos(x)


def _scaled_sin_bwd(cos_x, g):
    return (3.0 * cos_x * g,)


scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


def test_custom_jvp_counts_what_ran():
    x = jnp.linspace(-1.0, 1.0, 10)
    assert count_flops(soft)(x)[1].transcendentals == 2 * 10
    _, cost = count_flops(jax.grad(lambda x: jnp.sum(soft(x))))(x)
    assert cost.transcendentals == 3 * 10  # the primal's exp and log1p, the rule's logistic
    assert cost.by_primitive["logistic"][1] == 10


def test_custom_vjp_counts_the_rules_that_ran():
    x = jnp.linspace(-1.0, 1.0, 10)
    _, forward = count_flops(scaled_sin)(x)
    assert (forward.flops, forward.transcendentals) == (10, 10)
    _, cost = jax.jit(count_flops(jax.grad(lambda x: jnp.sum(scaled_sin(x)))))(x)
    # fwd: sin, cos, mul by 3; bwd: two muls; the sum's cotangent broadcast is free.
    assert cost.transcendentals == 2 * 10
    assert cost.by_primitive["sin"][1] == cost.by_primitive["cos"][1] == 10
    assert cost.by_primitive["mul"][0] == 3 * 10


# ---------------------------------------------------------------------------
# shard_map, vmap, jit, pytrees.
# ---------------------------------------------------------------------------


def test_shard_map_is_summed_over_shards(mesh8):
    a, b = jnp.ones((16, 8)), jnp.ones((8, 4))
    sharded = jax.shard_map(
        lambda a, b: jnp.tanh(a @ b), mesh=mesh8, in_specs=(P("i"), P()), out_specs=P("i")
    )
    _, cost = jax.jit(count_flops(sharded))(a, b)
    _, whole = count_flops(lambda a, b: jnp.tanh(a @ b))(a, b)
    # Eight shards of two rows each: together the whole product.
    assert (cost.flops, cost.transcendentals) == (whole.flops, whole.transcendentals)
    assert cost.flops == 2 * 16 * 8 * 4
    out, _ = jax.jit(count_flops(sharded))(a, b)
    np.testing.assert_array_equal(out, jax.jit(sharded)(a, b))


def test_shard_map_with_a_collective_in_a_scan(mesh42):
    def body(x):
        def step(c, _):
            return c + lax.psum(jnp.sin(c), "x"), None

        return lax.scan(step, x, None, length=3)[0]

    sharded = jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))
    x = jnp.ones((8, 4))
    _, cost = jax.jit(count_flops(sharded))(x)
    # Per shard, per step: a [2, 2] block's sin, its psum (one FLOP per element, as
    # XLA counts an all-reduce) and the add; 8 shards, 3 steps.
    assert cost.transcendentals == 8 * 3 * 4
    # (`psum` is bound as `psum_invariant` under check_vma on JAX 0.10 and newer.)
    psum = sum(flops for name, (flops, _, _) in cost.by_primitive.items() if "psum" in name)
    assert psum == cost.by_primitive["add"][0] == 8 * 3 * 4


def test_vmap_of_the_counted_function_gives_one_cost_per_element():
    xs = jnp.ones((5, 4, 8))
    _, cost = jax.vmap(count_flops(lambda h: jnp.tanh(h @ W)), in_axes=0)(xs)
    np.testing.assert_array_equal(cost.flops, np.full(5, STEP_FLOPS))
    np.testing.assert_array_equal(cost.transcendentals, np.full(5, STEP_TANH))


def test_counting_a_vmapped_function_counts_the_batch():
    xs = jnp.ones((5, 4, 8))
    _, cost = count_flops(jax.vmap(lambda h: jnp.tanh(h @ W)))(xs)
    assert (cost.flops, cost.transcendentals) == (5 * STEP_FLOPS, 5 * STEP_TANH)


def test_eager_and_jitted_costs_agree():
    fn, args = GRAD_MLP
    _, eager = count_flops(fn)(*args)
    _, jitted = jax.jit(count_flops(fn))(*args)
    assert totals(eager) == totals(jitted)
    assert eager.by_primitive == jitted.by_primitive
    assert all(type(total) is int for total in totals(jitted))


def test_totals_read_inside_jit_are_float32():
    def flops_of(w, h):
        return count_flops(scan10)(w, h)[1].flops

    total = jax.jit(flops_of)(W, H)
    assert total.dtype == jnp.float32 and float(total) == 10 * STEP_FLOPS


def test_cost_is_a_pytree_that_exports():
    exported = jax.export.export(jax.jit(count_flops(while_tanh)))(
        jax.ShapeDtypeStruct(W.shape, W.dtype),
        jax.ShapeDtypeStruct(H.shape, H.dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    restored = jax.export.deserialize(exported.serialize())
    out, cost = restored.call(W, H, jnp.int32(3))
    assert type(cost) is Cost
    assert totals(cost) == totals(count_flops(while_tanh)(W, H, jnp.int32(3))[1])
    np.testing.assert_allclose(out, while_tanh(W, H, 3))
    leaves, treedef = jax.tree.flatten(cost)
    assert totals(jax.tree.unflatten(treedef, leaves)) == totals(cost)


def test_executions_match_count_primitives():
    # Both are counted by the same machinery: executions by name agree.
    fn, args = GRAD_MLP
    _, cost = count_flops(fn)(*args)
    _, counts = count_primitives(fn)(*args)
    by_name: dict[str, int] = {}
    for (name, *_), count in cost.executions.items():
        by_name[name] = by_name.get(name, 0) + count
    assert by_name == counts


def test_report_prints_a_table():
    _, cost = count_flops(lambda a, b: jnp.tanh(a @ b) + 1.0)(A, B)
    text = repr(cost)
    assert text.splitlines()[1].split() == ["primitive", "flops", "transcendentals", "bytes"]
    assert re.search(r"dot_general\s+1024\s+0\s+896", text)
    assert re.search(r"total\s+1088\s+64\s+", text)
    assert "<table>" in cost._repr_html_() and "dot_general" in cost._repr_html_()


def test_conjugate_gradient_inside_custom_linear_solve():
    # jax.scipy's cg runs a while loop inside custom_linear_solve, which kups enters.
    n = 10
    a = jnp.diag(jnp.arange(1.0, n + 1) ** 3) + 0.01
    b = jnp.ones(n)

    def solve(a, b):
        return jax.scipy.sparse.linalg.cg(lambda v: a @ v, b, tol=0.0, atol=0.0, maxiter=3)[0]

    out, cost = jax.jit(count_flops(solve))(a, b)
    # Matrix-vector products: the first residual and one per iteration (3), 2 * n * n
    # each; inner products (2 * n each): |b|^2 for the tolerance, the first |r|^2,
    # and two per iteration.
    assert cost.by_primitive["dot_general"][0] == 4 * 2 * n * n + (2 + 2 * 3) * 2 * n
    np.testing.assert_allclose(out, solve(a, b), rtol=1e-6)


# ---------------------------------------------------------------------------
# Control flow kups cannot enter.
# ---------------------------------------------------------------------------


def around_library_call(x):
    return jnp.exp(library_call(lambda y: jnp.sin(y) @ y, x)[0])


def test_opaque_control_flow_raises_by_default():
    with pytest.raises(
        NotImplementedError, match=r"count_flops cannot count inside .*library_call"
    ):
        count_flops(around_library_call)(jnp.ones((3, 3)))


def test_opaque_control_flow_is_reported_under_ignore():
    _, cost = count_flops(around_library_call, policy=InterpreterPolicy.IGNORE)(jnp.ones((3, 3)))
    assert cost.opaque == {"library_call": 1}
    assert (cost.flops, cost.transcendentals) == (0, 9)  # the exp; not the call's inside
    assert "not counted inside" in repr(cost)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="count_flops\\(fn\\) needs a callable"):
        count_flops(jnp.ones(3))  # type: ignore[arg-type]


def test_docstring_examples_run():
    for obj in (instrument.count_flops, instrument.Cost):
        for block in re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", re.S):
            exec(compile(block, f"<docstring of {obj.__name__}>", "exec"), {})
