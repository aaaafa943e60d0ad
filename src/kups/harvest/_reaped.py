"""The context of `reap`, what a loop that never sows yields, and the result."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from kups.effects import source_line

from ._names import NameKey, SowPath, Tag, describe, path_of


class Reaped:
    """The context of `reap`: the values sown so far, by path, each with its mode.

    The modes are static (tree aux data), so loop handlers can read them from a
    context whose leaves are abstract.
    """

    def __init__(self, tag: Tag, values: Mapping[SowPath, Any], modes: Mapping[SowPath, str]):
        self.tag = tag
        self.values = dict(values)
        self.modes = dict(modes)

    def sown(self, path: SowPath, value: Any, mode: str) -> Reaped:
        return Reaped(self.tag, {**self.values, path: value}, {**self.modes, path: mode})

    def replace(self, values: Mapping[SowPath, Any]) -> Reaped:
        """The same paths and modes with other values (for example specs)."""
        return Reaped(self.tag, values, {path: self.modes[path] for path in values})


def _flatten_reaped(ctx: Reaped) -> tuple[list[tuple[Any, Any]], Any]:
    paths = tuple(sorted(ctx.values))
    children = [(NameKey(ctx.tag, path), ctx.values[path]) for path in paths]
    return children, (ctx.tag, paths, tuple(ctx.modes[path] for path in paths))


def _unflatten_reaped(aux: Any, children: Iterable[Any]) -> Reaped:
    tag, paths, modes = aux
    return Reaped(tag, dict(zip(paths, children, strict=True)), dict(zip(paths, modes)))


jax.tree_util.register_pytree_with_keys(Reaped, _flatten_reaped, _unflatten_reaped)


def _same_number(a: Any, b: Any) -> bool:
    return bool(a == b or (a != a and b != b))  # NaN is NaN


def init_of(tag: Tag, path: SowPath, sows: list[JaxprEqn]) -> JaxprEqn | None:
    """The sow among `sows` that gives `path` its `init`, or `None`."""
    given = [e for e in sows if path_of(e) == path and e.params["init"] is not None]
    for other in given[1:]:
        if not _same_number(other.params["init"], given[0].params["init"]):
            raise ValueError(
                f"{describe(tag, path)} is sown with init={given[0].params['init']!r} at "
                f"{source_line(given[0])} and with init={other.params['init']!r} at "
                f"{source_line(other)}, in the same loop. Give the same init to both, or to one."
            )
    return given[0] if given else None


def filled_with_init(tag: Tag, params: Mapping[str, Any], at: object, like: Any) -> Any:
    """An array of `like`'s shape and dtype filled with the `init` of the sow of
    `params` (at source line `at`), which that dtype must hold (an integer leaf
    cannot hold NaN or 0.5; JAX would convert it silently)."""
    dtype, init = like.dtype, params["init"]
    value = complex(init)
    if jnp.issubdtype(dtype, jnp.bool_):
        fits = value in (0, 1)
    elif jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        fits = (
            not value.imag
            and math.isfinite(value.real)
            and value.real == int(value.real)
            and info.min <= int(value.real) <= info.max
        )
    elif jnp.issubdtype(dtype, jnp.floating):
        fits = not value.imag
    else:
        fits = True
    if not fits:
        raise ValueError(
            f"{describe(tag, (*params['scope'], params['name']))} is sown at {at} with "
            f"init={init!r}, which a leaf of dtype {jnp.dtype(dtype).name} of the sown value "
            f"cannot hold. init fills every leaf: give one that each leaf's dtype holds "
            f"exactly, or sow an initial value before the loop."
        )
    fill = init if jnp.issubdtype(dtype, jnp.complexfloating) else value.real
    if math.prod(like.shape) <= _SMALL:
        # A small constant: no equation to trace (a loop takes it as a literal input).
        return np.full(tuple(like.shape), fill, dtype)
    # One broadcast of a constant (`lax.full` costs several times more to trace).
    return jax.lax.broadcast_in_dim(np.array(fill, dtype), tuple(like.shape), ())


# The largest fill made as a constant of the program rather than a broadcast.
_SMALL = 256


def nested(values: Mapping[SowPath, Any]) -> dict[str, Any]:
    """Values by path as nested dicts: `{("a", "x"): v}` becomes `{"a": {"x": v}}`."""
    out: dict[str, Any] = {}
    for path in sorted(values):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = values[path]
    return out
