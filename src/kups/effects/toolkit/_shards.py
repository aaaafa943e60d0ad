"""Reductions over the shards of a `shard_map` body, in one collective round."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._equations import varying_axes

_REDUCTIONS = {"sum": lax.psum, "min": lax.pmin, "max": lax.pmax}


def reduce_shards(value: Any, axes: Iterable[Hashable], *, op: str = "sum") -> jax.Array:
    """The sum, minimum or maximum of `value` over the shards of `axes`, in one
    collective.

    Inside a `shard_map` body, for a `reduce_ctx` that combines what each shard
    recorded (counts, the earliest iteration). JAX rejects a collective over
    several axes for a value that varies along some of them only (JAX 0.10), so
    the value is first cast to vary over all of `axes`; a value that does not
    vary over an axis counts once per shard there (`"sum"` multiplies it by the
    axis size), as the shards hold it. Works with `check_vma` on or off.

    **Arguments:**

    - `value`: an array (or scalar) of this shard.
    - `axes`: manual mesh axis names of the enclosing `shard_map`s (e.g.
      `Position.shard_axes`, or the axes of one `shard_map`).
    - `op`: `"sum"`, `"min"` or `"max"`.

    **Returns:**

    The reduced array, the same on every shard of `axes`. With no axes, `value`;
    an empty array comes back as zeros without a collective.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P
    from kups.effects.toolkit import reduce_shards

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


    def body(block):  # block varies over "y" only
        total = reduce_shards(block.sum(), ("x", "y"))
        smallest = reduce_shards(block.min(), ("x", "y"), op="min")
        return jnp.stack([total, smallest])


    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("y"), out_specs=P()))
    assert f(jnp.arange(8.0)).tolist() == [2 * 28.0, 0.0]  # every "x" shard holds the sum
    ```
    """
    if op not in _REDUCTIONS:
        raise ValueError(
            f"reduce_shards(value, axes, op={op!r}): op is one of 'sum', 'min', 'max'."
        )
    value = jnp.asarray(value)
    axes = tuple(axes)
    if not axes:
        return value
    if value.size == 0:
        # Nothing to reduce; XLA 0.11.2 crashes compiling a collective over an
        # empty array. A fresh constant is what the collective would give.
        return jnp.zeros(value.shape, value.dtype)
    varying = varying_axes(value)
    missing = tuple(axis for axis in axes if axis not in varying)
    if missing:
        value = lax.pcast(value, missing, to="varying")
    return _REDUCTIONS[op](value, axes)
