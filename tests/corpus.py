"""A corpus of small JAX programs that exercise every control-flow primitive.

Each entry of `CASES` is a `Case`: a name, a function and example arguments, plus
flags saying which transformations of the function plain JAX supports. The
corpus is the input of the identity-interpretation tests (`test_identity.py`,
where plain JAX is the oracle) and is meant to be reused by benchmarks and
fuzzers:

```python
from corpus import CASES, case_by_name

for case in CASES:
    out = case.fn(*case.args)
```

What the corpus covers, alone and nested at least three deep: `jit` (donation,
static arguments, in/out shardings, `keep_unused`, `inline`), `scan` (consts,
carries, xs, `reverse`, `unroll`, zero length, `length` without xs),
`fori_loop` (its scan and its while form), `while_loop` (zero-trip too), `cond`,
`switch` (2 to 4 branches), `checkpoint` with policies, `custom_jvp`,
`custom_vjp` (with `nondiff_argnums`), `closed_call`, `custom_linear_solve`,
`lax.map`, `vmap` inside the program, primitives with combiner jaxprs
(`scatter-add`, generic `reduce`, `reduce_window`, `sort`), random numbers,
integer and boolean dtypes, `shard_map` on a 4x2 mesh (full and partial
manual, `check_vma` on and off, collectives in the body, nested with `scan`),
`pmap`, and explicit sharding on the same mesh with Explicit axes (`reshard`,
`auto_axes` and `explicit_axes` regions, `out_sharding=` of jnp ops,
`shard_map` full and partial manual, `scan`/`while`/`cond` and `jit` with
in/out shardings on sharded values, nested, and bare `PartitionSpec`s under
`jax.set_mesh`).

Conventions every case follows, so that generic drivers can use it:

- `args` are JAX arrays (or Python scalars, which drivers treat as static, like
  equinox's filter transforms do). Calling `fn(*args)` never deletes an
  argument: donating programs donate copies.
- `fn` is deterministic: it can be compared bit for bit with itself, and eagerly
  with its staged program (`jax.make_jaxpr`) evaluated eagerly. (An inner `jit`
  that closes over an argument breaks the latter: eagerly, XLA constant-folds
  the concrete array in the last bits differently from the compiled kernels.)
- With `vmap=True`, `fn` can be batched with `jax.vmap` over a new leading axis of
  every array argument, built with `batch_args` (which also perturbs the second
  entry so that the batch is not constant). Every loop still terminates then.
- With `grad=True` (`jvp=True`), reverse-mode (forward-mode) differentiation
  with respect to the floating-point array arguments works in plain JAX.
  `differentiable(case)` also requires that the case has floating-point
  arguments and outputs.
- A case with a `context_mesh` is called, traced and transformed inside
  `case.context()` (`jax.set_mesh`, which JAX allows only outside `jax.jit`).
- Cases on a mesh need eight devices. When JAX is imported by this module, it
  asks for eight CPU devices; when fewer devices exist, those cases are left
  out of `CASES` and listed in `SKIPPED`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Only effective before JAX is imported (tests/conftest.py does the same).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core.primitives import closed_call_p
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True, eq=False)
class Case:
    """One program of the corpus.

    - `name`: `"family/variant"`, unique, usable as a pytest id.
    - `fn`: the program; `fn(*args)` returns a pytree of arrays.
    - `args`: example arguments.
    - `vmap`, `grad`, `jvp`: which transformations plain JAX supports (see the
      module docstring).
    - `tags`: what the case exercises, e.g. `{"scan", "nested"}`.
    - `context_mesh`: a mesh the program expects as JAX's context mesh (it uses
      bare `PartitionSpec`s where JAX wants a mesh); drivers enter
      `case.context()` around every call, trace and transformation.
    """

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    vmap: bool = True
    grad: bool = True
    jvp: bool = True
    tags: frozenset[str] = field(default_factory=frozenset)
    context_mesh: Any = None

    def __repr__(self) -> str:
        return f"Case({self.name!r})"

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """`jax.set_mesh(context_mesh)`, or nothing when the case needs no context mesh
        (`set_mesh` is only allowed outside `jax.jit`: enter it around the driver)."""
        if self.context_mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.context_mesh)


CASES: list[Case] = []
SKIPPED: list[str] = []  # cases left out because JAX has fewer than eight devices

HAS_MESH = jax.device_count() >= 8
MESH42 = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2) if HAS_MESH else None
# The same devices with Explicit axes: shardings are part of the avals
# (sharding in types), the default of `jax.make_mesh` on every supported release.
MESH42E = (
    jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2) if HAS_MESH else None
)


def case(
    name: str,
    *args: Any,
    vmap: bool = True,
    grad: bool = True,
    jvp: bool = True,
    tags: tuple[str, ...] = (),
    mesh: bool = False,
    context_mesh: Any = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding `fn` to `CASES` with example `args` (`mesh=True`: needs 8 devices)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if any(c.name == name for c in CASES):
            raise ValueError(f"duplicate case name {name!r}")
        if mesh and not HAS_MESH:
            SKIPPED.append(name)
            return fn
        CASES.append(Case(name, fn, tuple(args), vmap, grad, jvp, frozenset(tags), context_mesh))
        return fn

    return register


def case_by_name(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(name)


def is_array(x: Any) -> bool:
    """Array leaves are traced by drivers; every other leaf is static."""
    return isinstance(x, jax.Array | np.ndarray)


def dynamic(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], list[Any]]:
    """`(dyn_fn, leaves)`: `dyn_fn(*leaves) == fn(*args)`, where `leaves` are the array
    leaves of `args` and the other leaves are closed over (static), as equinox's
    filter transformations do. Use it to `jit`, `vmap` or differentiate a case."""
    all_leaves, treedef = jax.tree.flatten(args)
    positions = [i for i, leaf in enumerate(all_leaves) if is_array(leaf)]

    def dyn_fn(*leaves: Any) -> Any:
        merged = list(all_leaves)
        for i, leaf in zip(positions, leaves, strict=True):
            merged[i] = leaf
        return fn(*jax.tree.unflatten(treedef, merged))

    return dyn_fn, [all_leaves[i] for i in positions]


def is_float(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


@functools.cache
def differentiable(c: Case) -> bool:
    """Whether the case has floating-point array arguments and outputs."""
    dyn_fn, leaves = dynamic(c.fn, c.args)
    if not any(is_float(leaf) for leaf in leaves):
        return False
    with c.context():
        out = jax.eval_shape(dyn_fn, *leaves)
    return any(jnp.issubdtype(o.dtype, jnp.floating) for o in jax.tree.leaves(out))


def _perturb(x: Any) -> Any:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.fold_in(x, 1)
    if x.dtype == jnp.bool_:
        return ~x
    return x + jnp.ones((), x.dtype)


def batch_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every array argument stacked with a perturbed copy along a new leading axis
    of size 2; other arguments as they are."""

    def stack(x: Any) -> Any:
        return jnp.stack([x, _perturb(x)]) if is_array(x) else x

    return jax.tree.map(stack, args)


# ---------------------------------------------------------------------------
# Example arguments (deterministic).
# ---------------------------------------------------------------------------

_rng = np.random.RandomState(1234)


def f32(*shape: int) -> jax.Array:
    return jnp.asarray(_rng.uniform(-1.0, 1.0, shape).astype(np.float32))


def i32(*shape: int, low: int = -5, high: int = 6) -> jax.Array:
    return jnp.asarray(_rng.randint(low, high, shape).astype(np.int32))


def bools(*shape: int) -> jax.Array:
    return jnp.asarray(_rng.rand(*shape) > 0.5)


def scalar_i32(value: int) -> jax.Array:
    return jnp.asarray(value, jnp.int32)


_W33 = f32(3, 3)  # a concrete array closed over by several programs (a jaxpr const)

# ---------------------------------------------------------------------------
# jit
# ---------------------------------------------------------------------------


@case("jit/basic", f32(3, 4), tags=("jit",))
def jit_basic(x):
    return jax.jit(lambda a: jnp.sin(a) @ a.T + 1.0)(x)


_pow_static = jax.jit(lambda a, n: a**n + n, static_argnums=1)


@case("jit/static_argnums", f32(4), 3, tags=("jit",))
def jit_static_argnums(x, n):
    # `n` is a Python int: static for `_pow_static`, and for drivers too.
    return _pow_static(x, n), _pow_static(x, n + 1)


_donating = jax.jit(lambda a, b: (a * 2.0 + b, b - 1.0), donate_argnums=(0,))


@case("jit/donate_argnums", f32(8), f32(8), tags=("jit",))
def jit_donate_argnums(x, y):
    return _donating(x + 0.0, y)  # a fresh buffer is donated, never the caller's


_keep_unused = jax.jit(lambda a, unused: a * 3.0, keep_unused=True)


@case("jit/keep_unused", f32(4), f32(2), tags=("jit",))
def jit_keep_unused(x, unused):
    return _keep_unused(x, unused)


_inlined = jax.jit(lambda a: jnp.cos(a) * a, inline=True)


@case("jit/inline", f32(5), tags=("jit",))
def jit_inline(x):
    return _inlined(x) + jax.jit(lambda a: a * 2.0)(x)


@case("jit/nested3", f32(4), tags=("jit", "nested"))
def jit_nested3(x):
    @jax.jit
    def outer(a):
        @jax.jit
        def middle(b):
            return jax.jit(lambda c: jnp.exp(c) - 1.0)(b) * b

        return middle(a) + middle(a * 2.0)

    return outer(x)


@case("jit/consts_and_forwarding", f32(3), f32(3), tags=("jit",))
def jit_consts_and_forwarding(x, y):
    # A closed-over constant, an output that is an input, and a literal output.
    swap = jax.jit(lambda a, b: (b, a @ _W33, jnp.float32(2.0)))
    return swap(x, y)


if HAS_MESH:
    _rows = NamedSharding(MESH42, P("x", None))
    _tiles = NamedSharding(MESH42, P("x", "y"))
    _sharded = jax.jit(
        lambda a, b: (a * b + 1.0, jnp.sum(a, axis=1)),
        in_shardings=(_tiles, _rows),
        out_shardings=(_tiles, NamedSharding(MESH42, P("x"))),
    )

    @case(
        "jit/shardings",
        jax.device_put(f32(8, 4), _tiles),
        jax.device_put(f32(8, 4), _rows),
        vmap=False,
        tags=("jit", "mesh"),
        mesh=True,
    )
    def jit_shardings(x, y):
        return _sharded(x, y)

    _out_sharded = jax.jit(lambda a: jnp.tanh(a), out_shardings=_rows)

    @case("jit/out_shardings_only", f32(8, 2), tags=("jit", "mesh"), mesh=True)
    def jit_out_shardings_only(x):
        return _out_sharded(x)

else:
    SKIPPED += ["jit/shardings", "jit/out_shardings_only"]

# ---------------------------------------------------------------------------
# scan, fori_loop, lax.map
# ---------------------------------------------------------------------------


@case("scan/consts_carry_xs", f32(3), f32(5, 3), tags=("scan",))
def scan_consts_carry_xs(h0, xs):
    scale = jnp.sum(h0) * 0.5  # a traced const of the body

    def body(carry, x):
        h, n = carry
        h = jnp.tanh(_W33 @ h + x * scale)
        return (h, n + 1), (h * 2.0, n)

    (h, n), (ys, ns) = lax.scan(body, (h0, jnp.int32(0)), xs)
    return h, n, ys, ns


@case("scan/reverse", f32(2), f32(4, 2), tags=("scan",))
def scan_reverse(c0, xs):
    return lax.scan(lambda c, x: (c * 0.9 + x, c + x * x), c0, xs, reverse=True)


@case("scan/unroll2", f32(3), f32(5, 3), tags=("scan",))
def scan_unroll2(c0, xs):
    return lax.scan(lambda c, x: (jnp.sin(c) + x, c.sum()), c0, xs, unroll=2)


@case("scan/length0", f32(3), f32(0, 3), tags=("scan",))
def scan_length0(c0, xs):
    return lax.scan(lambda c, x: (c + x, c * x), c0, xs)


@case("scan/length_without_xs", f32(2), tags=("scan",))
def scan_length_without_xs(c0):
    return lax.scan(lambda c, _: (c * 1.1 + 0.1, c), c0, None, length=4)


@case("scan/int_bool_carry", i32(4), bools(4), tags=("scan", "int"))
def scan_int_bool_carry(n, mask):
    def body(carry, x):
        acc, flag = carry
        acc = jnp.where(flag, acc + x, acc * 2 - x)
        return (acc % 97, ~flag), acc > 0

    return lax.scan(body, (n, mask), jnp.arange(6, dtype=jnp.int32))


@case("fori/scan_form", f32(3), tags=("fori", "scan"))
def fori_scan_form(x):
    # Concrete bounds: fori_loop lowers to scan (reverse-differentiable).
    return lax.fori_loop(0, 4, lambda i, c: c * 0.5 + jnp.sin(c) * i, x)


@case("fori/while_form", f32(3), scalar_i32(3), grad=False, tags=("fori", "while"))
def fori_while_form(x, n):
    # A traced upper bound: fori_loop lowers to while_loop.
    return lax.fori_loop(0, n, lambda i, c: c * 0.5 + jnp.cos(c) * i, x)


@case("map/plain", f32(4, 3), tags=("map", "scan"))
def map_plain(xs):
    return lax.map(lambda r: jnp.sum(jnp.sin(r)) * r, xs)


@case("map/batch_size", f32(6, 2), tags=("map", "scan"))
def map_batch_size(xs):
    return lax.map(lambda r: jnp.cumsum(r) * r[0], xs, batch_size=2)


# ---------------------------------------------------------------------------
# while_loop
# ---------------------------------------------------------------------------


@case("while/basic", f32(3), grad=False, tags=("while",))
def while_basic(x):
    def cond(state):
        return state[0] < 5

    def body(state):
        i, v = state
        return i + 1, jnp.cos(v) + v * 0.5

    return lax.while_loop(cond, body, (jnp.int32(0), x))


@case("while/zero_trip", f32(3), grad=False, tags=("while",))
def while_zero_trip(x):
    return lax.while_loop(lambda s: s[0] < 0, lambda s: (s[0] + 1, s[1] * 2.0), (jnp.int32(0), x))


@case("while/consts_in_cond_and_body", f32(3), scalar_i32(2), grad=False, tags=("while",))
def while_consts(x, limit):
    bound = limit + 2  # a traced const of the condition

    def body(state):
        i, v = state
        return i + 1, v @ _W33 + x  # consts of the body: _W33 and x

    return lax.while_loop(lambda s: s[0] < bound, body, (jnp.int32(0), x))


# ---------------------------------------------------------------------------
# cond and switch
# ---------------------------------------------------------------------------


@case("cond/basic", f32(3), f32(3), tags=("cond",))
def cond_basic(x, y):
    return lax.cond(jnp.sum(x) > 0, lambda a, b: a * b, lambda a, b: a - b, x, y)


@case("cond/int_operands_and_consts", i32(4), scalar_i32(1), tags=("cond", "int"))
def cond_int_operands(n, k):
    return lax.cond(k > 0, lambda a: (a * 3, a > 0), lambda a: (a - 7, a < 0), n)


@case("cond/no_operands", f32(2), tags=("cond",))
def cond_no_operands(x):
    return lax.cond(x[0] > x[1], lambda: x * 2.0, lambda: x + 1.0)


@case("switch/2", scalar_i32(1), f32(3), tags=("cond", "switch"))
def switch_2(index, x):
    return lax.switch(index, [lambda a: jnp.sin(a), lambda a: a * a], x)


@case("switch/3", scalar_i32(2), f32(3), tags=("cond", "switch"))
def switch_3(index, x):
    return lax.switch(index, [lambda a: a + 1.0, lambda a: a * 2.0, lambda a: jnp.exp(a)], x)


@case("switch/4_clamped_index", scalar_i32(7), f32(3), f32(3), tags=("cond", "switch"))
def switch_4(index, x, y):
    branches = [
        lambda a, b: (a + b, jnp.int32(0)),
        lambda a, b: (a - b, jnp.int32(1)),
        lambda a, b: (a * b, jnp.int32(2)),
        lambda a, b: (jnp.maximum(a, b), jnp.int32(3)),
    ]
    return lax.switch(index, branches, x, y)  # out-of-range index: clamped to 3


# ---------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------


@case("checkpoint/policy_dots", f32(3, 3), f32(3), tags=("checkpoint",))
def checkpoint_policy_dots(w, x):
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(lambda a, b: jnp.tanh(a @ b) @ a, policy=policy)(w, x)


@case("checkpoint/save_names_no_cse", f32(4), tags=("checkpoint",))
def checkpoint_save_names(x):
    from jax.ad_checkpoint import checkpoint_name

    def body(a):
        h = checkpoint_name(jnp.sin(a) * 2.0, "h")
        return jnp.cos(h) * a

    policy = jax.checkpoint_policies.save_only_these_names("h")
    return jax.checkpoint(body, policy=policy, prevent_cse=False)(x)


@case("checkpoint/static_argnums", f32(3), tags=("checkpoint",))
def checkpoint_static(x):
    body = jax.checkpoint(lambda a, n: a ** (n + 1), static_argnums=(1,))
    return body(x, 2)


# ---------------------------------------------------------------------------
# custom_jvp, custom_vjp
# ---------------------------------------------------------------------------


@jax.custom_jvp
def _softplus(x):
    return jnp.log1p(jnp.exp(x))


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # Deliberately 1.5x the true derivative: a driver that differentiates the
    # body instead of using the rule gives a different answer.
    return _softplus(x), jax.nn.sigmoid(x) * t * 1.5


@case("custom_jvp/rule", f32(4), tags=("custom_jvp",))
def custom_jvp_rule(x):
    return _softplus(x) * 2.0


@case("custom_jvp/jax_nn", f32(5), tags=("custom_jvp",))
def custom_jvp_jax_nn(x):
    return jax.nn.relu(x) + jax.nn.silu(x), jax.numpy.linalg.norm(x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _scaled(k, x):
    return jnp.sin(x) * k


@_scaled.defjvp
def _scaled_jvp(k, primals, tangents):
    (x,), (t,) = primals, tangents
    return _scaled(k, x), jnp.cos(x) * t * k * 0.5


@case("custom_jvp/nondiff_argnums", f32(3), tags=("custom_jvp",))
def custom_jvp_nondiff(x):
    return _scaled(3.0, x)


@jax.custom_vjp
def _clip_gradient(x, y):
    return x * y


def _clip_fwd(x, y):
    return x * y, (x, y)


def _clip_bwd(res, g):
    x, y = res
    return jnp.clip(g * y, -0.1, 0.1), g * x * 3.0


_clip_gradient.defvjp(_clip_fwd, _clip_bwd)


@case("custom_vjp/rule", f32(4), f32(4), jvp=False, tags=("custom_vjp",))
def custom_vjp_rule(x, y):
    return _clip_gradient(jnp.sin(x), y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(activation, x):
    return activation(x)


def _apply_fwd(activation, x):
    return activation(x), x


def _apply_bwd(activation, x, g):
    return (g * 2.0 + activation(x),)


_apply.defvjp(_apply_fwd, _apply_bwd)


@case("custom_vjp/nondiff_argnums", f32(4), jvp=False, tags=("custom_vjp",))
def custom_vjp_nondiff(x):
    return _apply(jnp.tanh, x) + _apply(jax.nn.sigmoid, x * 2.0)


# ---------------------------------------------------------------------------
# closed_call, named_call, custom_linear_solve, vmap inside
# ---------------------------------------------------------------------------


def _closed_call(fn: Callable[..., Any], *example: Any) -> Callable[..., Any]:
    """`fn` as a `closed_call` equation (`jax.named_call` makes none in JAX 0.10)."""
    closed = jax.make_jaxpr(fn)(*example)
    bind_params = closed_call_p.get_bind_params({"call_jaxpr": closed})

    def call(*args: Any) -> Any:
        return closed_call_p.bind(*args, **bind_params)

    return call


_cc_layer = _closed_call(
    lambda a, b: (jnp.tanh(a @ _W33) + b, jnp.sum(a)),
    jax.ShapeDtypeStruct((3,), jnp.float32),
    jax.ShapeDtypeStruct((3,), jnp.float32),
)


@case("closed_call/basic", f32(3), f32(3), tags=("closed_call",))
def closed_call_basic(x, y):
    return _cc_layer(x, y)


@case("named_call/basic", f32(3), tags=("named_call",))
def named_call_basic(x):
    return jax.named_call(lambda a: jnp.sin(a) * a, name="layer")(x)


@case("linear_solve/diagonal", f32(4), f32(4), tags=("custom_linear_solve",))
def linear_solve_diagonal(d, b):
    diag = d * d + 1.0
    return lax.custom_linear_solve(lambda v: diag * v, b, lambda mv, v: v / diag, symmetric=True)


@case("linear_solve/jacobi_transpose", f32(3, 3), f32(3), tags=("custom_linear_solve", "fori"))
def linear_solve_jacobi(a, b):
    m = a * 0.2 + 4.0 * jnp.eye(3)  # diagonally dominant, not symmetric

    def jacobi(matrix):
        diag = jnp.diag(matrix)

        def solve(matvec, v):
            return lax.fori_loop(0, 3, lambda i, x: x + (v - matvec(x)) / diag, v / diag)

        return solve

    return lax.custom_linear_solve(lambda v: m @ v, b, jacobi(m), jacobi(m.T))


@case("linear_solve/cg", f32(3, 3), f32(3), tags=("custom_linear_solve", "while"))
def linear_solve_cg(a, b):
    m = a @ a.T + 3.0 * jnp.eye(3)
    x, _ = jax.scipy.sparse.linalg.cg(lambda v: m @ v, b, maxiter=5)
    return x


@case("vmap_inside/cond_scan_while", f32(3, 2), grad=False, tags=("vmap", "cond", "scan", "while"))
def vmap_inside(xs):
    def row(r):
        r = lax.cond(r[0] > 0, lambda a: a * 2.0, lambda a: -a, r)  # becomes select
        r, _ = lax.scan(lambda c, _: (c * 0.5 + 1.0, None), r, None, length=3)
        _, r = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] + 1.0), (0, r))
        return r

    return jax.vmap(row)(xs)


@case("vmap_inside/in_axes", f32(3, 4), f32(4), tags=("vmap",))
def vmap_inside_in_axes(xs, y):
    return jax.vmap(lambda a, b: jnp.dot(a, b) * a, in_axes=(0, None), out_axes=1)(xs, y)


# ---------------------------------------------------------------------------
# Primitives with combiner jaxprs, random numbers, dtypes
# ---------------------------------------------------------------------------


@case("combiner/scatter_add", f32(5), jnp.asarray([0, 2, 2, 4], jnp.int32), f32(4))
def scatter_add(x, idx, v):
    return (
        x.at[idx].add(v),
        x.at[idx[:2]].mul(v[:2], unique_indices=True),
        x.at[idx].set(v * 2.0),
        x.at[idx].max(v),
    )


@case("combiner/segment_sum", f32(6), jnp.asarray([0, 1, 1, 2, 0, 2], jnp.int32))
def segment_sum(x, seg):
    return jax.ops.segment_sum(x, seg % 3, num_segments=3)


@case("combiner/generic_reduce", f32(4, 5), grad=False, jvp=False, tags=("reduce",))
def generic_reduce(x):
    # A variadic (value, index) argmax: the generic `reduce` primitive.
    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        take_a = (av > bv) | ((av == bv) & (ai < bi))
        return jnp.where(take_a, av, bv), jnp.where(take_a, ai, bi)

    idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return lax.reduce((x, idx), (jnp.float32(-jnp.inf), jnp.int32(0)), combine, (1,))


@case("combiner/reduce_window", f32(6, 4), grad=False, jvp=False, tags=("reduce_window",))
def generic_reduce_window(x):
    # A lambda, not lax.max: the generic `reduce_window` primitive.
    return lax.reduce_window(x, -jnp.inf, lambda a, b: jnp.maximum(a, b), (2, 2), (1, 1), "VALID")


@case("combiner/max_pool_and_cumsum", f32(6, 4), tags=("reduce_window",))
def max_pool_and_cumsum(x):
    pooled = lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 1), "SAME")
    return pooled, jnp.cumsum(x, axis=0), jnp.cumprod(x, axis=1)


@case("combiner/sort", f32(6), i32(6), tags=("sort",))
def sort_ops(x, n):
    keys, vals = lax.sort((n, x), num_keys=1)
    return jnp.sort(x), jnp.argsort(n, stable=True), keys, vals, lax.top_k(x, 2)[0]


@case("random/typed_key", jax.random.key(0), f32(3), tags=("random",))
def random_typed_key(key, scale):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.normal(k1, (3,)) * scale,
        jax.random.bernoulli(k2, 0.3, (4,)),
        jax.random.categorical(k2, scale),
    )


@case("random/raw_key_in_scan", jax.random.PRNGKey(7), f32(2), tags=("random", "scan"))
def random_raw_key_in_scan(key, x):
    def body(carry, _):
        k, v = carry
        k, sub = jax.random.split(k)
        return (k, v + jax.random.normal(sub, v.shape)), jax.random.randint(sub, (), 0, 10)

    return lax.scan(body, (key, x), None, length=3)


@case("dtypes/int_bool_ops", i32(6), bools(6), tags=("int",))
def int_bool_ops(n, mask):
    a = jnp.where(mask, n * 3 - 1, n // 2)
    b = (a << 2) ^ ((a >> 1) & 7)
    c = lax.population_count(jnp.abs(b)) + lax.clamp(-2, a, 2)
    return b, c, jnp.argmax(a), jnp.any(mask & (a > 0)), n.astype(jnp.uint8) * 200


@case("dtypes/low_precision_scan", f32(4), tags=("scan",))
def low_precision_scan(x):
    def body(c, _):
        return (c * jnp.bfloat16(0.75) + jnp.bfloat16(0.5)), c.astype(jnp.float16)

    return lax.scan(body, x.astype(jnp.bfloat16), None, length=3)


@case("misc/stop_gradient_barrier", f32(3), tags=("misc",))
def stop_gradient_barrier(x):
    y = lax.optimization_barrier(x * 2.0)
    return jnp.sin(y) + lax.stop_gradient(y) * x


# ---------------------------------------------------------------------------
# Nested at least three deep
# ---------------------------------------------------------------------------


@case("nest/scan_cond_while", f32(4, 2), grad=False, tags=("nested", "scan", "cond", "while"))
def nest_scan_cond_while(xs):
    def loop(v):
        return lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 0.5 + 1.0), (0, v))[1]

    def body(c, x):
        y = lax.cond(jnp.sum(x) > 0, loop, lambda v: v - 1.0, x + c)
        return c + y, y

    return lax.scan(body, jnp.zeros(2), xs)


@case(
    "nest/jit_scan_switch_checkpoint",
    f32(5, 3),
    tags=("nested", "jit", "scan", "switch", "checkpoint"),
)
def nest_jit_scan_switch_checkpoint(xs):
    heavy = jax.checkpoint(lambda a: jnp.sin(a @ _W33) * a)

    @jax.jit
    def run(xs):
        def body(c, x):
            i = jnp.int32(jnp.abs(jnp.sum(x)) * 2) % 3
            c = lax.switch(i, [heavy, lambda a: a * 0.5, lambda a: jnp.cos(a)], c + x)
            return c, jnp.sum(c)

        return lax.scan(body, jnp.ones(3), xs)

    return run(xs)


@case("nest/while_scan_cond", f32(3), grad=False, tags=("nested", "while", "scan", "cond"))
def nest_while_scan_cond(x):
    def inner(v):
        def body(c, i):
            return lax.cond(i % 2 == 0, lambda a: a + 1.0, lambda a: a * 0.9, c), i

        return lax.scan(body, v, jnp.arange(3))[0]

    return lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, inner(s[1])), (0, x))


@case(
    "nest/cond_jit_fori_custom_jvp",
    f32(3),
    scalar_i32(1),
    tags=("nested", "cond", "jit", "fori", "scan", "custom_jvp"),
)
def nest_cond_jit_fori_custom_jvp(x, flag):
    @jax.jit
    def heavy(a):
        return lax.fori_loop(0, 3, lambda i, c: _softplus(c) - 0.5, a)

    return lax.cond(flag > 0, heavy, lambda a: a * 3.0, x)


@jax.custom_vjp
def _scan_cond_prim(x):
    def body(c, v):
        return lax.cond(v > 0, lambda a: a * v, lambda a: a + v, c), c

    return lax.scan(body, jnp.float32(1.0), x)


def _scan_cond_fwd(x):
    return _scan_cond_prim(x), x


def _scan_cond_bwd(x, g):
    gc, gys = g
    return (gys * 0.5 + gc * jnp.cos(x),)


_scan_cond_prim.defvjp(_scan_cond_fwd, _scan_cond_bwd)


@case("nest/custom_vjp_scan_cond", f32(5), jvp=False, tags=("nested", "custom_vjp", "scan", "cond"))
def nest_custom_vjp_scan_cond(x):
    return _scan_cond_prim(x)


@case(
    "nest/checkpoint_scan_jit_custom_vjp",
    f32(4),
    f32(3, 4),
    jvp=False,
    tags=("nested", "checkpoint", "scan", "jit", "custom_vjp"),
)
def nest_checkpoint_scan_jit_custom_vjp(c0, xs):
    step = jax.jit(lambda c, x: _clip_gradient(jnp.tanh(c), x) + c)

    @jax.checkpoint
    def run(c, xs):
        return lax.scan(lambda c, x: (step(c, x), jnp.sum(c)), c, xs)

    return run(c0, xs)


@case("nest/map_switch_scan", f32(3, 2), grad=False, tags=("nested", "map", "scan", "switch"))
def nest_map_switch_scan(xs):
    def row(r):
        def accumulate(a):
            return lax.scan(lambda c, v: (c + v, c), 0.0, a)[0] * a

        i = jnp.int32(r[0] > 0) + jnp.int32(r[1] > 0)
        return lax.switch(i, [accumulate, lambda a: -a, jnp.sin], r)

    return lax.map(row, xs)


@case(
    "nest/closed_call_scan_linear_solve",
    f32(4, 3),
    tags=("nested", "closed_call", "scan", "custom_linear_solve"),
)
def nest_closed_call_scan_linear_solve(xs):
    def run(xs):
        def body(c, x):
            diag = x * x + 1.0
            y = lax.custom_linear_solve(
                lambda v: diag * v, c, lambda mv, v: v / diag, symmetric=True
            )
            return y + 0.1, jnp.sum(y)

        return lax.scan(body, jnp.ones(3), xs)

    return _closed_call(run, jax.ShapeDtypeStruct((4, 3), jnp.float32))(xs)


@case(
    "nest/jit_scan_cond_while_switch",
    f32(3, 2),
    grad=False,
    tags=("nested", "jit", "scan", "cond", "while", "switch"),
)
def nest_deep5(xs):
    @jax.jit
    def run(xs):
        def inner_while(v):
            def body(s):
                i, a = s
                return i + 1, lax.switch(i % 3, [jnp.sin, jnp.cos, lambda b: b * 0.5], a)

            return lax.while_loop(lambda s: s[0] < 3, body, (0, v))[1]

        def body(c, x):
            y = lax.cond(x[0] > 0, inner_while, lambda v: v + 1.0, c + x)
            return y, y

        return lax.scan(body, jnp.zeros(2), xs)

    return run(xs)


@case(
    "nest/vmap_checkpoint_custom_jvp_cond",
    f32(3, 2),
    tags=("nested", "vmap", "checkpoint", "custom_jvp", "cond"),
)
def nest_vmap_checkpoint_custom_jvp_cond(xs):
    @jax.checkpoint
    def row(r):
        return lax.cond(r[0] > 0, lambda a: _softplus(a), lambda a: a * 2.0, r)

    @jax.jit
    def outer(xs):
        return lax.map(row, xs)

    return jax.vmap(row)(xs), outer(xs)


@case(
    "nest/linear_solve_in_scan_in_cond",
    f32(3),
    f32(2, 3),
    tags=("nested", "cond", "scan", "custom_linear_solve", "custom_jvp"),
)
def nest_linear_solve_in_scan_in_cond(b, ds):
    def solve_all(b):
        def body(c, d):
            diag = d * d + 1.0

            def solve(mv, v):
                return _softplus(v) - _softplus(jnp.zeros_like(v)) + v / diag

            y = lax.custom_linear_solve(lambda v: diag * v, c, solve, symmetric=True)
            return y, y

        return lax.scan(body, b, ds)

    return lax.cond(jnp.sum(b) > -10.0, solve_all, lambda v: (v, jnp.stack([v, v])), b)


# ---------------------------------------------------------------------------
# shard_map on the 4x2 mesh (x: 4, y: 2), and pmap
# ---------------------------------------------------------------------------


def _shard_map(body: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    return jax.shard_map(body, mesh=MESH42, **kwargs)


@case("shard_map/full_psum_check_vma", f32(8, 4), tags=("shard_map",), mesh=True)
def sm_full_psum(x):
    def body(b):
        total = lax.psum(jnp.sum(b), ("x", "y"))
        return b * 2.0 + total, total

    return _shard_map(body, in_specs=P("x", "y"), out_specs=(P("x", "y"), P()))(x)


@case(
    "shard_map/full_pmax_no_check_vma",
    f32(8, 4),
    grad=False,
    jvp=False,
    tags=("shard_map",),
    mesh=True,
)
def sm_full_pmax(x):
    def body(b):
        return b - lax.pmax(jnp.max(b), ("x", "y")), lax.psum(b, "y")

    return _shard_map(body, in_specs=P("x", "y"), out_specs=(P("x", "y"), P("x")), check_vma=False)(
        x
    )


@case("shard_map/partial_x_check_vma", f32(8, 4), tags=("shard_map",), mesh=True)
def sm_partial_x(x):
    def body(b):
        i = lax.axis_index("x")
        return b * (i + 1).astype(b.dtype) + lax.psum(b, "x")

    return _shard_map(body, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})(x)


@case(
    "shard_map/partial_x_no_check_vma",
    f32(8, 4),
    grad=False,
    jvp=False,
    tags=("shard_map",),
    mesh=True,
)
def sm_partial_x_no_check(x):
    def body(b):
        return jnp.sin(b) + lax.pmax(b, "x")

    # Eagerly, JAX 0.10.2 rejects this partial-manual shard_map with check_vma=False
    # ("out_specs refers to 'y'"); under jit it works.
    return jax.jit(
        _shard_map(body, in_specs=P("x"), out_specs=P("x"), axis_names={"x"}, check_vma=False)
    )(x)


@case("shard_map/all_gather_axis_index", f32(8, 2), tags=("shard_map",), mesh=True)
def sm_all_gather(x):
    def body(b):
        gathered = lax.all_gather(b, "x", tiled=True)
        shift = (lax.axis_index("x") * 10 + lax.axis_index("y")).astype(b.dtype)
        return gathered + shift

    return _shard_map(body, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)


@case("shard_map/ppermute", f32(8, 2), tags=("shard_map",), mesh=True)
def sm_ppermute(x):
    def body(b):
        perm = [(i, (i + 1) % 4) for i in range(4)]
        return lax.ppermute(b, "x", perm) * 2.0 + b

    return _shard_map(body, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)


@case("shard_map/psum_scatter_all_to_all", f32(16, 4), tags=("shard_map",), mesh=True)
def sm_psum_scatter_all_to_all(x):
    def body(b):  # b: f32[4, 4] per shard
        scattered = lax.psum_scatter(b, "x", scatter_dimension=0, tiled=True)  # [1, 4]
        exchanged = lax.all_to_all(b, "x", split_axis=0, concat_axis=0, tiled=True)
        return scattered, exchanged

    return _shard_map(body, in_specs=P("x"), out_specs=(P("x"), P("x")), axis_names={"x"})(x)


@case("shard_map/in_scan", f32(8, 2), f32(3), tags=("shard_map", "scan", "nested"), mesh=True)
def sm_in_scan(x, ws):
    step = _shard_map(
        lambda b, w: b * w + lax.psum(jnp.sum(b), "x") * 0.01,
        in_specs=(P("x"), P()),
        out_specs=P("x"),
        axis_names={"x"},
    )
    return lax.scan(lambda c, w: (step(c, w), jnp.sum(c)), x, ws)


@case("shard_map/scan_inside", f32(8, 4), tags=("shard_map", "scan", "nested"), mesh=True)
def sm_scan_inside(x):
    def body(b):
        def step(c, _):
            c = c * 0.5 + lax.psum(jnp.sum(c), ("x", "y"))
            return c, lax.psum(jnp.max(c), ("x", "y"))

        return lax.scan(step, b, None, length=3)

    return _shard_map(body, in_specs=P("x", "y"), out_specs=(P("x", "y"), P()))(x)


@case(
    "shard_map/scan_cond_while_inside",
    f32(8, 4),
    grad=False,
    tags=("shard_map", "scan", "cond", "while", "nested"),
    mesh=True,
)
def sm_scan_cond_while(x):
    # No collective under a per-shard predicate: that deadlocks the CPU runtime.
    def body(b):
        def step(c, i):
            c = lax.cond(
                jnp.sum(c) > 0,
                lambda a: lax.while_loop(
                    lambda s: s[0] < i, lambda s: (s[0] + 1, s[1] * 0.5), (0, a)
                )[1],
                lambda a: a + 1.0,
                c,
            )
            return c, jnp.sum(c)

        c, sums = lax.scan(step, b, jnp.arange(3))
        return c + lax.psum(jnp.sum(c), "x"), sums

    return _shard_map(
        body, in_specs=P("x", "y"), out_specs=(P("x", "y"), P(("x", "y"))), check_vma=False
    )(x)


@case(
    "shard_map/scan_in_shard_map_in_scan",
    f32(8, 2),
    tags=("shard_map", "scan", "nested", "fori"),
    mesh=True,
)
def sm_scan_in_sm_in_scan(x):
    def body(b):
        b = lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c) + 0.1, b)
        return b + lax.psum(jnp.sum(b), "x") * 0.1

    step = _shard_map(body, in_specs=P("x", "y"), out_specs=P("x", "y"))
    return lax.scan(lambda c, _: (step(c), jnp.sum(c)), x, None, length=2)


@case(
    "shard_map/jit_checkpoint_inside",
    f32(8, 4),
    tags=("shard_map", "jit", "checkpoint", "nested"),
    mesh=True,
)
def sm_jit_checkpoint_inside(x):
    inner = jax.jit(jax.checkpoint(lambda a: jnp.sin(a) * a))

    def body(b):
        return inner(b) + lax.psum(b, "y")

    return _shard_map(body, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)


# grad=False: plain JAX 0.10.2 fails to lower the transpose of a nested shard_map
# ("operates on axis 'x' which is already bound by a parent sdy.manual_computation").
@case("shard_map/nested_x_then_y", f32(8, 4), grad=False, tags=("shard_map", "nested"), mesh=True)
def sm_nested_x_then_y(x):
    def outer(b):
        # The inner shard_map takes its mesh from the context: `x` is manual there.
        inner = jax.shard_map(
            lambda c: jnp.sin(c) * 2.0 + lax.psum(c, "y"),
            in_specs=P(None, "y"),
            out_specs=P(None, "y"),
            axis_names={"y"},
        )
        return inner(b) + lax.psum(b, "x")

    return _shard_map(outer, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})(x)


_pmapped = jax.pmap(lambda a: (lax.psum(a, "i"), a * lax.axis_index("i")), axis_name="i")


@case("pmap/psum_axis_index", f32(8, 3), vmap=False, tags=("pmap", "shard_map", "jit"), mesh=True)
def pmap_psum(x):
    return _pmapped(x)


# ---------------------------------------------------------------------------
# Explicit sharding on the 4x2 mesh with Explicit axes (sharding in types):
# `reshard`, `auto_axes` / `explicit_axes` regions, `out_sharding=` of jnp ops,
# shard_map (whose in_specs JAX checks against each argument's sharding), control
# flow and jit on sharded values. Arguments are placed with `jax.device_put`.
# Shardings are NamedShardings on MESH42E, so no context mesh is needed, except in
# the `set_mesh` case, which uses bare PartitionSpecs under `jax.set_mesh`.
# ---------------------------------------------------------------------------


def _on(*spec: Any) -> NamedSharding:
    return NamedSharding(MESH42E, P(*spec))


def _placed(x: jax.Array, *spec: Any) -> jax.Array:
    """`x` on MESH42E with sharding `P(*spec)` (as it is without eight devices)."""
    return jax.device_put(x, _on(*spec)) if HAS_MESH else x


@case(
    "explicit/reshard",
    _placed(f32(8, 4), "x", "y"),
    tags=("explicit", "reshard"),
    mesh=True,
)
def explicit_reshard(x):
    rows = jax.sharding.reshard(x * 2.0, _on("x", None))
    cols = jax.sharding.reshard(jnp.sin(rows), _on(None, "y"))
    tiles = jax.sharding.reshard(cols, _on("x", "y"))
    return tiles + x, jnp.sum(cols, axis=0), rows


@case(
    "explicit/auto_axes_matmul",
    _placed(f32(8, 4), "x", "y"),
    _placed(f32(4, 4), None, "y"),
    tags=("explicit", "auto_axes"),
    mesh=True,
)
def explicit_auto_axes_matmul(x, w):
    # Both operands sharded on "y" in their contracting dimension: no sharding
    # type for the product, so the product runs in an auto_axes region.
    product = jax.sharding.auto_axes(
        lambda a, b: jnp.tanh(a @ b.T) * 2.0, out_sharding=_on("x", None)
    )(x, w)
    # The same, with the output sharding given to the op itself.
    direct = jnp.matmul(x, jax.sharding.reshard(w, _on("y", None)), out_sharding=_on("x", None))
    return product, direct, jnp.einsum("ij,ij->i", product, direct, out_sharding=_on("x"))


@case(
    "explicit/explicit_axes_in_auto_axes",
    _placed(f32(8, 4), "x", "y"),
    tags=("explicit", "auto_axes", "explicit_axes"),
    mesh=True,
)
def explicit_explicit_axes(x):
    def auto_region(a):
        # Axes are Auto here; `explicit_axes` makes them Explicit again inside.
        typed = jax.sharding.explicit_axes(
            lambda t: jnp.sum(jnp.cos(t) * t, axis=1), in_sharding=_on("x", None)
        )
        return typed(a * 0.5)

    return jax.sharding.auto_axes(auto_region, out_sharding=_on("x"))(x) + 1.0


@case(
    "explicit/shard_map_full",
    _placed(f32(8, 4), "x", "y"),
    _placed(f32(8, 4), "x", "y"),
    tags=("explicit", "shard_map"),
    mesh=True,
)
def explicit_shard_map_full(x, y):
    def body(a, b):
        total = lax.psum(jnp.sum(a * b), ("x", "y"))
        return jnp.sin(a) + total * 0.01, total

    mapped = jax.shard_map(
        body, mesh=MESH42E, in_specs=(P("x", "y"), P("x", "y")), out_specs=(P("x", "y"), P())
    )
    return mapped(x, y)


@case(
    "explicit/shard_map_partial_x",
    _placed(f32(8, 4), "x", None),
    tags=("explicit", "shard_map"),
    mesh=True,
)
def explicit_shard_map_partial(x):
    def body(a):
        i = lax.axis_index("x").astype(a.dtype)
        return a * (i + 1.0) + lax.psum(a, "x")

    return jax.shard_map(body, mesh=MESH42E, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})(x)


@case(
    "explicit/scan",
    _placed(f32(4), "y"),
    _placed(f32(5, 4), None, "y"),
    tags=("explicit", "scan"),
    mesh=True,
)
def explicit_scan(c0, xs):
    def body(c, x):
        c = jnp.tanh(c * 0.5 + x)
        return c, jnp.sum(c * x)

    return lax.scan(body, c0, xs)


@case(
    "explicit/while",
    _placed(f32(8, 4), "x", "y"),
    grad=False,
    tags=("explicit", "while"),
    mesh=True,
)
def explicit_while(x):
    def body(state):
        i, v = state
        return i + 1, jnp.cos(v) * 0.5 + v

    return lax.while_loop(lambda s: s[0] < 3, body, (jnp.int32(0), x))


# vmap=False: plain JAX cannot batch it (a batched predicate turns the cond into a
# `select_n` whose unsharded `which` must have the cases' sharding: ShardingTypeError).
@case(
    "explicit/cond",
    _placed(f32(8, 4), "x", "y"),
    _placed(f32(8, 4), "x", "y"),
    vmap=False,
    tags=("explicit", "cond"),
    mesh=True,
)
def explicit_cond(x, y):
    return lax.cond(jnp.sum(x) > 0, lambda a, b: a * b, lambda a, b: jnp.sin(a) - b, x, y)


if HAS_MESH:
    _explicit_jit = jax.jit(
        lambda a, b: (jnp.tanh(a) * 2.0 + 1.0, jnp.sum(b, axis=1)),
        in_shardings=(_on("x", "y"), _on("x", None)),
        out_shardings=(_on("x", "y"), _on("x")),
    )


@case(
    "explicit/jit_shardings",
    _placed(f32(8, 4), "x", "y"),
    _placed(f32(8, 4), "x", None),
    tags=("explicit", "jit"),
    mesh=True,
)
def explicit_jit_shardings(x, y):
    return _explicit_jit(x, y)


@case(
    "explicit/set_mesh_partition_specs",
    _placed(f32(8, 4), "x", "y"),
    _placed(f32(4, 4), None, "y"),
    tags=("explicit", "reshard", "shard_map"),
    context_mesh=MESH42E,
    mesh=True,
)
def explicit_set_mesh(x, w):
    # Bare PartitionSpecs: JAX takes the mesh from `jax.set_mesh` (Case.context).
    cols = jax.sharding.reshard(x, P(None, "y"))
    bias = jnp.ones((8, 4), out_sharding=P("x", "y")) * 0.5
    product = jnp.matmul(cols, w, out_sharding=P(None, "y"))
    mapped = jax.shard_map(
        lambda b: b + lax.psum(jnp.sum(b), "x"), in_specs=P("x", "y"), out_specs=P("x", "y")
    )(x + bias)
    return product, mapped


@case(
    "explicit/nest_jit_scan_cond_shard_map",
    _placed(f32(8, 4), "x", "y"),
    f32(3),
    vmap=False,  # a cond with a batched predicate: see explicit/cond
    tags=("explicit", "nested", "jit", "scan", "cond", "shard_map", "auto_axes"),
    mesh=True,
)
def explicit_nested(x, ws):
    step = jax.shard_map(
        lambda b, s: b * s + lax.psum(jnp.sum(b), ("x", "y")) * 0.01,
        mesh=MESH42E,
        in_specs=(P("x", "y"), P()),
        out_specs=P("x", "y"),
    )

    @jax.jit
    def run(x, ws):
        def body(c, s):
            # The predicate is a global sum: every shard takes the same branch.
            c = lax.cond(jnp.sum(c) > 0, lambda a: step(a, s), lambda a: a * 0.5 + s, c)
            mixed = jax.sharding.auto_axes(
                lambda a: jnp.tanh(a @ a.T) @ a, out_sharding=_on("x", "y")
            )(c)
            return jax.sharding.reshard(mixed * 0.1, _on("x", "y")), jnp.sum(mixed)

        return lax.scan(body, x, ws)

    return run(x, ws)
