"""`kups.checks`: `check` recorded through jit, loops, cond, shard_map; `Error` readout."""

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kups.checks import (
    CheckFailed,
    Error,
    all_checks,
    automatic_checks,
    check,
    checked,
    div_checks,
    float_checks,
    index_checks,
    nan_checks,
    user_checks,
)
from kups.checks._first import first_true
from kups.debug import find_nans
from kups.instrument import count_primitives

_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def at(marker: str) -> str:
    """`test_checks.py:LINE` of the only line holding `# <marker>`."""
    lines = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, marker
    return f"test_checks.py:{lines[0]}"


def positive(x):
    check(x > 0, "x must be positive, got {}", x)  # positive
    return x * 2


def test_passing_check_gives_no_error():
    out, error = checked(positive)(jnp.float32(3.0))
    assert out == 6.0
    assert error.get() is None
    error.throw()
    assert repr(error) == "Error(None)"


def test_failing_check_eagerly():
    out, error = checked(positive)(jnp.float32(-1.0))
    assert out == -2.0  # the program runs on; the check only records
    message = f"x must be positive, got -1.0 ({at('positive')})"
    assert error.get() == message
    assert repr(error) == f"Error({message!r})"
    with pytest.raises(CheckFailed, match=re.escape(message)):
        error.throw()


@pytest.mark.parametrize("x, failed", [(3.0, False), (-1.0, True)])
def test_error_returned_from_jit(x, failed):
    out, error = jax.jit(checked(positive))(jnp.float32(x))
    assert isinstance(error, Error)
    assert out == 2 * x
    assert (error.get() is not None) == failed
    assert bool(error.failed) == failed


def test_get_under_jit_is_a_clear_error():
    @jax.jit
    def run(x):
        _, error = checked(positive)(x)
        assert repr(error).startswith("Error(<traced>")
        return error.get()

    with pytest.raises(TypeError, match=r"outside jit"):
        run(jnp.float32(1.0))


def test_error_is_a_pytree_through_jit():
    _, error = checked(positive)(jnp.float32(-4.0))
    again = jax.jit(lambda e: e)(error)
    assert again.get() == error.get() == f"x must be positive, got -4.0 ({at('positive')})"


def test_check_outside_checked_does_nothing():
    assert jax.jit(positive)(jnp.float32(-1.0)) == -2.0
    assert jax.grad(positive)(jnp.float32(-1.0)) == 2.0


def test_first_failure_wins_between_two_sites():
    def f(x):
        check(x > 1, "first: {}", x)  # first site
        check(x > 2, "second: {}", x)  # second site
        return x

    assert checked(f)(jnp.float32(1.5))[1].get() == f"second: 1.5 ({at('second site')})"
    assert checked(f)(jnp.float32(0.5))[1].get() == f"first: 0.5 ({at('first site')})"


def test_first_failure_in_execution_order_across_iterations():
    # The site that comes later in the body fails in an earlier iteration: it wins.
    def f(xs):
        def step(carry, x):
            check(x < 5, "early site: {}", x)  # early site
            check(x != 3, "late site: {}", x)  # late site
            return carry, None

        return lax.scan(step, 0, xs)[0]

    error = jax.jit(checked(f))(jnp.arange(8))[1]
    assert error.get() == f"late site: 3 at iteration 3 ({at('late site')})"


def test_format_arguments_take_the_failing_values():
    def f(xs):
        def step(total, x):
            total = total + x
            check(total < 10, "total {:.2f} after x={} ({})", total, x, "running sum")  # total
            return total, None

        return lax.scan(step, jnp.float32(0), xs)[0]

    error = jax.jit(checked(f))(jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], jnp.float32))[1]
    assert error.get() == f"total 10.00 after x=4.0 (running sum) at iteration 3 ({at('total')})"


def test_format_arguments_may_be_pytrees_and_arrays():
    def f(x):
        check(jnp.all(x > 0), "bad {0[name]}: {0[values]}", {"name": "x", "values": x})  # tree
        return x

    error = checked(f)(jnp.array([1, -2, 3]))[1]
    assert error.get() == f"bad x: [ 1 -2  3] ({at('tree')})"


def step_nonnegative(carry, x):
    check(x >= 0, "negative entry {}", x)  # scan body
    return carry + x, carry


@pytest.mark.parametrize("jit", [False, True])
def test_scan_reports_the_iteration(jit):
    def f(xs):
        return lax.scan(step_nonnegative, 0.0, xs)

    run = checked(f)
    if jit:
        run = jax.jit(run)
    (total, partial_sums), error = run(jnp.array([1.0, 2.0, 3.0, -4.0, -5.0]))
    np.testing.assert_allclose(partial_sums, [0.0, 1.0, 3.0, 6.0, 2.0])
    assert total == -3.0
    assert error.get() == f"negative entry -4.0 at iteration 3 ({at('scan body')})"


def test_reverse_scan_reports_the_index_of_xs():
    def f(xs):
        return lax.scan(step_nonnegative, 0.0, xs, reverse=True)

    # Runs xs[4], xs[3], ...: xs[3] is the first negative entry it meets.
    error = checked(f)(jnp.array([-1.0, 2.0, -3.0, -4.0, 5.0]))[1]
    assert error.get() == f"negative entry -4.0 at iteration 3 ({at('scan body')})"


def doubling(i, value):
    check(value < 100, "value {} at i={}", value, i)  # fori body
    return value * 2


@pytest.mark.parametrize("static_bounds", [True, False], ids=["scan", "while"])
def test_fori_loop(static_bounds):
    def f(x, upper):
        return lax.fori_loop(0, upper, doubling, x)

    if static_bounds:
        run = jax.jit(checked(f), static_argnums=1)
    else:
        run = jax.jit(checked(f))
    out, error = run(jnp.float32(3.0), 10)
    assert out == 3.0 * 2**10
    assert error.get() == f"value 192.0 at i=6 at iteration 6 ({at('fori body')})"


def test_while_loop_reports_the_iteration():
    def f(n):
        def body(state):
            i, total = state
            check(total < 10, "total {} at i={}", total, i)  # while body
            return i + 1, total + i

        return lax.while_loop(lambda state: state[0] < n, body, (0, 0))

    assert checked(f)(jnp.int32(5))[1].get() is None
    out, error = jax.jit(checked(f))(jnp.int32(20))
    assert tuple(map(int, out)) == (20, 190)
    assert error.get() == f"total 10 at i=5 at iteration 5 ({at('while body')})"


def test_zero_trip_loops_do_not_fail():
    def f(xs, n):
        lax.scan(step_nonnegative, 0.0, xs)
        return lax.fori_loop(0, n, doubling, jnp.float32(1000.0))

    assert checked(f)(jnp.zeros((0,)), jnp.int32(0))[1].get() is None


def test_check_in_a_while_condition():
    def f(n):
        def condition(i):
            check(i < 3, "condition saw {}", i)  # while condition
            return i < n

        return lax.while_loop(condition, lambda i: i + 1, 0)

    assert checked(f)(jnp.int32(2))[1].get() is None
    # The condition runs before iteration i with i iterations done.
    message = f"condition saw 3 at iteration 3 ({at('while condition')})"
    assert jax.jit(checked(f))(jnp.int32(10))[1].get() == message


def test_nested_loops_report_every_level():
    def f(xs):
        def outer(carry, row):
            def inner(state):
                j, total = state
                check(total < 3, "total {}", total)  # innermost
                return j + 1, total + row[j]

            return carry, lax.while_loop(lambda s: s[0] < row.shape[0], inner, (0, 0.0))[1]

        return lax.scan(outer, 0, xs)

    xs = jnp.array([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    error = jax.jit(checked(f))(xs)[1]
    # Row 2 is the first whose running total reaches 3 before its end: after 2 entries.
    assert error.get() == (
        f"total 4.0 at iterations 2, 2 (outermost loop first) ({at('innermost')})"
    )


def test_three_levels_and_cond_inside_loops():
    def f(xs):
        def outer(carry, plane):
            def middle(carry, row):
                def inner(carry, x):
                    x = lax.cond(x > 6, lambda: -x, lambda: x)
                    check(x >= 0, "x {}", x)  # three levels
                    return carry, None

                return lax.scan(inner, carry, row)[0], None

            return lax.scan(middle, carry, plane)[0], None

        return lax.scan(outer, 0, xs)[0]

    error = jax.jit(checked(f))(jnp.arange(12).reshape(2, 2, 3))[1]
    assert error.get() == (
        f"x -7 at iterations 1, 0, 1 (outermost loop first) ({at('three levels')})"
    )


def branches():
    def positive_branch(x):
        check(x > 0, "branch 0 wants a positive x, got {}", x)  # branch 0
        return x

    def any_branch(x):
        return -x

    def large_branch(x):
        check(x > 10, "branch 2 wants x > 10, got {}", x)  # branch 2
        return 2 * x

    return [positive_branch, any_branch, large_branch]


def test_cond_only_the_taken_branch_can_fail():
    def f(pred, x):
        positive_branch, any_branch, _ = branches()
        return lax.cond(pred, positive_branch, any_branch, x)

    run = jax.jit(checked(f))
    assert run(True, jnp.float32(1.0))[1].get() is None
    assert run(False, jnp.float32(-1.0))[1].get() is None
    error = run(True, jnp.float32(-1.0))[1]
    assert error.get() == f"branch 0 wants a positive x, got -1.0 ({at('branch 0')})"


@pytest.mark.parametrize(
    "index, expected", [(0, None), (1, None), (2, "branch 2 wants x > 10, got 5.0")]
)
def test_switch(index, expected):
    def f(i, x):
        return lax.switch(i, branches(), x)

    error = jax.jit(checked(f))(jnp.int32(index), jnp.float32(5.0))[1]
    if expected is None:
        assert error.get() is None
    else:
        assert error.get() == f"{expected} ({at('branch 2')})"


def test_cond_inside_scan():
    def f(xs):
        def step(carry, x):
            return carry, lax.switch(x % 3, branches(), jnp.float32(x))

        return lax.scan(step, 0, xs)

    error = checked(f)(jnp.array([3, 6, 4, 5, 8]))[1]
    assert error.get() == f"branch 2 wants x > 10, got 5.0 at iteration 3 ({at('branch 2')})"


def test_checkpoint():
    @jax.checkpoint
    def f(x):
        check(x > 0, "checkpointed {}", x)  # checkpoint
        return jnp.sin(x)

    assert jax.jit(checked(f))(jnp.float32(-2.0))[1].get() == (
        f"checkpointed -2.0 ({at('checkpoint')})"
    )
    grad = jax.grad(lambda x: checked(f)(x)[0])(jnp.float32(1.0))
    np.testing.assert_allclose(grad, np.cos(1.0), rtol=1e-6)


def test_custom_jvp():
    @jax.custom_jvp
    def root(x):
        check(x >= 0, "root of {}", x)  # custom_jvp
        return jnp.sqrt(x)

    root.defjvp(lambda primals, tangents: (root(primals[0]), tangents[0] / 2))

    assert checked(root)(jnp.float32(-4.0))[1].get() == f"root of -4.0 ({at('custom_jvp')})"
    # The derivative still comes from the custom rule.
    assert jax.grad(lambda x: checked(root)(x)[0])(jnp.float32(4.0)) == 0.5
    # Under jit of grad the primal check is still recorded.
    error = checked(jax.jit(jax.grad(root)))(jnp.float32(-1.0))[1]
    assert error.get() == f"root of -1.0 ({at('custom_jvp')})"


def test_nested_jit_called_twice():
    @jax.jit
    def g(y):
        check(y > 0, "jitted {}", y)  # jitted twice
        return y

    def f(x):
        return g(x) + g(x - 1.0)

    assert checked(f)(jnp.float32(2.0))[1].get() is None
    assert checked(f)(jnp.float32(0.5))[1].get() == f"jitted -0.5 ({at('jitted twice')})"


def below_ten(block):
    check(jnp.all(block < 10), "too big: max {}", jnp.max(block))  # shard body
    return block * 2


def test_shard_map_reports_the_mesh_coordinates(mesh42):
    f = jax.shard_map(below_ten, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))
    a = jnp.arange(16.0).reshape(4, 4)
    # Shard (x=i, y=j) holds row i, columns 2j and 2j+1: values 4i+2j, 4i+2j+1.
    # Values >= 10 are on shards (2, 1), (3, 0) and (3, 1); (2, 1) is first in mesh
    # order and holds 10 and 11.
    out, error = jax.jit(checked(f))(a)
    np.testing.assert_array_equal(out, a * 2)
    assert error.get() == f"too big: max 11.0 on shard x=2, y=1 ({at('shard body')})"
    assert checked(f)(a - 6)[1].get() is None


def test_partial_manual_shard_map_reports_the_manual_axes_only(mesh42):
    f = jax.shard_map(below_ten, mesh=mesh42, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
    # Manual over x only: shard x=i holds row i (values 4i..4i+3); rows 2 and 3 fail.
    error = jax.jit(checked(f))(jnp.arange(16.0).reshape(4, 4))[1]
    assert error.get() == f"too big: max 11.0 on shard x=2 ({at('shard body')})"


def test_loop_and_cond_inside_shard_map(mesh42):
    def body(block):
        def step(carry, column):
            column = lax.cond(jnp.max(column) > 100, lambda: -column, lambda: column)
            return carry, below_ten(column)

        return lax.scan(step, 0, block.T)[1].T

    f = jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))
    # Shard (2, 1) holds 10 (column 0) and 11 (column 1): it fails first, at column 0.
    error = jax.jit(checked(f))(jnp.arange(16.0).reshape(4, 4))[1]
    assert error.get() == f"too big: max 10.0 at iteration 0 on shard x=2, y=1 ({at('shard body')})"


def test_shard_map_inside_scan(mesh42):
    f = jax.shard_map(below_ten, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))

    def g(stack):
        return lax.scan(lambda carry, a: (carry, f(a)), 0, stack)

    a = jnp.arange(16.0).reshape(4, 4)
    # At iteration 1 (a - 3), values >= 10 are 13 - 3 (shard (3, 0)) and up.
    error = jax.jit(checked(g))(jnp.stack([a - 10, a - 3, a]))[1]
    assert error.get() == f"too big: max 10.0 at iteration 1 on shard x=3, y=0 ({at('shard body')})"


def test_vmap_inside_checked_reports_the_first_failing_element():
    def f(xs):
        jax.vmap(lambda x: check(x > 0, "element {}", x))(xs)  # vmapped
        return xs

    error = jax.jit(checked(f))(jnp.array([1.0, -2.0, -3.0]))[1]
    assert error.get() == f"element -2.0 at vmap index 1 ({at('vmapped')})"


def test_vmap_of_checked():
    errors = jax.vmap(checked(positive))(jnp.array([2.0, 3.0, -1.0, -5.0]))[1]
    assert errors.failed.shape == (4,)
    assert errors.get() == f"x must be positive, got -1.0 at vmap index 2 ({at('positive')})"


def test_unchecked_control_flow_is_left_as_it_is():
    def f(xs):
        positive(xs[0])
        return lax.scan(lambda c, x: (c + x, c * x), 0.0, xs)

    def scans(fn):
        jaxpr = jax.make_jaxpr(fn)(jnp.ones(3))
        return [e for e in jaxpr.eqns if e.primitive.name == "scan"]

    (plain,) = scans(f)
    (interpreted,) = scans(lambda xs: checked(f)(xs)[0])
    # The same operands and results (carry and stacked outputs): nothing added.
    assert len(interpreted.invars) == len(plain.invars)
    assert len(interpreted.outvars) == len(plain.outvars)


@pytest.mark.parametrize(
    "pred, error, match",
    [
        (
            lambda x: x,
            TypeError,
            r"check\('bad'\) at test_checks.py:\d+: .*boolean scalar, got float32\[\]",
        ),
        (lambda x: x > jnp.zeros(3), ValueError, r"boolean scalar, got bool\[3\].*jnp.all"),
        (lambda x: "yes", TypeError, r"boolean scalar, got str"),
    ],
)
def test_bad_predicate(pred, error, match):
    def f(x):
        check(pred(x), "bad")
        return x

    with pytest.raises(error, match=match):
        checked(f)(jnp.float32(1.0))
    with pytest.raises(error, match=match):  # the same at trace time outside checked
        jax.jit(f)(jnp.float32(1.0))


def test_bad_predicate_names_the_line():
    def f(x):
        check(x, "float predicate")  # bad predicate
        return x

    with pytest.raises(
        TypeError, match=re.escape(f"check('float predicate') at {at('bad predicate')}")
    ):
        checked(f)(jnp.float32(1.0))


@pytest.mark.parametrize(
    "msg, args, match",
    [
        ("{} and {}", (1,), r"field for argument 1 but only 1 fmt_args"),
        ("{name}", (1,), r"named field \{name\}"),
        ("only {}", (1, 2), r"does not use argument 1"),
        ("{:d}", (1.0,), r"Unknown format code 'd'"),
        ("no fields {}", (), r"only 0 fmt_args"),
    ],
)
def test_format_arguments_that_do_not_match_the_message(msg, args, match):
    def f(x):
        check(x > 0, msg, *(x * a for a in args))
        return x

    with pytest.raises(ValueError, match=r"check\(.*\) at test_checks.py:\d+: .*" + match):
        checked(f)(jnp.float32(1.0))


def test_message_must_be_a_string():
    with pytest.raises(TypeError, match=r"msg must be a str, got int"):
        check(True, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["check", "checked"])
def test_docstring_examples_run(name, capsys):
    import textwrap

    import kups.checks

    doc = getattr(kups.checks, name).__doc__
    (example,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    exec(compile(textwrap.dedent(example), f"{name}_example.py", "exec"), {})
    if name == "checked":
        assert capsys.readouterr().out == (
            "negative entry -3.0 at iteration 2 (checked_example.py:8)\n"
        )


def test_loops_carry_only_the_checks_inside_them():
    def program(num_checks):
        def f(xs):
            for i in range(num_checks):
                check(xs[i] > 0, "entry {} is {}", i, xs[i])
            return lax.scan(step_nonnegative, 0.0, xs)

        return f

    def scan_carries(num_checks):
        jaxpr = jax.make_jaxpr(lambda xs: checked(program(num_checks))(xs))(jnp.ones(5))
        (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        return len(scan.outvars)  # the carry and the (fixed) stacked outputs

    assert scan_carries(4) == scan_carries(1)
    error = checked(program(4))(jnp.array([1.0, 2.0, 3.0, 4.0, -5.0]))[1]
    assert error.get() == f"negative entry -5.0 at iteration 4 ({at('scan body')})"
    error = checked(program(4))(jnp.array([1.0, 2.0, -3.0, -4.0, -5.0]))[1]
    assert error.get().startswith("entry 2 is -3.0 (test_checks.py:")


# ---------------------------------------------------------------------------
# Keyword format arguments.
# ---------------------------------------------------------------------------


def test_keyword_format_arguments_take_the_failing_values():
    def f(xs):
        def step(total, x):
            i, value = x
            total = total + value
            check(total < 10, "total {total:.1f} at {i}, step {}", value, total=total, i=i)  # kw
            return total, None

        return lax.scan(step, jnp.float32(0), (jnp.arange(5), xs))[0]

    xs = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], jnp.float32)
    error = jax.jit(checked(f))(xs)[1]
    assert error.get() == f"total 10.0 at 3, step 4.0 at iteration 3 ({at('kw')})"
    assert error.message == "total 10.0 at 3, step 4.0"

    def with_checkify(xs):
        def step(total, x):
            i, value = x
            total = total + value
            checkify.check(total < 10, "total {total:.1f} at {i}, step {}", value, total=total, i=i)
            return total, None

        return lax.scan(step, jnp.float32(0), (jnp.arange(5), xs))[0]

    oracle = jax.jit(checkify.checkify(with_checkify))(xs)[0].get()
    assert oracle.startswith(error.message)


def test_keyword_format_arguments_may_be_pytrees_and_statics():
    def f(x):
        check(jnp.all(x > 0), "{name}: {v[values]}", name="x", v={"values": x})
        return x

    assert checked(f)(jnp.array([1, -2, 3]))[1].message == "x: [ 1 -2  3]"


@pytest.mark.parametrize(
    "msg, args, kwargs, match",
    [
        ("{name}", (), {}, r"named field \{name\} but no keyword argument name="),
        ("{x}", (), {"y": 1.0}, r"no keyword argument x=.*given: y"),
        ("{x}", (), {"x": 1.0, "y": 2.0}, r"no field for keyword argument y"),
        ("{} {x}", (1.0,), {}, r"no keyword argument x="),
    ],
)
def test_keyword_format_arguments_that_do_not_match_the_message(msg, args, kwargs, match):
    def f(x):
        check(x > 0, msg, *(x * a for a in args), **{k: x * v for k, v in kwargs.items()})
        return x

    with pytest.raises(ValueError, match=r"check\(.*\) at test_checks.py:\d+: .*" + match):
        checked(f)(jnp.float32(1.0))


# ---------------------------------------------------------------------------
# Structured fields of Error.
# ---------------------------------------------------------------------------


def test_fields_of_a_passing_error_are_none():
    error = jax.jit(checked(positive))(jnp.float32(1.0))[1]
    fields = (error.message, error.iteration, error.shard, error.source, error.kind)
    assert fields == (None, None, None, None, None)


def test_fields_outside_loops_and_shard_map():
    error = jax.jit(checked(positive))(jnp.float32(-3.0))[1]
    assert error.message == "x must be positive, got -3.0"
    assert error.iteration == () and error.shard is None
    assert error.source == at("positive")
    assert error.kind == "user"


def test_fields_in_nested_loops_and_shard_map(mesh42):
    def body(block):
        def outer(carry, row):
            def inner(state):
                j, total = state
                check(total < 20, "total {total}", total=total)  # nested fields
                return j + 1, total + row[j]

            start = (0, 0.0 * row[0])  # a total that varies over the shards, like row
            return carry, lax.while_loop(lambda s: s[0] < row.shape[0], inner, start)[1]

        return lax.scan(outer, 0, block)[1][:, None]

    f = jax.shard_map(body, mesh=mesh42, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
    # 8 shards of one row of 4 entries, rows k*10: row 1 (shard x=0, y=1) reaches
    # 20 after 2 entries, rows 2 to 7 after 1. The earliest iteration comes first,
    # then the first shard in mesh order: row 2, shard x=1, y=0.
    xs = jnp.repeat(jnp.arange(8.0) * 10, 4).reshape(8, 4)
    _, error = jax.jit(checked(f))(xs)
    assert error.message == "total 20.0"
    assert error.iteration == (0, 1)
    assert error.shard == {"x": 1, "y": 0}
    assert error.source == at("nested fields")
    assert error.get() == (
        f"total 20.0 at iterations 0, 1 (outermost loop first) on shard x=1, y=0 "
        f"({at('nested fields')})"
    )


@pytest.mark.parametrize("field", ["message", "iteration", "shard", "source", "kind"])
def test_reading_a_field_of_a_traced_error_is_a_clear_error(field):
    @jax.jit
    def run(x):
        _, error = checked(positive)(x)
        return getattr(error, field)

    with pytest.raises(TypeError, match=rf"Error\.{field} needs a concrete error.*outside jit"):
        run(jnp.float32(1.0))


def test_fields_of_a_vmapped_error_are_those_of_the_first_failing_element():
    def f(xs):
        return lax.scan(step_nonnegative, 0.0, xs)

    errors = jax.vmap(checked(f))(jnp.array([[1.0, 2.0, 3.0], [1.0, -2.0, 3.0], [-1.0, 2.0, 3.0]]))[
        1
    ]
    assert errors.message == "negative entry -2.0"
    assert errors.iteration == (1,)
    assert errors.get() == f"negative entry -2.0 at vmap index 1 at iteration 1 ({at('scan body')})"


# ---------------------------------------------------------------------------
# errors=: automatic checks, against jax.experimental.checkify.
# ---------------------------------------------------------------------------


def test_check_kind_sets():
    assert float_checks == nan_checks | div_checks
    assert automatic_checks == index_checks | div_checks | nan_checks
    assert all_checks == automatic_checks | user_checks
    sets = [user_checks, index_checks, div_checks, nan_checks]
    assert all(isinstance(s, frozenset) and len(s) == 1 for s in sets)
    assert len(frozenset().union(*sets)) == 4


def gather_at(x, i):
    return x[jnp.stack([i, 0])]  # gather


def dynamic_slice_at(x, i):
    return x[i]  # dynamic_slice


def dynamic_update_at(x, i):
    return lax.dynamic_update_slice(x, jnp.ones(2), (i,))  # dynamic_update_slice


def scatter_at(x, i):
    return x.at[i].add(1.0)  # scatter-add


def subtract_at(x, i):
    return x.at[i].subtract(1.0)  # scatter-sub


def set_at(x, i):
    return x.at[jnp.stack([i, 1])].set(1.0)  # scatter


def integer_floor_divide(x, i):
    return x.astype(jnp.int32) // (i - 2)  # integer division


def float_divide(x, i):
    return x / (i - 2.0)  # float division


def log_of(x, i):
    return jnp.log(x - i)  # log


INDEXING = [
    (gather_at, "gather", "gather"),
    (dynamic_slice_at, "dynamic_slice", "dynamic_slice"),
    (dynamic_update_at, "dynamic_update_slice", "dynamic_update_slice"),
    (scatter_at, "scatter-add", "scatter-add"),
    (set_at, "scatter", "scatter"),
]
EXAMPLES = [
    *(
        (fn, index_checks, checkify.index_checks, 3, 7, name, marker)
        for fn, name, marker in INDEXING
    ),
    (integer_floor_divide, div_checks, checkify.div_checks, 3, 2, "div", "integer division"),
    (float_divide, div_checks, checkify.div_checks, 3, 2, "div", "float division"),
    (log_of, nan_checks, checkify.nan_checks, 0, 6, "log", "log"),
]


def test_scatter_sub_is_checked_as_scatter_add():
    # checkify has no index check for `x.at[i].subtract` (scatter-sub): kups checks
    # it as the other scatters, so the oracle is `x.at[i].add`'s verdict.
    x = jnp.arange(5.0)
    sub = jax.jit(checked(subtract_at, errors=index_checks))
    add = jax.jit(checked(scatter_at, errors=index_checks))
    for i in range(-8, 10):
        out, error = sub(x, jnp.int32(i))
        np.testing.assert_array_equal(out, subtract_at(x, jnp.int32(i)))
        assert (error.get() is None) == (add(x, jnp.int32(i))[1].get() is None), i
    assert "'scatter-sub'" in error.message and error.source == at("scatter-sub")
    # The other effects count and watch it as the plain primitive it is.
    counts = count_primitives(subtract_at)(x, jnp.int32(1))[1]
    assert counts["scatter-sub"] == 1
    assert not find_nans(subtract_at)(x, jnp.int32(1))[1].found


@pytest.mark.parametrize(
    "fn, errors, oracle_errors, good, bad, primitive, marker",
    EXAMPLES,
    ids=[example[-1] for example in EXAMPLES],
)
def test_automatic_checks_find_what_checkify_finds(
    fn, errors, oracle_errors, good, bad, primitive, marker
):
    x = jnp.arange(5.0)
    run = jax.jit(checked(fn, errors=errors))
    oracle = jax.jit(checkify.checkify(fn, errors=oracle_errors))
    for i, fails in [(good, False), (bad, True)]:
        out, error = run(x, jnp.int32(i))
        oracle_error, oracle_out = oracle(x, jnp.int32(i))
        np.testing.assert_array_equal(out, oracle_out)  # the program is the same
        assert (oracle_error.get() is not None) == fails
        assert (error.get() is not None) == fails
    assert error.kind == next(iter(errors))
    assert error.source == at(marker)
    assert f"'{primitive}'" in error.message
    # Without the kind asked for, nothing is checked.
    assert jax.jit(checked(fn))(x, jnp.int32(bad))[1].get() is None
    # The same verdict as checkify's on every argument around the bounds.
    for i in range(-8, 10):
        out, error = run(x, jnp.int32(i))
        oracle_error, oracle_out = oracle(x, jnp.int32(i))
        np.testing.assert_array_equal(out, oracle_out)
        assert (error.get() is None) == (oracle_error.get() is None), i


@pytest.mark.parametrize(
    "fn, i, message",
    [
        (
            dynamic_slice_at,
            7,
            "out-of-bounds index 7 on axis 0 of an operand of shape (5,) in "
            "'dynamic_slice' (in bounds: 0 to 4)",
        ),
        (
            dynamic_slice_at,
            -6,
            "out-of-bounds index -1 on axis 0 of an operand of shape (5,) in "
            "'dynamic_slice' (in bounds: 0 to 4)",
        ),
        (
            dynamic_update_at,
            4,
            "out-of-bounds index 4 on axis 0 of an operand of shape (5,) in "
            "'dynamic_update_slice' (in bounds: 0 to 3)",
        ),
        (
            set_at,
            5,
            "out-of-bounds index 5 on axis 0 of an operand of shape (5,) in 'scatter' "
            "(in bounds: 0 to 4)",
        ),
    ],
)
def test_out_of_bounds_messages(fn, i, message):
    error = checked(fn, errors=index_checks)(jnp.arange(5.0), jnp.int32(i))[1]
    assert error.message == message


def test_gather_with_several_index_axes_reports_the_first_bad_entry():
    def f(x, rows, cols):
        return x[rows, cols]  # two index axes

    x = jnp.zeros((3, 4))
    ok = checked(f, errors=index_checks)(x, jnp.array([0, 2, 1]), jnp.array([3, 0, 1]))[1]
    assert ok.get() is None
    error = checked(f, errors=index_checks)(x, jnp.array([0, 2, 1]), jnp.array([3, 9, 1]))[1]
    assert error.message == (
        "out-of-bounds index 9 on axis 1 of an operand of shape (3, 4) in 'gather' "
        "(in bounds: 0 to 3)"
    )
    oracle = checkify.checkify(f, errors=checkify.index_checks)
    assert oracle(x, jnp.array([0, 2, 1]), jnp.array([3, 9, 1]))[0].get() is not None


def test_division_by_zero_names_the_element():
    error = checked(lambda x, y: x // y, errors=div_checks)(jnp.arange(4), jnp.array([1, 2, 0, 0]))[
        1
    ]
    assert error.message == "division by zero in 'div' (divisor element [2])"
    assert error.source.startswith("test_checks.py:")  # inside jnp's jitted floor_divide


@pytest.mark.parametrize("large", [False, True])
def test_the_failing_element_of_an_array_too_large_for_int32_positions(monkeypatch, large):
    # Arrays of 2**31 elements or more are found axis by axis, not by an int32
    # position: the threshold is lowered here so that small arrays take that path.
    if large:
        monkeypatch.setattr("kups.checks._first._MAX_SIZE", 4)
        first, flat = first_true(jnp.zeros((2, 3), bool).at[1, 0].set(True))
        assert flat is None and first.tolist() == [1, 0]

    def take(x, rows, cols):
        return x[rows, cols]  # two index axes

    x = jnp.zeros((3, 4))
    error = checked(take, errors=index_checks)(x, jnp.array([0, 2, 1]), jnp.array([3, 9, 1]))[1]
    assert error.message == (
        "out-of-bounds index 9 on axis 1 of an operand of shape (3, 4) in 'gather' "
        "(in bounds: 0 to 3)"
    )
    divisors = jnp.ones((2, 3, 4), jnp.int32).at[1, 2, 0].set(0).at[1, 2, 3].set(0)
    error = jax.jit(checked(lambda a, b: a // b, errors=div_checks))(divisors, divisors)[1]
    assert error.message == "division by zero in 'div' (divisor element [1 2 0])"

    def each(xs):
        jax.vmap(jax.vmap(lambda x: check(x > 0, "element {}", x)))(xs)
        return xs

    xs = jnp.ones((3, 2)).at[1, 1].set(-2.0).at[2, 0].set(-3.0)
    error = jax.jit(checked(each))(xs)[1]
    assert error.message == "element -2.0"
    assert error.get().startswith("element -2.0 at vmap index (1, 1)")


def test_nan_made_from_nan_free_inputs_only():
    # The NaN is made by `sqrt`, then spreads through `mul` and `add`: only the
    # first is reported (checkify reports the same one).
    def f(x):
        y = jnp.sqrt(x)  # made here
        return y * 2.0 + 1.0

    x = jnp.array([4.0, -1.0])
    error = jax.jit(checked(f, errors=nan_checks))(x)[1]
    assert error.message == "'sqrt' produced a NaN from inputs without NaN"
    assert error.source == at("made here")
    oracle = jax.jit(checkify.checkify(f, errors=checkify.nan_checks))(x)[0]
    assert "sqrt" in oracle.get()
    # A NaN the program is given is not one it made. (checkify reports the first
    # operation that reads it.)
    assert checked(f, errors=nan_checks)(jnp.array([4.0, jnp.nan]))[1].get() is None
    assert jax.jit(checkify.checkify(f, errors=checkify.nan_checks))(x.at[1].set(jnp.nan))[0].get()


def test_nan_checks_skip_integers_and_keys():
    def f(x, key):
        return x // 2, jax.random.normal(key, (3,))

    error = checked(f, errors=nan_checks)(jnp.arange(4), jax.random.key(0))[1]
    assert error.get() is None


def test_float_checks_find_division_by_zero_and_nan():
    def f(x, y):
        return jnp.log(x) / y

    run = checked(f, errors=float_checks)
    assert run(jnp.float32(-1.0), jnp.float32(0.0))[1].kind == "nan"  # log runs first
    assert run(jnp.float32(1.0), jnp.float32(0.0))[1].kind == "div"
    assert run(jnp.float32(1.0), jnp.float32(2.0))[1].get() is None


def test_automatic_checks_through_scan_while_cond_and_jit():
    @jax.jit
    def pick(x, i):
        return lax.cond(i % 2 == 0, lambda: x[i], lambda: -x[i])  # picked

    def f(x, idx):
        def outer(carry, i):
            def inner(state):
                j, total = state
                return j + 1, total + pick(x, i + j)

            return carry, lax.while_loop(lambda s: s[0] < 2, inner, (0, 0.0))[1]

        return lax.scan(outer, 0, idx)

    x, idx = jnp.arange(5.0), jnp.array([0, 2, 4, 1])
    error = jax.jit(checked(f, errors=index_checks))(x, idx)[1]
    # idx 4, second inner step: x[5].
    assert error.iteration == (2, 1)
    assert error.source == at("picked")
    assert error.kind == "index"
    assert "index 5 on axis 0" in error.message
    oracle_error = jax.jit(checkify.checkify(f, errors=checkify.index_checks))(x, idx)[0]
    assert oracle_error.get() is not None
    assert jax.jit(checked(f, errors=index_checks))(x, idx[:2])[1].get() is None


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_automatic_checks_inside_shard_map(axis_type):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)

    def body(block):
        return jnp.log(block)  # shard log

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
    a = jnp.arange(1.0, 17.0).reshape(4, 4).at[2, 3].set(-1.0).at[3, 0].set(-2.0)
    a = jax.device_put(a, NamedSharding(mesh, P("x", "y")))
    error = jax.jit(checked(f, errors=nan_checks))(a)[1]
    assert error.shard == {"x": 2, "y": 1}
    assert error.source == at("shard log")
    assert jax.jit(checked(f, errors=nan_checks))(jnp.abs(a))[1].get() is None
    if axis_type == AxisType.Auto:  # checkify fails on Explicit axes (its error record's
        # gather asks for an out_sharding, JAX 0.10.2 and 0.12)
        oracle = jax.jit(checkify.checkify(f, errors=checkify.nan_checks))(a)[0]
        assert oracle.get() is not None


def test_first_failure_in_order_between_automatic_and_user_checks():
    def f(x, i):
        check(i < 10, "i is {}", i)  # user first
        y = x[i]
        check(y > 0, "y is {}", y)  # user second
        return y

    run = checked(f, errors=all_checks)
    assert run(jnp.arange(5.0), jnp.int32(12))[1].message == "i is 12"
    assert run(jnp.arange(5.0), jnp.int32(7))[1].kind == "index"
    assert run(jnp.arange(5.0), jnp.int32(0))[1].source == at("user second")


def test_without_user_checks_a_check_is_left_for_an_outer_checked():
    def f(x):
        check(x > 0, "x is {}", x)  # left in
        return jnp.log(x)

    inner = checked(f, errors=nan_checks)
    assert inner(jnp.float32(-1.0))[1].kind == "nan"
    outer = checked(lambda x: inner(x)[0])
    assert outer(jnp.float32(-1.0))[1].source == at("left in")


def test_default_errors_leave_the_program_as_it_is():
    def f(x, i):
        return jnp.log(x[i] / x[i - 1]) + x.at[i].set(0.0).sum()

    def primitives(fn):
        return [e.primitive.name for e in jax.make_jaxpr(fn)(jnp.arange(5.0), 2).eqns]

    assert primitives(lambda x, i: checked(f)(x, i)[0]) == primitives(f)
    assert len(primitives(lambda x, i: checked(f, errors=all_checks)(x, i)[0])) > len(primitives(f))


@pytest.mark.parametrize(
    "errors, exception, match",
    [
        ("nan", TypeError, r"frozenset of check kinds"),
        (["nan"], TypeError, r"frozenset of check kinds"),
        (frozenset({"nans"}), ValueError, r"unknown check kinds \['nans'\]"),
    ],
)
def test_bad_errors_argument(errors, exception, match):
    with pytest.raises(exception, match=match):
        checked(positive, errors=errors)


# ---------------------------------------------------------------------------
# shard_map on multi-axis meshes, and the reduction between shards.
# ---------------------------------------------------------------------------


def rows_below_ten(block):
    def step(carry, row):
        check(jnp.all(row < 10), "row max {m} at {c}", m=jnp.max(row), c=carry)  # row check
        return carry + 1, row * 2

    return lax.scan(step, 0, block)[1]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize(
    "options",
    [{}, {"axis_names": frozenset({"x"})}, {"check_vma": False}],
    ids=["full", "partial-manual", "no-check-vma"],
)
def test_check_varying_over_some_mesh_axes(axis_type, options):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)
    f = jax.shard_map(rows_below_ten, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **options)
    # Shard x=i holds rows 2i, 2i+1 of values 0..31 (4 per row): row 2 (values
    # 8..11) on x=1 is the first over 10, at its iteration 0; every y holds it.
    a = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
    out, error = jax.jit(checked(f))(a)
    np.testing.assert_array_equal(out, 2 * jnp.arange(32.0).reshape(8, 4))
    assert error.message == "row max 11.0 at 0"
    assert error.iteration == (0,)
    assert error.shard == ({"x": 1} if "axis_names" in options else {"x": 1, "y": 0})
    assert error.source == at("row check")
    assert jax.jit(checked(f))(a - 30)[1].get() is None


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_nested_shard_maps_over_different_axes(axis_type):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)
    # The inner shard_map takes the mesh of its context, where x is already manual.
    inner = jax.shard_map(
        rows_below_ten, in_specs=P(None, "y"), out_specs=P(None, "y"), axis_names={"y"}
    )

    def outer(block):
        if axis_type == AxisType.Explicit:  # JAX 0.12 wants the sharding in_specs names
            block = jax.sharding.reshard(block, P(None, "y"))
        return inner(block)

    f = jax.shard_map(outer, mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
    a = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(jax.jit(checked(f))(a)[0], jax.jit(f)(a))
    # Shard (x=1, y=0) holds rows 2, 3 and columns 0, 1: values 8, 9 then 12, 13,
    # failing in its iteration 1; (x=1, y=1) fails earlier, in its iteration 0: the
    # earliest iteration comes first, before mesh order.
    error = jax.jit(checked(f))(a)[1]
    assert (error.message, error.shard) == ("row max 11.0 at 0", {"x": 1, "y": 1})


def test_the_shards_failures_are_combined_in_one_collective(mesh42):
    f = jax.shard_map(below_ten, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))
    compiled = jax.jit(checked(f)).lower(jnp.arange(16.0).reshape(4, 4)).compile().as_text()
    collectives = re.findall(
        r" (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(-start)?\(",
        compiled,
    )
    assert len(collectives) == 1
    # The same report as test_shard_map_reports_the_mesh_coordinates.
    error = jax.jit(checked(f))(jnp.arange(16.0).reshape(4, 4))[1]
    assert error.get() == f"too big: max 11.0 on shard x=2, y=1 ({at('shard body')})"


@pytest.mark.parametrize(
    "dtype",
    [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int8, jnp.uint32, jnp.bool_, jnp.complex64],
)
def test_format_values_of_every_dtype_cross_the_shards_exactly(mesh8, dtype):
    def body(block):
        value = block.astype(dtype)
        check(jnp.all(block < 5), "value {v} of {n}", v=value, n=-block[0])
        return block

    f = jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))
    values = jnp.array([0, 1, 2, 3, 6, 7, 5, 4], jnp.float32) * 1.25
    error = jax.jit(checked(f))(values)[1]
    # Shard 4 (6 * 1.25 = 7.5) is the first with a value >= 5.
    assert error.shard == {"i": 4}
    assert error.message == f"value {np.asarray(values[4:5]).astype(dtype)} of -7.5"


def test_several_failing_shards_report_the_first_in_mesh_order(mesh8):
    def body(block):
        check(jnp.all(block >= 0), "negative {v}", v=jnp.min(block))
        return block

    f = jax.shard_map(body, mesh=mesh8, in_specs=P("i"), out_specs=P("i"))
    for failing in [(7,), (3, 5), (0, 6, 7), (2, 3, 4, 5, 6)]:
        values = jnp.arange(8.0).at[jnp.array(failing)].set(-1.0 - jnp.array(failing))
        error = jax.jit(checked(f))(values)[1]
        assert (error.shard, error.message) == ({"i": failing[0]}, f"negative {-1.0 - failing[0]}")


def test_automatic_check_in_a_while_condition():
    def f(x, n):
        return lax.while_loop(lambda i: (x[i] < n) & (i < 6), lambda i: i + 1, 0)  # condition

    x = jnp.arange(5.0)
    run = jax.jit(checked(f, errors=index_checks))
    oracle = jax.jit(checkify.checkify(f, errors=checkify.index_checks))
    assert run(x, 3.0)[1].get() is None
    assert oracle(x, 3.0)[0].get() is None
    # x[5] is read by the condition after 5 iterations (JAX clamps it to x[4]).
    error = run(x, 4.5)[1]
    assert (error.iteration, error.source) == ((5,), at("condition"))
    assert oracle(x, 4.5)[0].get() is not None


def _many_checks(n):
    """A scan whose body has `n` user checks (one site each) and `n` NaN-checked
    operations; the barrier keeps XLA from fusing the operations together."""

    def step(y, _):
        for _ in range(n):
            y = lax.optimization_barrier(jnp.sin(y) * 1.01)
            check(jnp.all(y < 10), "y={}", y)
        return y, None

    return lambda y: lax.scan(step, y, None, length=3)[0]


def test_a_loop_carries_one_error_record_however_many_checks_its_body_has():
    x = jnp.ones(3)
    carries = []
    for n in (10, 40):
        jaxpr = jax.make_jaxpr(checked(_many_checks(n), errors=all_checks))(x)
        (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
        carries.append(len(scan.outvars))
    # y, the iteration counter, the flag, the failing site's code, its iterations
    # and one payload buffer (every site's format argument is an f32[3]).
    assert carries == [6, 6]


def test_the_compiled_checks_grow_linearly_with_their_number():
    """Compiled code, not time: a record update that XLA expands with the chain of
    every earlier check's flag grew quadratically (a numpyro SVI step under
    nan_checks compiled for minutes)."""
    lines = []
    for n in (10, 40):
        compiled = jax.jit(checked(_many_checks(n), errors=all_checks)).lower(jnp.ones(3)).compile()
        lines.append(compiled.as_text().count("\n"))
    # Linear is 4; the quadratic expansion made it 10-14.
    assert lines[1] / lines[0] < 8, lines


def test_the_first_failure_among_many_checks_of_a_loop_body():
    def f(y):
        def step(y, _):
            for k in range(12):
                y = y + 1.0
                check(y < 7 + k, "check {k}: y={y}", k=k, y=y)
            return y, None

        return lax.scan(step, y, None, length=3)[0]

    _, error = jax.jit(checked(f))(jnp.float32(0.0))
    # Iteration 0: y runs 1..12 against bounds 7..18, always below; iteration 1:
    # y = 13 + k against 7 + k fails at the first check.
    assert (error.message, error.iteration) == ("check 0: y=13.0", (1,))


def test_nan_checks_leave_effects_alone():
    from kups.harvest import reap, sow

    def f(x):
        return sow(jnp.log(x), tag="t", name="y") + 1.0  # sown log

    (out, error), reaped = reap(checked(f, errors=nan_checks), tag="t")(jnp.float32(-1.0))
    assert jnp.isnan(out) and jnp.isnan(reaped["y"])
    assert error.source == at("sown log") and "'log'" in error.message
    assert len(error.record.layout.sites) == 2  # log and add; not the sow


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16, jnp.uint32])
def test_small_index_dtypes_against_a_long_axis(dtype):
    def f(x, i):
        return lax.dynamic_slice(x, (i,), (2,))

    # The largest in-bounds start, 298, may not fit the index dtype: every index of
    # that dtype is then in bounds from above.
    x = jnp.arange(300.0)
    run = checked(f, errors=index_checks)
    top = min(int(np.iinfo(dtype).max), 298)
    assert run(x, jnp.asarray(top, dtype))[1].get() is None
    if top == 298:
        assert run(x, jnp.asarray(299, dtype))[1].message.startswith("out-of-bounds index 299")


def test_no_kinds_checks_nothing():
    def f(x, i):
        check(x[0] > 0, "x[0] is {}", x[0])
        return jnp.log(x[i] - 10.0) // 0.0

    out, error = jax.jit(checked(f, errors=frozenset()))(-jnp.ones(3), 7)
    assert jnp.isnan(out) and error.get() is None and error.record.layout.sites == ()
    assert checked(f, errors={"user"})(-jnp.ones(3), 7)[1].message == "x[0] is -1.0"


def test_a_check_in_a_function_a_library_primitive_holds_is_not_lost_silently():
    from kups.effects import InterpreterPolicy
    from library_primitive import library_fn_call

    def f(x):
        (y,) = library_fn_call(lambda v: (check(v > 0, "held") or v * 2,), x)
        return y

    for wrapped in (checked(f), jax.jit(checked(f))):
        with pytest.raises(NotImplementedError, match=r"'check'.*'library_fn_call'.*checked\(fn"):
            wrapped(jnp.float32(1.0))
    out, error = jax.jit(checked(f, policy=InterpreterPolicy.IGNORE))(jnp.float32(-1.0))
    assert out == -2.0 and error.get() is None


def test_policy_for_a_library_primitive_hiding_a_check():
    from kups.effects import InterpreterPolicy
    from library_primitive import library_call

    def f(x):
        (hidden,) = library_call(lambda v: (check(v > 0, "hidden"), v * 2)[1], x)
        check(x > 0, "outside {}", x)
        return hidden

    # The message names the remedy an effect's user has: checked's own policy=.
    match = r"library_call.*Pass policy=InterpreterPolicy\.IGNORE to checked\(fn, policy=\.\.\.\)"
    with pytest.raises(NotImplementedError, match=match):
        checked(f)(jnp.float32(1.0))
    out, error = checked(f, policy=InterpreterPolicy.IGNORE)(jnp.float32(-1.0))
    assert out == -2.0 and error.message == "outside -1.0"
    with pytest.raises(TypeError, match="InterpreterPolicy"):
        checked(f, policy="ignore")


def test_an_earlier_check_on_a_later_shard_comes_first(mesh42):
    """Program order before mesh order: shard 5 fails the first check, shard 2 the
    second; shard 5's failure is the first."""

    def body(block):
        index = lax.axis_index("x") * 2 + lax.axis_index("y")
        check(index != 5, "first check on shard {}", index)  # first of two
        check(index != 2, "second check on shard {}", index)
        return block

    f = jax.shard_map(body, mesh=mesh42, in_specs=P("x", "y"), out_specs=P("x", "y"))
    _, error = jax.jit(checked(f))(jnp.zeros((8, 4)))
    assert (error.message, error.shard, error.source) == (
        "first check on shard 5",
        {"x": 2, "y": 1},
        at("first of two"),
    )
    assert error.iteration == () and error.primitive == "check"


def test_a_jitted_checked_function_exports_serializes_and_runs():
    def f(xs):
        def step(carry, x):
            check(x < 3, "x={x} at {where}", x=x, where="step")  # exported
            return carry + x, None

        return lax.scan(step, 0.0, xs)[0]

    xs = jnp.arange(5.0)
    exported = jax.export.export(jax.jit(checked(f, errors=user_checks | div_checks)))(xs)
    restored = jax.export.deserialize(exported.serialize())
    out, error = restored.call(xs)
    expected_out, expected = jax.jit(checked(f, errors=user_checks | div_checks))(xs)
    assert out == expected_out == f(xs)
    assert error.get() == expected.get() == f"x=3.0 at step at iteration 3 ({at('exported')})"
    out, error = jax.jit(restored.call)(jnp.zeros(5))
    assert error.get() is None and out == 0.0


def test_automatic_messages_inside_shard_map_say_the_index_is_the_shards(mesh42):
    def body(numerator, divisor):
        return numerator // divisor, numerator[divisor[0, 0] + 1]

    f = jax.shard_map(
        body,
        mesh=mesh42,
        in_specs=(P("x", "y"), P("x", "y")),
        out_specs=(P("x", "y"), P(("x", "y"))),
    )
    numerator = jnp.arange(32).reshape(8, 4)
    divisor = jnp.ones((8, 4), jnp.int32).at[5, 2].set(0)
    _, error = jax.jit(checked(f, errors=div_checks))(numerator, divisor)
    # Global element (5, 2) is element (1, 0) of shard x=2, y=1's (2, 2) block.
    assert (
        error.message == "division by zero in 'div' (divisor element [1 0] of this shard's block)"
    )
    assert error.shard == {"x": 2, "y": 1} and error.primitive == "div"
    _, error = jax.jit(checked(f, errors=index_checks))(numerator, divisor + 1)
    assert error.message.startswith(
        "out-of-bounds index 3 on axis 0 of an operand of shape (2, 2) of this shard's block"
    )
    # Outside shard_map the message says nothing of shards.
    _, error = checked(lambda a, b: a // b, errors=div_checks)(numerator, divisor)
    assert error.message == "division by zero in 'div' (divisor element [5 2])"


def not_an_array(x):  # returns a string
    return "not an array"


def test_a_jitted_checked_function_with_a_bad_output_names_the_users_file():
    with pytest.raises(TypeError) as plain:
        jax.jit(not_an_array)(1.0)
    with pytest.raises(TypeError) as wrapped:
        jax.jit(checked(not_an_array))(1.0)
    where = f"function not_an_array at {__file__}:{_SOURCE.index('def not_an_array(x):  # returns a string') + 1}"
    assert str(plain.value).startswith(where)
    assert str(wrapped.value).startswith(where)
    assert "traceback_util" not in str(wrapped.value)
    # The wrapper still looks like the function, with its signature.
    assert checked(not_an_array).__name__ == "not_an_array"
    assert str(inspect.signature(checked(not_an_array))) == "(x)"
