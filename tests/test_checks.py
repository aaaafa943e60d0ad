"""`kups.checks`: `check` recorded through jit, loops, cond, shard_map; `Error` readout."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from kups.checks import CheckFailed, Error, check, checked

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
