"""`report="reaching"`: integers the program computes from its literals alone.

Under `jit` every equation is staged, so the indices of `x.at[2:].set(v)` (a
`broadcast_in_dim` of the literal 2) are traced, though the program fixes them.
The few integer equations that index computations are made of are evaluated
here with NumPy while tracing, so that a scatter or a slice at such indices
keeps the parts of an array exactly (`_taint_pieces`), as it does eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

# Larger integer arrays are not evaluated (nor kept) while tracing.
MAX_KNOWN_SIZE = 1024


def _broadcast_in_dim(x: Any, shape: Any, broadcast_dimensions: Any, **_: Any) -> Any:
    expanded = [1] * len(shape)
    for axis, size in zip(broadcast_dimensions, np.shape(x), strict=True):
        expanded[axis] = size
    return np.broadcast_to(np.reshape(x, expanded), shape)


def _iota(dtype: Any, shape: Any, dimension: int, **_: Any) -> Any:
    along = [1] * len(shape)
    along[dimension] = shape[dimension]
    return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(along), shape)


def _select_n(which: Any, *cases: Any) -> Any:
    return np.choose(np.asarray(which, np.int32), np.broadcast_arrays(*cases))


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}


def _evaluated(name: str, values: list[Any], params: dict[str, Any]) -> Any:
    """The NumPy value of one equation, or `None` when it is not one of these."""
    if name in _BINARY and len(values) == 2:
        return _BINARY[name](values[0], values[1])
    if name == "neg":
        return np.negative(values[0])
    if name == "not":
        return np.invert(values[0])
    if name == "convert_element_type":
        return np.asarray(values[0]).astype(params["new_dtype"])
    if name == "broadcast_in_dim":
        return _broadcast_in_dim(values[0], **params)
    if name == "reshape" and params.get("dimensions") is None:
        return np.reshape(values[0], params["new_sizes"])
    if name == "transpose":
        return np.transpose(values[0], params["permutation"])
    if name == "rev":
        return np.flip(values[0], axis=tuple(params["dimensions"]))
    if name == "squeeze":
        return np.squeeze(values[0], axis=tuple(params["dimensions"]))
    if name == "concatenate":
        return np.concatenate(values, axis=params["dimension"])
    if name == "iota":
        return _iota(**params)
    if name == "select_n":
        return _select_n(*values)
    if name == "clamp":
        return np.clip(values[1], values[0], values[2])
    return None


def known_outputs(eqn: JaxprEqn, values: Sequence[Any]) -> Any:
    """The value of `eqn`'s one integer output, computed from the known
    `values` of its inputs, or `None`."""
    if len(eqn.outvars) != 1:
        return None
    aval = eqn.outvars[0].aval
    dtype, shape = getattr(aval, "dtype", None), tuple(getattr(aval, "shape", ()))
    if (
        dtype is None
        or jnp.issubdtype(dtype, jax.dtypes.extended)  # a PRNG key
        or not (np.issubdtype(dtype, np.integer) or dtype == np.bool_)
    ):
        return None
    if int(np.prod(shape)) > MAX_KNOWN_SIZE:
        return None
    try:
        with np.errstate(all="ignore"):  # integers wrap around, as in XLA
            out = _evaluated(eqn.primitive.name, [np.asarray(v) for v in values], dict(eqn.params))
    except (TypeError, ValueError, KeyError):  # a parameter of another shape: left unknown
        return None
    if out is None or np.shape(out) != shape:
        return None
    return np.asarray(out, dtype)
