"""`checked`: the entry point that runs a function with its checks recorded."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import jax.numpy as jnp

from kups.effects import (
    Dispatcher,
    Interpreter,
    InterpreterPolicy,
    Position,
    check_policy,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reinterpret,
    skip_when_untouched,
    stage_eagerly,
    track_position,
    wraps_with_leading,
)

from ._automatic import all_checks, automatic_checks, user_checks
from ._check import _check_p
from ._error import Error, _Record
from ._handlers import (
    _automatic_handler,
    _check_handler,
    _Ctx,
    _first_failing_shard,
    _scoped,
    _with_sites,
)

Params = ParamSpec("Params")
Out = TypeVar("Out")


def _dispatcher(kinds: frozenset[str]) -> Dispatcher:
    dispatcher = default_dispatcher()
    handlers = {
        **dispatcher.handlers,
        "scan": _with_sites(default_scan_handler),
        "while": _with_sites(default_while_handler),
        "cond": _with_sites(default_cond_handler),
        "shard_map": default_shard_map_handler,
    }
    for name, handler in handlers.items():
        tracked = track_position(handler)
        if name == "shard_map":
            tracked = functools.partial(tracked, reduce_ctx=_first_failing_shard)
        # Control flow with no check inside is re-bound whole (see `_scoped`).
        dispatcher.register_handler(name, skip_when_untouched(_scoped(tracked)))
    if kinds & automatic_checks:
        dispatcher.register_fallback_handler(_automatic_handler)
    # Without user_checks, a `check` stays in the program as it is, for an
    # enclosing `checked` to record.
    check_handler = _check_handler if "user" in kinds else default_primitive_handler
    return dispatcher.register_handler(_check_p, check_handler)


def _kinds(errors: Any) -> frozenset[str]:
    if isinstance(errors, str) or not isinstance(errors, (set, frozenset)):
        raise TypeError(
            f"checked(fn, errors=...) takes a frozenset of check kinds, such as "
            f"kups.checks.user_checks or index_checks | div_checks; got "
            f"{type(errors).__name__}: {errors!r}."
        )
    unknown = set(errors) - all_checks
    if unknown:
        raise ValueError(
            f"checked(fn, errors=...): unknown check kinds {sorted(map(str, unknown))}; the "
            f"kinds are {sorted(all_checks)} (combine the sets user_checks, index_checks, "
            f"div_checks, nan_checks, float_checks, automatic_checks, all_checks with |)."
        )
    return frozenset(errors)


def checked(
    fn: Callable[Params, Out],
    *,
    errors: frozenset[str] = user_checks,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[Params, tuple[Out, Error]]:
    """Runs `fn` with its checks recorded, and returns the first failure.

    The checks anywhere in `fn` (also inside `jit`, `scan`, `fori_loop`,
    `while_loop`, `cond`/`switch`, `jax.checkpoint`, `custom_jvp`/`custom_vjp`
    and `shard_map`) are evaluated as part of the program. The wrapped function
    can itself be jitted, with the `Error` returned from the jitted function.

    `errors` says what to check: the user's `check`s (`user_checks`, the
    default) and automatic checks of the program's own operations:

    - `index_checks`: an out-of-bounds index in `gather`, `scatter*`,
      `dynamic_slice` or `dynamic_update_slice`, which JAX would clamp, fill or
      drop silently (`x[i]`, `x.at[i].set(v)`, `jnp.take`, ...). Intended
      out-of-bounds reads (`mode="fill"`) are reported too.
    - `div_checks`: a zero divisor in `div` or `rem` (`//`, `%`, `/`), of any
      dtype, also where a `jnp.where` discards the result.
    - `nan_checks`: an operation whose output holds a NaN while its inputs hold
      none: the place a NaN is made, not where it spreads.
    - `float_checks = nan_checks | div_checks`,
      `automatic_checks = index_checks | div_checks | nan_checks` (as in
      `jax.experimental.checkify`), `all_checks = automatic_checks | user_checks`.

    An automatic check reports the primitive in its message, and its iteration,
    shard and source line like a `check`. With the default `errors=user_checks`,
    the program compiles as it would with checks alone.

    Where a failure happened: the iteration of each enclosing `scan` or
    `while_loop` (0-based, the number of iterations done before it; with
    `scan(reverse=True)` the index of the `xs` entry, like the stacked outputs),
    and inside `shard_map` the coordinates of the shard on the manual mesh axes.
    When several shards fail, the first one in mesh order is reported.

    **Arguments:**

    - `fn`: the function to run. Arguments that are not arrays are static, as in
      `equinox.filter_jit`.
    - `errors`: a frozenset of check kinds, such as `user_checks`,
      `index_checks | div_checks` or `all_checks`.
    - `policy`: what to do with a control-flow primitive kups has no handler for
      (a library's own, holding a jaxpr) when a check inside it would be lost:
      `InterpreterPolicy.RAISE` (the default) raises, `WARN` warns and runs it
      unchecked, `IGNORE` runs it unchecked.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, error)`: `fn`'s output and an `Error`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.checks import CheckFailed, check, checked, index_checks, user_checks


    def cumulative(xs):
        def step(total, x):
            check(x >= 0, "negative entry {}", x)
            return total + x, total

        return jax.lax.scan(step, 0.0, xs)[0]


    total, error = jax.jit(checked(cumulative))(jnp.array([1.0, 2.0, -3.0]))
    assert error.get().startswith("negative entry -3.0 at iteration 2")
    try:
        error.throw()
    except CheckFailed as failure:
        print(failure)  # negative entry -3.0 at iteration 2 (example.py:8)

    _, error = checked(lambda x, i: x[i], errors=index_checks | user_checks)(jnp.zeros(3), 5)
    assert error.kind == "index" and error.message.startswith("out-of-bounds index 5")
    ```
    """
    if not callable(fn):
        raise TypeError(f"checked(fn) needs a callable, got {type(fn).__name__}: {fn!r}.")
    kinds = _kinds(errors)
    check_policy(policy, "checked(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Params.args, **kwargs: Params.kwargs) -> tuple[Out, Error]:
        interpreter = Interpreter(
            _dispatcher(kinds),
            policy=policy,
            label="kups.checks",
            policy_hint="checked(fn, policy=...)",
        )
        ctx = _Ctx(
            failed=jnp.zeros((), jnp.bool_),
            record=_Record.empty(),
            position=Position(),
            kinds=kinds,
        )
        out, ctx = reinterpret(fn, interpreter)(ctx, *args, **kwargs)
        return out, Error(failed=ctx.failed, record=ctx.record)

    return stage_eagerly(wrapped)
