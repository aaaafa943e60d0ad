"""`stage_eagerly`: effects called without jit run as one compiled program."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kups.checks import check, checked
from kups.debug import find_nans
from kups.effects import Interpreter, default_dispatcher, reinterpret
from kups.effects.toolkit import stage_eagerly
from kups.harvest import reap, sow
from kups.instrument import count_primitives


def traced_counter():
    """A function that counts how many times it is traced (a Python side effect)."""
    traces = []

    def f(x):
        traces.append(1)
        return jnp.sin(sow(x * 2.0, tag="t", name="doubled"))

    return f, traces


@pytest.mark.parametrize(
    "effect",
    [
        lambda f: reap(f, tag="t"),
        count_primitives,
        checked,
        find_nans,
    ],
    ids=["reap", "count_primitives", "checked", "find_nans"],
)
def test_an_effect_called_eagerly_is_traced_once_per_signature(effect):
    f, traces = traced_counter()
    wrapped = effect(f)
    first = wrapped(jnp.ones(3))
    again = wrapped(jnp.array([0.5, 0.5, 0.5]))
    assert len(traces) == 1  # compiled on the first call, reused by the second
    np.testing.assert_allclose(again[0], jnp.sin(jnp.full(3, 1.0)), rtol=1e-6)
    np.testing.assert_allclose(first[0], jnp.sin(jnp.full(3, 2.0)), rtol=1e-6)
    wrapped(jnp.ones(4))  # a new shape traces again
    assert len(traces) == 2


def test_the_identity_interpretation_is_not_staged():
    f, traces = traced_counter()
    identity = reinterpret(f, Interpreter(default_dispatcher()))
    x = jnp.linspace(-1.0, 1.0, 7)
    for _ in range(2):
        out, _ = identity(None, x)
        np.testing.assert_array_equal(out, f(x))
    assert len(traces) == 4  # every call traces f (and so does f(x) itself)


def test_under_a_transformation_the_wrapper_is_traced_in_place():
    f, traces = traced_counter()
    wrapped = count_primitives(f)
    grads = jax.grad(lambda x: wrapped(x)[0].sum())(jnp.ones(3))
    np.testing.assert_allclose(grads, 2.0 * jnp.cos(jnp.full(3, 2.0)), rtol=1e-6)
    batched = jax.vmap(lambda x: wrapped(x)[0])(jnp.ones((2, 3)))
    assert batched.shape == (2, 3)
    assert len(traces) == 2  # once under grad, once under vmap: neither staged


def test_counts_of_a_staged_call_are_python_ints():
    _, counts = count_primitives(lambda x: jnp.sin(x) + 1.0)(jnp.ones(2))
    assert dict(counts) == {"sin": 1, "add": 1}
    assert all(type(count) is int for count in counts.values())


def test_a_static_argument_that_cannot_be_hashed_runs_unstaged():
    class Scale:  # not hashable: equality without a hash
        def __eq__(self, other):
            return isinstance(other, Scale)

        __hash__ = None  # type: ignore[assignment]

    def f(x, scale):
        del scale
        check(jnp.all(x > 0), "negative")
        return x * 2.0

    _, error = checked(f)(jnp.array([1.0, -1.0]), Scale())
    assert error.get().startswith("negative")


def test_a_wrapper_that_runs_only_eagerly_falls_back_to_op_by_op():
    calls = []

    def wrapper(x):
        calls.append(1)
        return x * float(x.sum())  # needs a concrete x: fails under jit

    staged = stage_eagerly(wrapper, finish=lambda out: out + 1.0)
    np.testing.assert_array_equal(staged(jnp.ones(2)), jnp.full(2, 2.0))
    assert len(calls) == 2  # tried compiled, then run as it is
    assert staged.__name__ == "wrapper" and not hasattr(staged, "__wrapped__")


@pytest.mark.parametrize("effect", ["stage_eagerly", "checked", "count_primitives"])
def test_a_program_that_fails_while_it_runs_runs_once(effect):
    # An error the compiled program raises is raised as it is: falling back to
    # op by op would run its callbacks (a log, a write) a second time.
    calls = []

    def f(x):
        jax.debug.callback(lambda v: calls.append(float(v)), x)
        return eqx.error_if(x, x > 1.0, "x too big")

    run = {
        "stage_eagerly": stage_eagerly(f),
        "checked": checked(f),
        "count_primitives": count_primitives(f),
    }[effect]
    with pytest.raises(RuntimeError, match="x too big"):
        run(jnp.float32(2.0))
    jax.effects_barrier()
    assert calls == [2.0]


def test_finish_shapes_the_results_of_a_compiled_call():
    staged = stage_eagerly(lambda x: (x, x.sum()), finish=lambda r: (r[0], int(r[1])))
    out, total = staged(jnp.arange(4))
    assert type(total) is int and total == 6
    np.testing.assert_array_equal(out, jnp.arange(4))
    # Under jit the wrapper is traced in place, and `finish` does not run.
    assert isinstance(jax.jit(staged)(jnp.arange(4))[1], jax.Array)


def test_disable_jit_runs_an_effect_op_by_op():
    f, traces = traced_counter()
    wrapped = reap(f, tag="t")
    x = jnp.linspace(-1.0, 1.0, 5)
    with jax.disable_jit():
        out, sown = wrapped(x)
        wrapped(x)
    assert len(traces) == 2  # traced on every call, as an unstaged effect is
    np.testing.assert_array_equal(out, f(x))
    np.testing.assert_array_equal(sown["doubled"], x * 2.0)
