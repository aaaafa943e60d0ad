"""Where a failure is: the first true element of a flag array, found by a
reduction rather than by flattening the array (a reshape of an array sharded
over Explicit mesh axes needs an output sharding, and raises a
`ShardingTypeError` without one)."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Positions are int32: for an array with more elements, the first true element
# is found axis by axis and stands as its index instead of a position.
_MAX_SIZE = np.iinfo(np.int32).max


def _stride(shape: tuple[int, ...], axis: int) -> np.int32:
    """How far apart, in row-major order, two neighbours along `axis` are."""
    return np.int32(math.prod(shape[axis + 1 :]))


def first_true(mask: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """`(first, flat)`: the row-major position of `mask`'s first true element
    (`mask.size` when none is), and every element's position. An array too large
    for int32 positions gives the first true element's index instead (zeros when
    none is) and `None`."""
    shape = mask.shape
    size = math.prod(shape)
    if size >= _MAX_SIZE:
        return _first_index(mask), None
    flat = functools.reduce(
        jnp.add,
        (
            jax.lax.broadcasted_iota(jnp.int32, shape, d) * _stride(shape, d)
            for d in range(len(shape))
        ),
        jnp.zeros(shape, jnp.int32),
    )
    return jnp.min(jnp.where(mask, flat, np.int32(size)), initial=np.int32(size)), flat


def _first_index(mask: jax.Array) -> jax.Array:
    """The index (int32 vector) of `mask`'s first true element in row-major order:
    the first row holding one, then the first true element of that row, and so on."""
    index, rest = [], mask
    for _ in range(mask.ndim):
        held = jnp.any(rest, axis=tuple(range(1, rest.ndim))) if rest.ndim > 1 else rest
        index.append(jnp.argmax(held).astype(jnp.int32))
        rest = jax.lax.dynamic_index_in_dim(rest, index[-1], keepdims=False)
    return jnp.stack(index)


def unravel(first: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The index (int32 vector) of row-major position `first` in `shape` (`first`
    itself if it is an index, see `first_true`)."""
    if jnp.ndim(first) == 1:
        return first
    index = [(first // _stride(shape, d)) % np.int32(n) for d, n in enumerate(shape)]
    return jnp.stack(index).astype(jnp.int32)


def last_axis(first: jax.Array, length: int) -> jax.Array:
    """The index along the last axis (of `length`) of the element at `first`."""
    return first[-1] if jnp.ndim(first) == 1 else first % np.int32(length)


def value_at(value: Any, flat: jax.Array | None, first: jax.Array, lead: int) -> jax.Array:
    """`value[i]`, where `i` is the index of row-major position `first` among the
    `lead` leading axes of `value` (`flat` from `first_true` on them)."""
    value = jnp.asarray(value)
    if flat is None:
        return value[tuple(first[d] for d in range(lead))]
    hit = jnp.expand_dims(flat == first, tuple(range(lead, value.ndim)))
    axes = tuple(range(lead))
    if value.dtype == jnp.bool_:
        return jnp.any(jnp.logical_and(hit, value), axis=axes)
    if jnp.issubdtype(value.dtype, jnp.complexfloating):
        real = value_at(jnp.real(value), flat, first, lead)
        return jax.lax.complex(real, value_at(jnp.imag(value), flat, first, lead))
    if jnp.issubdtype(value.dtype, jnp.floating):
        # Summed as bits, so that the one value picked keeps them (-0.0, a NaN's).
        bits = jnp.dtype(f"uint{8 * value.dtype.itemsize}")
        raw = jax.lax.bitcast_convert_type(value, bits)
        picked = jnp.sum(jnp.where(hit, raw, jnp.zeros((), bits)), axis=axes, dtype=bits)
        return jax.lax.bitcast_convert_type(picked, value.dtype)
    return jnp.sum(jnp.where(hit, value, jnp.zeros((), value.dtype)), axis=axes, dtype=value.dtype)
