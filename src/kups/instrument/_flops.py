"""`count_flops`: FLOPs, transcendentals and bytes a program ran, counted by the
machinery of `_tally` with an equation's name and cost as the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend.core import JaxprEqn

from kups.effects import (
    InterpreterPolicy,
    check_policy,
    is_effect,
    stage_eagerly,
    wraps_with_leading,
)

from ._cost import Cost, CostKey
from ._cost_model import equation_cost
from ._tally import count_executions


def cost_key(eqn: JaxprEqn) -> CostKey:
    """The key of `count_flops`: the primitive's name and the cost of one execution
    (equations of the same name and cost share a count)."""
    if is_effect(eqn.primitive):
        # A sow or a check: an identity the compiled program does not hold.
        return (eqn.primitive.name, 0, 0, 0)
    flops, transcendentals, bytes_accessed = equation_cost(eqn)
    return (eqn.primitive.name, flops, transcendentals, bytes_accessed)


def count_flops(
    fn: Callable[..., Any], *, policy: InterpreterPolicy = InterpreterPolicy.RAISE
) -> Callable[..., tuple[Any, Cost]]:
    """Wraps `fn` so that it also returns the FLOPs, transcendentals and bytes it ran.

    Totals of what actually executed: a `scan` body counts `length` times, a
    `while_loop` body its dynamic trip count (its condition one time more), a
    `cond`/`switch` only its taken branch, a `checkpoint` under `jax.grad` its
    recomputation, a `shard_map` body once per shard (summed over the shards),
    `custom_jvp`/`custom_vjp` the rules that ran. XLA's `cost_analysis()` and
    `jax.experimental.roofline` count a loop body once.

    One execution of an equation costs what XLA's `HloCostAnalysis` gives the same
    operation unfused:

    - `dot_general`: `2 * M * N * K` FLOPs (times the batch); a convolution 2 per
      multiply-add that reads an input element;
    - elementwise arithmetic, comparisons, `select_n` and conversions: 1 FLOP per
      output element; `integer_pow` its multiplications;
    - transcendentals apart, 1 per output element: `exp`, `log`, `tanh`,
      `logistic`, `sin`, `cos`, `tan`, `sqrt`, `rsqrt`, `cbrt`, `pow`, `atan2`,
      `expm1`, `log1p`, `erf` (and JAX's other special functions, which XLA
      expands into several operations);
    - reductions: 1 FLOP per element reduced away (input minus output elements);
      `sort`: `n * ceil(log2 n)`; pooling (`reduce_window`) `window size - 1` per
      output element; `fft` `8 * log2(n)` per element;
    - data movement (`reshape`, `broadcast_in_dim`, `transpose`, `gather`, ...):
      no FLOPs; a primitive that computes but has no rule is listed in
      `cost.unpriced` (and counted with no FLOPs);
    - bytes accessed: the bytes of the operands and the outputs (a slice, a
      gather, `dynamic_update_slice` and scatter only the part they touch). XLA's
      own figure, after fusion, is lower: fused intermediates never reach memory;
    - effects (a `sow`, a `check`, any `define_effect` primitive): nothing, as
      they add nothing to the compiled program (they appear in `by_primitive`
      with zero cost; the operations that compute a check's predicate count).

    **Arguments:**

    - `fn`: the function to measure. Its arguments are pytrees; leaves that are not
      arrays are static.
    - `policy`: for control flow kups cannot enter (a library's own primitive), as
      in `count_primitives`: `RAISE` (the default), `WARN` or `IGNORE`; with the
      last two its calls are listed in `cost.opaque` and their insides not counted.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, cost)`, where `out` is `fn(*args, **kwargs)`
    and `cost` a `Cost` with `.flops`, `.transcendentals`, `.bytes_accessed` and
    `.by_primitive`. It is a pytree: return it from `jax.jit`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.instrument import count_flops


    def f(w, xs):
        def step(h, x):
            return jnp.tanh(h @ w + x), None

        return jax.lax.scan(step, jnp.zeros(4), xs)[0]


    w, xs = jnp.ones((4, 4)), jnp.ones((10, 4))
    _, cost = jax.jit(count_flops(f))(w, xs)
    # Each of the 10 steps: a [4] @ [4, 4] product (2 * 4 * 4) and an add (4).
    assert cost.flops == 10 * (2 * 4 * 4 + 4)
    assert cost.transcendentals == 10 * 4
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"count_flops(fn) needs a callable fn, got {type(fn).__name__}. Pass the "
            f"function itself, not its result: count_flops(f)(x)."
        )
    check_policy(policy, "count_flops(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Cost]:
        out, tally = count_executions(
            fn, args, kwargs, key_of=cost_key, policy=policy, label="count_flops"
        )
        return out, Cost(tally.counts, opaque=tally.opaque)

    return stage_eagerly(wrapped)
