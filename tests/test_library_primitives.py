"""Library primitives kups goes inside: `default_library_primitive_handler`.

A primitive whose implementation is a traceable Python function (an equinox
filter primitive such as lineax's `linear_solve`) is entered: its
implementation, traced, is interpreted with the context, once; its derivatives
are the primitive's own rules. Plain JAX is the oracle: values, `jax.jvp`,
`jax.grad`, `jax.vmap`, second derivatives, and how many times the
implementation runs (a host callback inside it). `custom_partitioning` is not
entered: it is re-bound whole when nothing inside it goes to a handler.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from kups.effects import (
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    default_dispatcher,
    default_library_primitive_handler,
    default_primitive_handler,
    is_library_primitive,
    reinterpret,
    sub_jaxprs,
)
from kups.harvest import reap, sow
from kups.instrument import count_primitives
from library_primitive import library_fn_call, library_solve

A = jnp.array([[4.0, 1.0, 0.5], [1.0, 3.0, 0.0], [0.5, 0.0, 2.0]])
B = jnp.array([1.0, -2.0, 0.5])


def count_lu(interpreter: Any, ctx: Any, eqn: Any, invals: list[Any]) -> HandlerResult:
    return HandlerResult(ctx + 1, default_primitive_handler(interpreter, ctx, eqn, invals).outvals)


def entering(*names: str) -> Interpreter:
    """An interpreter that goes inside the test primitives `names` and counts
    the LU factorisations (one a solve) in its context."""
    dispatcher = default_dispatcher().register_handler("lu", count_lu)
    for name in names:
        dispatcher.register_handler(name, default_library_primitive_handler)
    return Interpreter(dispatcher)


SOLVING = entering("library_solve")


def interpreted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`'s outputs, interpreted by `SOLVING` (the count dropped)."""
    return lambda *args: reinterpret(fn, SOLVING)(0, *args)[0]


def assert_equal(actual: Any, expected: Any) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def solve(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.tanh(library_solve(a, jnp.sin(b)))


def loss(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.sum(solve(a, b) ** 2)


def test_counts_inside_and_values() -> None:
    for run in (reinterpret(solve, SOLVING), jax.jit(reinterpret(solve, SOLVING))):
        out, lus = run(0, A, B)
        assert int(lus) == 1  # jnp.linalg.solve factorises once, inside the primitive
        assert_equal(out, solve(A, B))
    assert_equal(jax.jit(interpreted(solve))(A, B), jax.jit(solve)(A, B))


def test_derivatives_are_the_primitives() -> None:
    tangents = (jnp.ones_like(A), jnp.linspace(0.5, 1.5, 3))
    assert_equal(jax.jvp(interpreted(solve), (A, B), tangents), jax.jvp(solve, (A, B), tangents))
    for argnums in (0, 1, (0, 1)):
        assert_equal(
            jax.grad(lambda a, b: jnp.sum(interpreted(solve)(a, b) ** 2), argnums)(A, B),
            jax.grad(loss, argnums)(A, B),
        )
    # Second order under `jit` (eagerly, kups' custom_jvp runs compiled where
    # plain JAX runs op by op: the last bit may differ).
    assert_equal(
        jax.jit(jax.hessian(lambda b: jnp.sum(interpreted(solve)(A, b) ** 2)))(B),
        jax.jit(jax.hessian(lambda b: loss(A, b)))(B),
    )
    assert_equal(
        jax.jit(jax.jacfwd(jax.grad(lambda a: jnp.sum(interpreted(solve)(a, B) ** 2))))(A),
        jax.jit(jax.jacfwd(jax.grad(lambda a: loss(a, B))))(A),
    )
    bs = jnp.stack([B, 2.0 * B, -B])
    assert_equal(jax.vmap(interpreted(solve), (None, 0))(A, bs), jax.vmap(solve, (None, 0))(A, bs))
    assert_equal(
        jax.vmap(jax.grad(lambda a, b: jnp.sum(interpreted(solve)(a, b) ** 2)), (None, 0))(A, bs),
        jax.vmap(jax.grad(loss), (None, 0))(A, bs),
    )


def test_context_counts_under_grad() -> None:
    # The count made inside the primitive leaves through the context under
    # `jax.grad` too: the solve ran once forward (the tangent and transposed
    # solves of the primitive's own rules are plain JAX's, outside the context).
    def counted_loss(a: jax.Array) -> tuple[jax.Array, Any]:
        out, lus = reinterpret(solve, SOLVING)(0, a, B)
        return jnp.sum(out**2), lus

    grad, lus = jax.grad(counted_loss, has_aux=True)(A)
    assert int(lus) == 1
    assert_equal(grad, jax.grad(loss)(A, B))


def runs_of(transform: Callable[[Callable[..., Any]], Any], through_kups: bool) -> int:
    """How many times the primitive's implementation ran (its host callback)
    under `transform`."""
    runs: list[int] = []

    def fn(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.tanh(library_solve(a, jnp.sin(b), on_run=lambda _: runs.append(1)))

    transform(interpreted(fn) if through_kups else fn)
    jax.effects_barrier()
    return len(runs)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: f(A, B),
        lambda f: jax.jit(f)(A, B),
        lambda f: jax.jvp(f, (A, B), (A, B)),
        lambda f: jax.grad(lambda a: jnp.sum(f(a, B)))(A),
        lambda f: jax.jit(jax.grad(lambda b: jnp.sum(f(A, b))))(B),
        lambda f: jax.vmap(f, (None, 0))(A, jnp.stack([B, B])),
    ],
    ids=["eager", "jit", "jvp", "grad", "jit-grad", "vmap"],
)
def test_implementation_runs_as_often_as_in_plain_jax(transform: Any) -> None:
    # The primal is not solved twice: the rule's own re-bind of the primitive is
    # replaced by the interpreted outputs.
    expected = runs_of(transform, through_kups=False)
    assert expected >= 1
    assert runs_of(transform, through_kups=True) == expected


def test_python_function_primitive_entered_once_registered() -> None:
    # A primitive that holds a Python function (no jaxpr), as lineax's solve does
    # with a module-level operator: opaque by default, entered once the handler is
    # registered for its name.
    def fn(b: jax.Array) -> jax.Array:
        (x,) = library_fn_call(lambda b: (jnp.linalg.solve(A, sow(b, tag="lib", name="rhs")),), b)
        return x

    closed = jax.make_jaxpr(fn)(B)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "library_fn_call"]
    assert is_library_primitive(eqn) and not sub_jaxprs(eqn)
    # reap's dispatcher does not enter it: the sow is lost (reported, or ignored).
    with pytest.raises(NotImplementedError, match="would be lost"):
        reap(fn, tag="lib")(B)
    assert reap(fn, tag="lib", policy=InterpreterPolicy.IGNORE)(B)[1] == {}
    # An interpreter that enters it counts the LU inside.
    out, lus = reinterpret(fn, entering("library_fn_call"))(0, B)
    assert int(lus) == 1
    assert_equal(out, fn(B))


def test_no_jvp_rule_raises_as_plain_jax() -> None:
    def fn(b: jax.Array) -> jax.Array:
        (x,) = library_fn_call(lambda b: (jnp.sin(b),), b)
        return jnp.sum(x)

    interpreter = entering("library_fn_call")
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'library_fn_call'"):
        jax.grad(fn)(B)
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'library_fn_call'"):
        jax.grad(lambda b: reinterpret(fn, interpreter)(0, b)[0])(B)
    assert_equal(reinterpret(fn, interpreter)(0, B)[0], fn(B))


# A primitive whose implementation needs concrete values (as equinox's
# `noinline` does, looking its function up by a traced index); it holds its
# program as a jaxpr, as a library's control flow does.
concrete_p = Primitive("library_concrete")
concrete_p.multiple_results = True


def _concrete_impl(x: Any, *, program: tuple[Any, ...]) -> list[Any]:
    (closed,) = program
    scale = int(x[0] > 0)  # needs a concrete value
    return [scale * out for out in jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)]


def _concrete_lowering(x: Any, *, program: tuple[Any, ...]) -> list[Any]:
    (closed,) = program
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)


concrete_p.def_impl(_concrete_impl)
concrete_p.def_abstract_eval(lambda x, program: [v.aval for v in program[0].jaxpr.outvars])
mlir.register_lowering(concrete_p, mlir.lower_fun(_concrete_lowering, multiple_results=True))


def test_untraceable_implementation_stays_opaque_with_the_reason() -> None:
    def fn(b: jax.Array) -> jax.Array:
        program = jax.make_jaxpr(lambda b: jnp.linalg.solve(A, b))(b)
        (x,) = concrete_p.bind(b, program=(program,))
        return x + 1.0

    interpreter = entering("library_concrete")
    with pytest.raises(NotImplementedError, match=r"'library_concrete'.*cannot be traced"):
        reinterpret(fn, interpreter)(0, B)
    # Re-bound unchanged when no handler would act inside (the identity).
    assert_equal(reinterpret(fn, Interpreter(default_dispatcher()))(0, B)[0], fn(B))


# ---------------------------------------------------------------------------
# custom_partitioning: re-bound whole, its partitioning rule kept.
# ---------------------------------------------------------------------------


def partitioned(sowing: bool, partitions: list[Any]) -> Callable[..., Any]:
    custom_partitioning = pytest.importorskip("jax.experimental.custom_partitioning")

    @custom_partitioning.custom_partitioning
    def kernel(x: jax.Array) -> jax.Array:
        if sowing:
            x = sow(x, tag="cp", name="inside")
        return jnp.sin(x) * 2.0

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        partitions.append(arg_shapes[0].sharding.spec)
        return mesh, lambda x: jnp.sin(x) * 2.0, result_shape.sharding, (arg_shapes[0].sharding,)

    kernel.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: arg_shapes[0].sharding,
        sharding_rule="i -> i",
    )
    return kernel


def sharded_input() -> jax.Array:
    mesh = jax.make_mesh((8,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    return jax.device_put(jnp.arange(16.0), sharding)


def test_custom_partitioning_rebound_quietly() -> None:
    partitions: list[Any] = []
    kernel = partitioned(False, partitions)

    def program(x: jax.Array) -> jax.Array:
        return sow(kernel(x), tag="cp", name="out") + 1.0

    x = sharded_input()
    expected = jax.jit(program)(x)
    assert len(partitions) == 1  # XLA asked the user's rule to partition it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, ctx = jax.jit(reinterpret(program, Interpreter(default_dispatcher())))(0, x)
        assert_equal(out, expected)
        assert int(ctx) == 0
        out, reaped = jax.jit(reap(program, tag="cp"))(x)
    assert_equal(out, expected)
    assert_equal(reaped, {"out": jax.jit(kernel)(x)})
    # Each compiled program ran the user's partitioning rule again: the kernel
    # is still the user's, not a re-traced body.
    assert len(partitions) == 4


def test_custom_partitioning_says_what_is_lost() -> None:
    x = sharded_input()
    sowing = partitioned(True, [])
    with pytest.raises(NotImplementedError, match=r"'custom_partitioning'.*would be lost"):
        reap(lambda x: sowing(x) + 1.0, tag="cp")(x)
    out, reaped = reap(lambda x: sowing(x) + 1.0, tag="cp", policy=InterpreterPolicy.IGNORE)(x)
    assert reaped == {}
    assert_equal(out, jnp.sin(x) * 2.0 + 1.0)
    plain = partitioned(False, [])
    with pytest.raises(NotImplementedError, match="count inside the control-flow primitive"):
        count_primitives(plain)(x)
    _, counts = count_primitives(lambda x: plain(x) + 1.0, policy=InterpreterPolicy.IGNORE)(x)
    assert counts == {"add": 1} and counts.opaque == {"custom_partitioning": 1}
