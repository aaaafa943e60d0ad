"""The identity interpretation: `Interpreter(default_dispatcher())` changes nothing.

For every program of the corpus (`tests/corpus.py`), plain JAX is the oracle:
`reinterpret(f, identity)(ctx, *args)` must return exactly `(f(*args), ctx)`,
bit for bit, eagerly and under `jit`, `vmap`, `grad`, `jvp` and `vjp`, and when
interpreted a second time. The context comes out unchanged, with its type.
"""

from __future__ import annotations

import collections
import functools
import re
import zlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, jaxprs_in_params
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from corpus import CASES, Case, batch_args, case_by_name, differentiable, dynamic, is_float
from kups.effects import Interpreter, default_dispatcher, reinterpret

IDENTITY = Interpreter(default_dispatcher())
# The transformations of each case are compiled with fewer optimisations (LLVM's
# off): less compile time, and both sides of each comparison are compiled with the
# same options. Only options every supported JAX release knows.
# `test_compiled_program_is_the_same` compiles with the defaults.
COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}

# ---------------------------------------------------------------------------
# Contexts: a Python number, a dict of arrays, an equinox.Module with a callable.
# ---------------------------------------------------------------------------


class ModuleCtx(eqx.Module):
    scale: jax.Array
    activation: Callable[[jax.Array], jax.Array]  # a function: a static leaf
    history: tuple[jax.Array, ...]


CTXS: dict[str, Any] = {
    "zero": 0,
    "dict": {
        "a": jnp.arange(3.0),
        "n": jnp.int32(7),
        "flag": jnp.bool_(True),
        "nested": {"b": jnp.ones((2, 2), jnp.bfloat16)},
    },
    "module": ModuleCtx(jnp.float32(2.0), jax.nn.relu, (jnp.zeros(4, jnp.int8),)),
}
CTX_NAMES = tuple(CTXS)


def ctx_for(c: Case, transform: str) -> str:
    """The context a (case, transform) pair runs with: every transform meets every
    kind of context across the corpus, and every case meets several kinds."""
    return CTX_NAMES[zlib.crc32(f"{c.name}:{transform}".encode()) % len(CTX_NAMES)]


# ---------------------------------------------------------------------------
# Comparing results.
# ---------------------------------------------------------------------------


def assert_trees_equal(actual: Any, expected: Any, what: str = "") -> None:
    """Same tree, and every leaf the same: arrays bit for bit with the same dtype,
    weak type and shape, other leaves identical."""
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree, f"{what}: {actual_tree} != {expected_tree}"
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        where = f"{what} leaf {i}"
        if isinstance(e, jax.Array):
            assert isinstance(a, jax.Array), f"{where}: {type(a).__name__} is not an array"
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
            assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
            assert a.weak_type == e.weak_type, f"{where}: weak_type {a.weak_type}"
            if jnp.issubdtype(e.dtype, jax.dtypes.prng_key):
                a, e = jax.random.key_data(a), jax.random.key_data(e)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=where)
        else:
            assert a is e or a == e, f"{where}: {a!r} != {e!r}"


def assert_same_shardings(actual: Any, expected: Any) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if isinstance(e, jax.Array) and hasattr(e, "sharding"):
            assert a.sharding.is_equivalent_to(e.sharding, e.ndim), (a.sharding, e.sharding)


def assert_ctx_unchanged(ctx_out: Any, ctx: Any) -> None:
    """The context comes out as it went in: the same type and tree, the same
    leaves. A Python number may come back as the equal 0-d array, because
    control flow threads it as a value."""
    if isinstance(ctx, bool | int | float | complex):
        assert isinstance(ctx_out, type(ctx) | jax.Array), type(ctx_out)
        assert np.asarray(ctx_out).shape == ()
        assert ctx_out == ctx
        return
    assert type(ctx_out) is type(ctx)
    assert_trees_equal(ctx_out, ctx, "ctx")


def assert_not_deleted(*trees: Any) -> None:
    """No argument or context array was donated away."""
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):
            assert not leaf.is_deleted()


# ---------------------------------------------------------------------------
# Building the two sides of each comparison.
# ---------------------------------------------------------------------------


def float_outputs(out: Any) -> list[Any]:
    return [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]


def pattern(x: Any) -> Any:
    """A deterministic, non-constant array like `x` (tangents and cotangents), with
    the sharding type of `x` on a mesh with Explicit axes (JAX checks cotangents'
    types against the outputs')."""
    values = jnp.cos(jnp.arange(x.size, dtype=jnp.float32) * 0.7).reshape(x.shape).astype(x.dtype)
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and AxisType.Explicit in mesh.axis_types and any(sharding.spec):
        values = jax.sharding.reshard(values, sharding)
    return values


def loss(out: Any) -> Any:
    return sum(jnp.sum(o.astype(jnp.float32)) for o in float_outputs(out))


class Sides:
    """The two sides of the comparison for one case, over the array leaves of its
    arguments (the other leaves are closed over, as static):

    - `orig(*leaves) -> out`, the oracle;
    - `interp(key, ctx_name, ctx_dyn, *leaves) -> (out, ctx_dyn_out)`, the
      identity interpretation with the context `CTXS[ctx_name]`, whose array
      leaves are `ctx_dyn` (traced) and whose other leaves are closed over; the
      static leaves of the context it returns are kept under `key` for
      `check_ctx`.
    """

    def __init__(self, c: Case, interpreter: Interpreter = IDENTITY):
        self.case = c
        self.orig, self.leaves = dynamic(c.fn, c.args)
        self.wrapped = reinterpret(self.orig, interpreter)
        self.float_positions = [i for i, leaf in enumerate(self.leaves) if is_float(leaf)]
        self.ctx_dyn = {name: eqx.partition(CTXS[name], eqx.is_array)[0] for name in CTX_NAMES}
        self._ctx_static_out: dict[str, Any] = {}

    def interp(self, key: str, ctx_name: str, ctx_dyn: Any, *leaves: Any) -> tuple[Any, Any]:
        ctx_static = eqx.partition(CTXS[ctx_name], eqx.is_array)[1]
        out, ctx_out = self.wrapped(eqx.combine(ctx_dyn, ctx_static), *leaves)
        ctx_dyn_out, self._ctx_static_out[key] = eqx.partition(ctx_out, eqx.is_array)
        return out, ctx_dyn_out

    def twice(
        self, inner_name: str, outer_name: str, ctx_dyns: dict[str, Any], *leaves: Any
    ) -> tuple[Any, Any, Any]:
        """The identity interpretation, interpreted again by a second interpreter:
        `(out, inner_ctx_dyn_out, outer_ctx_dyn_out)`."""
        twice = reinterpret(self.wrapped, Interpreter(default_dispatcher(), label="outer"))

        def ctx(name: str) -> Any:
            return eqx.combine(ctx_dyns[name], eqx.partition(CTXS[name], eqx.is_array)[1])

        (out, inner_out), outer_out = twice(ctx(outer_name), ctx(inner_name), *leaves)
        inner_dyn, self._ctx_static_out["twice"] = eqx.partition(inner_out, eqx.is_array)
        outer_dyn, self._ctx_static_out["twice outer"] = eqx.partition(outer_out, eqx.is_array)
        return out, inner_dyn, outer_dyn

    def check_ctx(self, key: str, ctx_name: str, ctx_dyn_out: Any) -> None:
        ctx_out = eqx.combine(ctx_dyn_out, self._ctx_static_out[key])
        assert_ctx_unchanged(ctx_out, CTXS[ctx_name])

    def with_floats(self, floats: Any) -> list[Any]:
        leaves = list(self.leaves)
        for i, value in zip(self.float_positions, floats, strict=True):
            leaves[i] = value
        return leaves

    @property
    def floats(self) -> list[Any]:
        return [self.leaves[i] for i in self.float_positions]

    def transforms(self) -> list[str]:
        """The transformations of this case that plain JAX supports."""
        c = self.case
        names = ["jit", "twice"]
        if c.vmap:
            names.append("vmap")
        if differentiable(c):
            names += ["grad", "vjp"] if c.grad else []
            names += ["jvp"] if c.jvp else []
        return names

    def run_transforms(self, interpreted: bool) -> dict[str, Any]:
        """Every transformation of the case in one jitted program (one compilation
        per side): `{name: result}`. With `interpreted`, the context each
        transformation ran with is checked to come out unchanged."""
        names = self.transforms()
        c = self.case
        ctx_names = {name: ctx_for(c, name) for name in (*names, "twice outer")}

        def program(leaves, ctx_dyns):
            # Batched arguments and tangents are built inside the program: eagerly,
            # each of their operations would be compiled on its own.
            batched = batch_args(tuple(leaves)) if c.vmap else ()
            floats = [leaves[i] for i in self.float_positions]
            tangents = [pattern(x) for x in floats]

            def call(name, *leaves):
                """`(out, ctx_dyn_out)`; the original returns no context (None)."""
                if not interpreted:
                    return self.orig(*leaves), None
                ctx_name = ctx_names[name]
                return self.interp(name, ctx_name, ctx_dyns[ctx_name], *leaves)

            def call_floats(name, floats):
                out, ctx_out = call(name, *self.with_floats(floats))
                return float_outputs(out), ctx_out

            results: dict[str, Any] = {}
            ctxs: dict[str, Any] = {}
            results["jit"], ctxs["jit"] = call("jit", *leaves)
            if interpreted:
                results["twice"], ctxs["twice"], ctxs["twice outer"] = self.twice(
                    ctx_names["twice"], ctx_names["twice outer"], ctx_dyns, *leaves
                )
            else:
                results["twice"] = self.orig(*leaves)
            if "vmap" in names:
                vmapped = jax.vmap(functools.partial(call, "vmap"), out_axes=(0, None))
                results["vmap"], ctxs["vmap"] = vmapped(*batched)
            if "grad" in names:

                def loss_and_ctx(floats):
                    out, ctx_out = call_floats("grad", floats)
                    return loss(out), ctx_out

                results["grad"], ctxs["grad"] = jax.grad(loss_and_ctx, has_aux=True)(floats)
            if "vjp" in names:
                vjp_fn = functools.partial(call_floats, "vjp")
                out, pullback, ctxs["vjp"] = jax.vjp(vjp_fn, floats, has_aux=True)
                results["vjp"] = (out, pullback([pattern(o) for o in out]))
            if "jvp" in names:
                jvp_fn = functools.partial(call_floats, "jvp")
                *results["jvp"], ctxs["jvp"] = jax.jvp(jvp_fn, (floats,), (tangents,), has_aux=True)
            return results, ctxs

        with c.context():
            results, ctxs = jax.jit(program, compiler_options=COMPILER_OPTIONS)(
                self.leaves, self.ctx_dyn if interpreted else {}
            )
        if interpreted:
            for name in ctxs:
                self.check_ctx(name, ctx_names[name], ctxs[name])
        return results


# ---------------------------------------------------------------------------
# The corpus itself.
# ---------------------------------------------------------------------------


def _call_primitive_name() -> str:
    """`closed_call` binds as an `eval_jaxpr` equation from JAX 0.11 on."""
    from jax.extend.core.primitives import closed_call_p

    from kups.effects import _compat

    body = jax.make_jaxpr(jnp.sin)(1.0)
    staged = jax.make_jaxpr(
        lambda x: _compat.bind_equation(closed_call_p, {"call_jaxpr": body}, [x])
    )(1.0)
    return staged.eqns[0].primitive.name


CONTROL_FLOW = {
    "jit",
    "scan",
    "while",
    "cond",
    "remat2",
    "custom_jvp_call",
    "custom_vjp_call",
    _call_primitive_name(),
    "shard_map",
    "custom_linear_solve",
}
COMBINERS = {"scatter-add", "reduce", "reduce_window", "sort"}
COLLECTIVES = {
    "psum",
    "pmax",
    "all_gather",
    "ppermute",
    "axis_index",
    "reduce_scatter",  # lax.psum_scatter
    "all_to_all",
}


def _subjaxprs(eqn: Any) -> list[Any]:
    found = []
    for sub in jaxprs_in_params(eqn.params):
        found.append(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)
    return found


def _walk(jaxpr: Any, chain: tuple[str, ...], seen: collections.Counter, chains: set) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        seen[name] += 1
        subs = _subjaxprs(eqn)
        if name in CONTROL_FLOW:
            inner = (*chain, name)
            chains.add(inner)
            for sub in subs:
                _walk(sub, inner, seen, chains)
        else:
            for sub in subs:
                _walk(sub, chain, seen, chains)


def corpus_inventory() -> tuple[collections.Counter, dict[str, set]]:
    """Every primitive the corpus uses, and per case the chains of nested
    control-flow primitives."""
    seen: collections.Counter = collections.Counter()
    chains: dict[str, set] = {}
    for c in CASES:
        orig, leaves = dynamic(c.fn, c.args)
        with c.context():
            closed = jax.make_jaxpr(orig)(*leaves)
        chains[c.name] = set()
        _walk(closed.jaxpr, (), seen, chains[c.name])
    return seen, chains


def test_corpus_covers_every_primitive():
    assert len({c.name for c in CASES}) == len(CASES)
    assert len(CASES) >= 60
    seen, chains = corpus_inventory()
    assert set(seen) >= CONTROL_FLOW | COMBINERS | COLLECTIVES, (
        CONTROL_FLOW | COMBINERS | COLLECTIVES
    ) - set(seen)
    assert {"random_bits", "threefry2x32"} & set(seen)
    assert "reshard" in seen  # explicit sharding: reshard, auto_axes, explicit_axes
    # Alone: for each primitive, a case whose only control flow it is.
    used = {name: {p for chain in cs for p in chain} for name, cs in chains.items()}
    alone = {next(iter(prims)) for prims in used.values() if len(prims) == 1}
    assert alone >= CONTROL_FLOW, CONTROL_FLOW - alone
    # Nested: every control-flow primitive sits on a chain at least three deep.
    deep = {p for cs in chains.values() for ch in cs if len(ch) >= 3 for p in ch}
    assert deep >= CONTROL_FLOW, CONTROL_FLOW - deep
    # Cases whose name says "nest" really nest three deep.
    for name, cs in chains.items():
        if name.startswith("nest/"):
            assert max(map(len, cs)) >= 3, name


def test_every_transformation_meets_every_context():
    for transform in ("jit", "twice", "twice outer", "vmap", "grad", "vjp", "jvp", "eager"):
        assert {ctx_for(c, transform) for c in CASES} == set(CTX_NAMES), transform


def test_corpus_dtypes_and_meshes():
    dtypes = set()
    for c in CASES:
        fn, leaves = dynamic(c.fn, c.args)
        with c.context():
            leaves = jax.tree.leaves((leaves, jax.eval_shape(fn, *leaves)))
        dtypes |= {str(leaf.dtype) for leaf in leaves if hasattr(leaf, "dtype")}
    assert {"float32", "int32", "bool", "uint32", "bfloat16", "uint8"} <= dtypes, dtypes
    assert any(d.startswith("key") for d in dtypes)
    names = {c.name for c in CASES}
    assert {"shard_map/partial_x_check_vma", "pmap/psum_axis_index", "jit/shardings"} <= names
    # Explicit sharding: cases whose arguments carry shardings on an Explicit mesh,
    # nested control flow among them, and one under `jax.set_mesh`.
    explicit = [c for c in CASES if c.name.startswith("explicit/")]
    assert len(explicit) >= 10
    for c in explicit:
        shardings = [
            leaf.sharding for leaf in jax.tree.leaves(c.args) if isinstance(leaf, jax.Array)
        ]
        meshes = [getattr(sharding, "mesh", None) for sharding in shardings]
        assert any(m is not None and AxisType.Explicit in m.axis_types for m in meshes), c
    assert any(c.context_mesh is not None for c in explicit)
    assert any("nested" in c.tags for c in explicit)


# ---------------------------------------------------------------------------
# The identity, case by case.
# ---------------------------------------------------------------------------

IDS = [c.name for c in CASES]
# Cases run eagerly with every kind of context; the others with one each.
ALL_CTX_CASES = {
    "jit/donate_argnums",
    "nest/jit_scan_cond_while_switch",
    "shard_map/in_scan",
}
EAGER_PARAMS = [
    pytest.param(c, ctx_name, id=f"{c.name}-{ctx_name}")
    for c in CASES
    for ctx_name in (CTX_NAMES if c.name in ALL_CTX_CASES else (ctx_for(c, "eager"),))
]

_EAGER: dict[str, Any] = {}


def eager_oracle(c: Case) -> Any:
    if c.name not in _EAGER:
        with c.context():
            _EAGER[c.name] = c.fn(*c.args)
    return _EAGER[c.name]


@pytest.mark.parametrize(("c", "ctx_name"), EAGER_PARAMS)
def test_eager(c: Case, ctx_name: str):
    ctx = CTXS[ctx_name]
    expected = eager_oracle(c)
    with c.context():
        out, ctx_out = reinterpret(c.fn, IDENTITY)(ctx, *c.args)
    assert_trees_equal(out, expected, "out")
    assert_same_shardings(out, expected)
    assert_ctx_unchanged(ctx_out, ctx)
    assert_not_deleted(c.args, ctx)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_transformations(c: Case):
    """jit, vmap, grad, vjp and jvp of the identity interpretation, against the
    same transformations of the original (both sides jitted)."""
    sides = Sides(c)
    expected = sides.run_transforms(interpreted=False)
    actual = sides.run_transforms(interpreted=True)
    assert set(actual) == set(expected)
    for name in expected:
        assert_trees_equal(actual[name], expected[name], name)
    assert_same_shardings(actual["jit"], expected["jit"])
    assert_not_deleted(sides.leaves, CTXS)


@pytest.mark.parametrize("c", [c for c in CASES if c.name in ALL_CTX_CASES], ids=lambda c: c.name)
def test_reinterpret_twice_eagerly(c: Case):
    inner_ctx = CTXS[ctx_for(c, "twice-inner")]
    outer_ctx = CTXS[ctx_for(c, "twice-outer")]
    twice = reinterpret(reinterpret(c.fn, IDENTITY), Interpreter(default_dispatcher()))
    with c.context():
        (out, inner_out), outer_out = twice(outer_ctx, inner_ctx, *c.args)
    assert_trees_equal(out, eager_oracle(c), "out")
    assert_ctx_unchanged(inner_out, inner_ctx)
    assert_ctx_unchanged(outer_out, outer_ctx)


# ---------------------------------------------------------------------------
# The compiled program: identity adds nothing.
# ---------------------------------------------------------------------------

_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")


def _opcode(rhs: str) -> str:
    """The opcode of an HLO instruction's right-hand side: after the type."""
    if rhs.startswith("("):  # a tuple type
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rhs = rhs[i + 1 :]
                break
    else:
        rhs = rhs.split(" ", 1)[1]
    return rhs.strip().split("(", 1)[0]


def hlo_op_counts(compiled_text: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in compiled_text.splitlines():
        match = _HLO_INSTRUCTION.match(line)
        if match and not line.lstrip().startswith(("HloModule", "//")):
            counts[_opcode(match.group(1))] += 1
    return counts


COMPILED_CASES = [
    "scan/consts_carry_xs",
    "while/consts_in_cond_and_body",
    "switch/3",
    "nest/jit_scan_switch_checkpoint",
    "nest/jit_scan_cond_while_switch",
    "custom_vjp/rule",
    "jit/shardings",
    "shard_map/full_psum_check_vma",
    "random/raw_key_in_scan",
]


def assert_same_compiled_ops(actual: Any, expected: Any, *args: Any) -> None:
    """`actual` and `expected`, jitted and compiled with XLA's defaults, have the
    same number of HLO instructions of each kind."""
    actual_text = jax.jit(actual).lower(*args).compile().as_text()
    expected_counts = hlo_op_counts(jax.jit(expected).lower(*args).compile().as_text())
    assert expected_counts  # the parser found the instructions
    actual_counts = hlo_op_counts(actual_text)
    difference = {
        op: actual_counts[op] - expected_counts[op]
        for op in set(actual_counts) | set(expected_counts)
        if actual_counts[op] != expected_counts[op]
    }
    assert not difference, difference


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_program_is_the_same(name: str):
    """The identity adds nothing to the compiled program: with the context an input
    and an output, it compiles to what `(f(*args), ctx)` compiles to."""
    sides = Sides(case_by_name(name))

    def expected(ctx_dyn, *leaves):
        return sides.orig(*leaves), ctx_dyn

    def actual(ctx_dyn, *leaves):
        return sides.interp("compiled", "dict", ctx_dyn, *leaves)

    assert_same_compiled_ops(actual, expected, sides.ctx_dyn["dict"], *sides.leaves)


# ---------------------------------------------------------------------------
# Regressions this corpus found, reduced to their smallest form.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x), id="cond"),
        pytest.param(
            lambda x: jax.lax.switch(jnp.int32(x), [jnp.sin, jnp.cos, jnp.tan], x), id="switch"
        ),
        pytest.param(lambda x: jax.lax.while_loop(lambda v: v < 3, lambda v: v + 1, x), id="while"),
        pytest.param(
            lambda x: jax.lax.fori_loop(0, jnp.int32(x) + 2, lambda i, v: v * 0.5, x),
            id="fori_while",
        ),
    ],
)
def test_vmap_with_batched_predicate_leaves_the_context_unbatched(fn):
    # A batched predicate turns `cond` into a select of all its outputs, and makes
    # every `while` carry batched: the handlers used to send the context through
    # them, so it came out batched (`out_axes=None` failed) though nothing changed it.
    ctx = {"a": jnp.ones(2), "n": jnp.int32(3)}
    xs = jnp.arange(4.0) - 1.0
    wrapped = reinterpret(fn, IDENTITY)
    out, ctx_out = jax.vmap(wrapped, in_axes=(None, 0), out_axes=(0, None))(ctx, xs)
    assert_trees_equal(out, jax.vmap(fn)(xs))
    assert_ctx_unchanged(ctx_out, ctx)


def test_eager_shard_map_is_bit_for_bit_plain_jax(mesh42):
    # Eagerly, JAX runs a shard_map body op by op; the handler used to run every
    # eager shard_map compiled, which changed the last bits of `x * i + psum(x)`.
    def fn(x):
        def body(b):
            i = jax.lax.axis_index("x").astype(b.dtype)
            return b * (i + 1.0) + jax.lax.psum(b, "x")

        return jax.shard_map(
            body, mesh=mesh42, in_specs=P("x"), out_specs=P("x"), axis_names={"x"}
        )(x)

    x = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (8, 4)), jnp.float32)
    for ctx in (0, {"a": jnp.ones(3)}):
        out, ctx_out = reinterpret(fn, IDENTITY)(ctx, x)
        assert_trees_equal(out, fn(x))
        assert_ctx_unchanged(ctx_out, ctx)


def test_scan_with_an_unchanged_context_compiles_to_the_same_program():
    # The scan handler used to carry an unchanged context through the loop; with
    # random numbers in the body, XLA then compiled a second while loop (and ~200
    # more instructions) than for the original scan.
    def fn(key):
        def body(k, _):
            return jax.random.split(k)[0], jax.random.normal(k, (2,))

        return jax.lax.scan(body, key, None, length=3)

    def expected(ctx, key):
        return fn(key), ctx

    def actual(ctx, key):
        return reinterpret(fn, IDENTITY)(ctx, key)

    assert_same_compiled_ops(actual, expected, {"a": jnp.ones(3)}, jax.random.PRNGKey(0))


def test_eager_matches_the_staged_program_where_eager_jax_folds_constants():
    # Where bit-for-bit against eager `f` is out of reach: eagerly, an inner `jit`
    # closing over a concrete array (here `a`, an argument of `f`) bakes it into the
    # compiled program, and XLA constant-folds `tanh(sin(a))` with its evaluator, whose
    # last bits differ from the compiled kernels'. `reinterpret` traces `f`, so `a`
    # is an input there, as in `jax.jit(f)`: the oracle is the staged program,
    # evaluated eagerly.
    def f(a, b):
        return jax.jit(lambda c: jnp.tanh(jnp.sin(a)) + c)(b)

    a = jnp.asarray(np.random.RandomState(0).uniform(-3, 3, 256), jnp.float32)
    b = jnp.float32(0.0)
    staged = jax.make_jaxpr(f)(a, b)
    expected = jax.core.eval_jaxpr(staged.jaxpr, staged.consts, a, b)[0]
    out, ctx_out = reinterpret(f, IDENTITY)({"n": jnp.int32(1)}, a, b)
    assert_trees_equal(out, expected)
    assert_trees_equal(out, jax.jit(f)(a, b))
    assert_ctx_unchanged(ctx_out, {"n": jnp.int32(1)})
