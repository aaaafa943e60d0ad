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

# Positions are int32: an array with more elements is flattened instead (as
# before sharding in types; JAX's argmax counts in int32 too).
_MAX_SIZE = np.iinfo(np.int32).max


def _stride(shape: tuple[int, ...], axis: int) -> np.int32:
    """How far apart, in row-major order, two neighbours along `axis` are."""
    return np.int32(math.prod(shape[axis + 1 :]))


def first_true(mask: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """`(first, flat)`: the row-major position of `mask`'s first true element
    (`mask.size` when none is), and every element's position (`None` for an
    array too large for int32 positions, found by flattening)."""
    shape = mask.shape
    size = math.prod(shape)
    if size >= _MAX_SIZE:
        return jnp.argmax(mask.reshape(-1)), None
    flat = functools.reduce(
        jnp.add,
        (
            jax.lax.broadcasted_iota(jnp.int32, shape, d) * _stride(shape, d)
            for d in range(len(shape))
        ),
        jnp.zeros(shape, jnp.int32),
    )
    return jnp.min(jnp.where(mask, flat, np.int32(size)), initial=np.int32(size)), flat


def unravel(first: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The index (int32 vector) of row-major position `first` in `shape`."""
    index = [(first // _stride(shape, d)) % np.int32(n) for d, n in enumerate(shape)]
    return jnp.stack(index).astype(jnp.int32)


def value_at(value: Any, flat: jax.Array | None, first: jax.Array, lead: int) -> jax.Array:
    """`value[i]`, where `i` is the index of row-major position `first` among the
    `lead` leading axes of `value` (`flat` from `first_true` on them)."""
    value = jnp.asarray(value)
    if flat is None:
        return value.reshape(-1, *value.shape[lead:])[first]
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
