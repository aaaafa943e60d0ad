"""`count_primitives`: how many times each primitive of a program ran, counted by
the machinery of `_tally` with a primitive's name as the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend.core import JaxprEqn

from kups.effects import InterpreterPolicy, check_policy, stage_eagerly, wraps_with_leading

from ._counts import PrimitiveCounts
from ._tally import count_executions


def primitive_name(eqn: JaxprEqn) -> str:
    """The key of `count_primitives`: the name of the equation's primitive."""
    return eqn.primitive.name


def count_primitives(
    fn: Callable[..., Any], *, policy: InterpreterPolicy = InterpreterPolicy.RAISE
) -> Callable[..., tuple[Any, PrimitiveCounts]]:
    """Wraps `fn` so that it also returns how many times each primitive ran.

    Only what runs is counted, as often as it runs: a `scan` body counts `length`
    times, a `while_loop` body its trip count and its condition one time more,
    a `cond`/`switch` only its taken branch, a `shard_map` body once per shard of
    its manual mesh axes (summed over the shards). Control-flow primitives (`jit`,
    `scan`, `while`, `cond`, `shard_map`, `checkpoint`, `custom_jvp_call`, ...)
    are not counted themselves, only what they run.

    A primitive that could have run but did not (in a branch not taken, a loop
    that ran zero times) is listed with count 0. Counts are `int32`: a primitive
    that runs more than `2**31 - 1` times overflows.

    A control-flow primitive that kups has no handler for (a library's own, such
    as lineax's `linear_solve` or an equinox filter primitive) is opaque: kups
    cannot see what it runs; so is a library primitive that holds Python
    functions rather than jaxprs. `policy` says what happens then.

    **Arguments:**

    - `fn`: the function to count. Its arguments are pytrees; leaves that are not
      arrays are static.
    - `policy`: for opaque control flow. `InterpreterPolicy.RAISE` (the default)
      raises `NotImplementedError` naming the primitive and its source line;
      `WARN` warns, runs it unchanged and reports it; `IGNORE` runs it unchanged
      and reports it. A reported call is listed in `counts.opaque` (with how many
      times it ran, by the rules above), and what it runs is not in the counts.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, counts)`, where `out` is `fn(*args,
    **kwargs)` and `counts` a `PrimitiveCounts`, a `dict` from primitive name to
    count, in name order. Called eagerly the counts are Python `int`s; under
    `jax.jit` (or another transformation) of `wrapped` they are `int32` arrays.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.instrument import count_primitives


    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.sin(x), x)


    out, counts = count_primitives(f)(jnp.array(1.0))
    assert counts == {"add": 3, "sin": 3}  # the loop index is incremented each time
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"count_primitives(fn) needs a callable fn, got {type(fn).__name__}. Pass the "
            f"function itself, not its result: count_primitives(f)(x)."
        )
    check_policy(policy, "count_primitives(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PrimitiveCounts]:
        out, tally = count_executions(
            fn, args, kwargs, key_of=primitive_name, policy=policy, label="count_primitives"
        )
        return out, PrimitiveCounts(
            sorted(tally.counts.items()), opaque=dict(sorted(tally.opaque.items()))
        )

    return stage_eagerly(wrapped, finish=_concrete)


def _concrete(result: tuple[Any, PrimitiveCounts]) -> tuple[Any, PrimitiveCounts]:
    """The counts of a compiled eager call as Python `int`s, as eagerly."""
    out, counts = result
    return out, PrimitiveCounts(
        {name: int(count) for name, count in counts.items()},
        opaque={name: int(count) for name, count in counts.opaque.items()},
    )
