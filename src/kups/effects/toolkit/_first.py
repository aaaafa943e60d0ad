"""The first event: across loop iterations, shards and vmapped elements.

One meaning of "first" for every report: the earliest loop iterations
(lexicographic, outermost first), then program order, then the shard in mesh
order; between vmapped elements, the lowest batch index.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._equations import varying_axes
from ._position import Position

_LAST = np.iinfo(np.int32).max


def event_order(iteration: jax.Array, ordinal: int | jax.Array, depth: int) -> jax.Array:
    """The sort key of an event: its loop iterations, then its program order.

    Keys of events at different loop depths are compared on `depth` entries:
    `iteration` is padded with `-1` (no loop at that level), then `ordinal` (the
    event's place in program order, e.g. the index of its site) follows.

    **Arguments:**

    - `iteration`: `int32[d]`, the event's `Position.iteration` (`d <= depth`).
    - `ordinal`: the event's place in program order (an int or an `int32[]`).
    - `depth`: the deepest loop nesting among the events compared.

    **Returns:**

    `int32[depth + 1]`; the smaller key (lexicographically) is the earlier event.

    **Example:**

    ```python
    import jax.numpy as jnp
    from kups.effects.toolkit import event_order

    key = event_order(jnp.array([2, 0], jnp.int32), 5, depth=3)
    assert key.tolist() == [2, 0, -1, 5]
    ```
    """
    iteration = jnp.asarray(iteration, jnp.int32).reshape(-1)
    padding = jnp.full((depth - iteration.shape[0],), -1, jnp.int32)
    parts = [iteration, padding, jnp.asarray(ordinal, jnp.int32).reshape(1)]
    # Zero-length pieces are left out: XLA in JAX 0.11 crashes compiling a
    # concatenate with empty operands inside an eager shard_map body.
    return jnp.concatenate([part for part in parts if part.shape[0]])


def first_index(happened: Any) -> tuple[int, ...] | None:
    """The first element (lowest batch index, row-major) of a batched flag.

    For a report that comes out of `jax.vmap` with one event per element.

    **Arguments:**

    - `happened`: a concrete boolean array, one entry per vmapped element.

    **Returns:**

    The index of the first `True` entry, or `None` if there is none.

    **Example:**

    ```python
    import numpy as np
    from kups.effects.toolkit import first_index

    assert first_index(np.array([[False, False], [True, True]])) == (1, 0)
    assert first_index(np.array(False)) is None
    ```
    """
    happened = np.asarray(happened)
    if not happened.any():
        return None
    flat = int(np.argmax(happened.reshape(-1)))
    return tuple(int(i) for i in np.unravel_index(flat, happened.shape))


def first_across_shards(
    tree: Any, *, happened: jax.Array, order: jax.Array, position: Position
) -> tuple[Any, jax.Array]:
    """The record of the shard whose event came first, on every shard.

    For the `reduce_ctx` of a `shard_map` handler wrapped by `track_position`:
    each shard of the innermost `shard_map` holds a record (`tree`), whether its
    event happened, and the event's `order` (`event_order`). All shards get the
    record of the shard with the smallest `order` among those where it happened,
    ties going to the first shard in mesh order (shard 0's record when none
    happened). One collective round: each shard writes its flag, key and record,
    as bytes, into its own row of a table, and one `psum` gives every shard every
    row. Leaves that do not vary over the manual axes (under `check_vma`) are
    left as they are.

    **Arguments:**

    - `tree`: a pytree of arrays, this shard's record.
    - `happened`: a `bool[]` array.
    - `order`: an `int32[k]` array, the same `k` on every shard.
    - `position`: the context's `Position` inside the body.

    **Returns:**

    `(tree, happened)` of the chosen shard, the same on every shard.

    **Example:**

    ```python
    from kups.effects.toolkit import first_across_shards


    # In a shard_map handler of an effect whose ctx.position is tracked:
    def reduce_ctx(ctx):
        record, happened = first_across_shards(
            ctx.record, happened=ctx.happened, order=ctx.order, position=ctx.position
        )
        return ctx._replace(record=record, happened=happened)
    ```
    """
    level = position.levels[-1]
    axes, sizes, check_vma = level
    all_axes = position.shard_axes
    leaves, treedef = jax.tree.flatten(tree)
    # Under check_vma, values that do not vary over `axes` are already equal on
    # every shard; without it, types do not say, so every value is reduced.
    reduced = [not check_vma or bool(set(axes) & varying_axes(leaf)) for leaf in leaves]
    picked = [
        jnp.asarray(happened),
        jnp.asarray(order, jnp.int32),
        *(leaf for leaf, r in zip(leaves, reduced) if r),
    ]
    if check_vma:
        # A collective over several axes needs values varying over all of them
        # (one that varies over some only is an error in JAX 0.10).
        picked = position.vary(picked)
    rows = [_to_bytes(value) for value in picked]
    # Empty rows are left out of the concatenation (see event_order).
    row = jnp.concatenate([r for r in rows if r.shape[0]])
    table = jnp.zeros((math.prod(sizes), row.shape[0]), jnp.uint8)
    if check_vma:
        table = position.vary(table)
    shard = position.shard
    assert shard is not None, "first_across_shards runs inside a shard_map body"
    own = shard[len(all_axes) - len(axes) :]
    index = sum((own[i] * math.prod(sizes[i + 1 :]) for i in range(len(axes))), jnp.int32(0))
    table = lax.psum(lax.dynamic_update_slice(table, row[None], (index, 0)), axes)
    offsets = np.cumsum([0, *(r.shape[0] for r in rows)])
    # Row `i` is shard `i` in mesh order; its first byte is the flag.
    mask = table[:, 0] != 0
    keys = _from_bytes(
        table[:, offsets[1] : offsets[2]], (table.shape[0], *picked[1].shape), jnp.int32
    )
    for column in range(keys.shape[1]):
        best = jnp.min(jnp.where(mask, keys[:, column], _LAST))
        mask = mask & (keys[:, column] == best)
    chosen = table[jnp.argmax(mask)]
    values = iter(
        _from_bytes(chosen[start:stop], value.shape, value.dtype)
        for start, stop, value in zip(offsets[:-1], offsets[1:], picked, strict=True)
    )
    first_happened = next(values)
    next(values)
    leaves = [next(values) if r else leaf for leaf, r in zip(leaves, reduced)]
    return jax.tree.unflatten(treedef, leaves), first_happened


def _to_bytes(value: jax.Array) -> jax.Array:
    """The bytes of `value`, flat (`uint8`)."""
    if value.dtype == jnp.bool_:
        return value.reshape(-1).astype(jnp.uint8)
    if jnp.issubdtype(value.dtype, jnp.complexfloating):
        value = jnp.stack([jnp.real(value), jnp.imag(value)], axis=-1)
    return lax.bitcast_convert_type(value, jnp.uint8).reshape(-1)


def _from_bytes(data: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The inverse of `_to_bytes`: an array of that shape and dtype."""
    dtype = np.dtype(dtype)
    if dtype == jnp.bool_:
        return (data != 0).reshape(shape)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = _from_bytes(data, (*shape, 2), jnp.finfo(dtype).dtype)
        return lax.complex(parts[..., 0], parts[..., 1])
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(data, dtype).reshape(shape)
    return lax.bitcast_convert_type(data.reshape(*shape, dtype.itemsize), dtype)
