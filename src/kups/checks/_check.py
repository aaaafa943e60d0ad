"""`check`: the primitive a user's assertion binds, and what it carries statically.

A `check(pred, msg, *fmt_args, **fmt_kwargs)` binds one `kups_check` effect
whose operands are the predicate and the array format arguments; the message,
the source line and how to rebuild the format arguments travel as a static
parameter (`_CheckInfo`). Outside `checked`, it does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import string
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from kups.effects import define_effect

_check_p = define_effect("kups_check")


def _batch_check(
    args: Sequence[Any], dims: Sequence[int | None], **params: Any
) -> tuple[list[Any], list[int]]:
    """Under `vmap`, every operand of a check gets the batch axis first (unbatched
    ones are broadcast), so that the handler can tell the batch axes (the
    predicate's) from the format arguments' own axes and report the first failing
    element. Nested `vmap`s stack their axes in front, the outermost first."""
    size = next(arg.shape[dim] for arg, dim in zip(args, dims) if dim is not None)
    moved = [
        jnp.broadcast_to(arg, (size, *arg.shape)) if dim is None else jnp.moveaxis(arg, dim, 0)
        for arg, dim in zip(args, dims)
    ]
    return _check_p.bind(*moved, **params), [0] * len(moved)


batching.primitive_batchers[_check_p] = _batch_check


class _Formatter(string.Formatter):
    """`str.format` with every argument used, and the `str` of numpy scalars for an
    empty format spec (`'{}'.format(np.float32(0.1))` would print the float64
    expansion `0.10000000149011612`)."""

    def get_value(self, key: int | str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if isinstance(key, int):
            if key >= len(args):
                raise IndexError(
                    f"the message has a field for argument {key} but only {len(args)} "
                    f"fmt_args were given"
                )
            return args[key]
        if key not in kwargs:
            given = f" (given: {', '.join(sorted(kwargs))})" if kwargs else ""
            raise KeyError(
                f"the message has a named field {{{key}}} but no keyword argument "
                f"{key}=... was given{given}"
            )
        return kwargs[key]

    def check_unused_args(
        self, used_args: set[int | str], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        unused = [i for i in range(len(args)) if i not in used_args]
        if unused:
            raise IndexError(
                f"{len(args)} fmt_args were given but the message does not use "
                f"argument{'s' if len(unused) > 1 else ''} {', '.join(map(str, unused))}"
            )
        unused_names = sorted(name for name in kwargs if name not in used_args)
        if unused_names:
            raise KeyError(
                f"the message has no field for keyword argument"
                f"{'s' if len(unused_names) > 1 else ''} {', '.join(unused_names)}"
            )

    def format_field(self, value: Any, format_spec: str) -> Any:
        if not format_spec:
            return str(value)
        return super().format_field(value, format_spec)


_FORMATTER = _Formatter()
_FORMAT_ERRORS = (IndexError, KeyError, ValueError, TypeError, AttributeError)


@dataclasses.dataclass(frozen=True, eq=False)
class _CheckInfo:
    """The static part of one `check` call: its message, its source line and how
    to rebuild its format arguments. Compared by identity: one call, one site."""

    msg: str
    location: str
    fmt_tree: Any
    is_array: tuple[bool, ...]
    statics: tuple[Any, ...]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    kind = "user"

    def __repr__(self) -> str:
        return f"<check {self.msg!r} at {self.location}>"

    def format(self, arrays: Sequence[Any]) -> str:
        """The message formatted with `arrays` for the array format arguments."""
        array_iter, static_iter = iter(arrays), iter(self.statics)
        leaves = [_scalar(next(array_iter)) if a else next(static_iter) for a in self.is_array]
        args, kwargs = jax.tree.unflatten(self.fmt_tree, leaves)
        return _FORMATTER.format(self.msg, *args, **kwargs)


def _scalar(value: Any) -> Any:
    """A numpy scalar for a 0-d array, so that format specs like `.2f` apply."""
    value = np.asarray(value)
    return value[()] if value.ndim == 0 else value


def _caller_location() -> str:
    """`file.py:LINE` of the code that called the function calling this one."""
    frame = sys._getframe(2)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def check(pred: Any, msg: str, *fmt_args: Any, **fmt_kwargs: Any) -> None:
    """Asserts `pred` where it runs, even inside `jax.jit` and control flow.

    Under `checked`, a `False` predicate records a failure:
    `msg.format(*fmt_args, **fmt_kwargs)` with the values of the format arguments
    at the failing point, and where it happened (the loop iterations, the shard,
    the source line of the `check`). The first failure in execution order is kept
    (between the shards of a `shard_map`, or the elements of a `vmap`, which run
    side by side: the first in mesh or batch order). Outside `checked`, `check`
    does nothing.

    **Arguments:**

    - `pred`: a boolean scalar (a Python `bool` or a `bool[]` array), `True` when
      all is well. Reduce an array condition with `jnp.all`.
    - `msg`: the message, a `str.format` template: positional fields (`{}`,
      `{0}`, `{:.3f}`) for `fmt_args`, named fields (`{x}`, `{x:.3f}`) for
      `fmt_kwargs`; write `{{` and `}}` for literal braces.
    - `fmt_args`, `fmt_kwargs`: pytrees of arrays (and static Python values) for
      the message's fields, each used by the message.

    **Raises:**

    `TypeError` or `ValueError` (at trace time, naming the message and the line of
    the `check`) for a predicate that is not a boolean scalar, or format
    arguments that do not match the message.

    **Example:**

    ```python
    import jax.numpy as jnp
    from kups.checks import check, checked


    def safe_log(x):
        check(jnp.all(x > 0), "log of {x_min}, a non-positive number", x_min=jnp.min(x))
        return jnp.log(x)


    out, error = checked(safe_log)(jnp.array([1.0, -2.0]))
    assert error.message == "log of -2.0, a non-positive number"
    ```
    """
    location = _caller_location()
    if not isinstance(msg, str):
        raise TypeError(
            f"check(pred, msg, *fmt_args, **fmt_kwargs) at {location}: msg must be a str, "
            f"got {type(msg).__name__}: {msg!r}."
        )
    pred = _predicate(pred, msg, location)
    leaves, fmt_tree = jax.tree.flatten((fmt_args, fmt_kwargs))
    is_array = tuple(eqx.is_array(leaf) for leaf in leaves)
    arrays = [jnp.asarray(leaf) for leaf, a in zip(leaves, is_array) if a]
    info = _CheckInfo(
        msg=msg,
        location=location,
        fmt_tree=fmt_tree,
        is_array=is_array,
        statics=tuple(leaf for leaf, a in zip(leaves, is_array) if not a),
        avals=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays),
    )
    try:
        info.format([np.zeros(aval.shape, aval.dtype) for aval in info.avals])
    except _FORMAT_ERRORS as err:
        detail = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ValueError(
            f"check({msg!r}) at {location}: the message does not format with its "
            f"{len(fmt_args)} fmt_args and {len(fmt_kwargs)} fmt_kwargs "
            f"({type(err).__name__}: {detail}). Give one argument per field, e.g. "
            f"check(x > 0, 'x is {{}}', x) or check(x > 0, 'x is {{x}}', x=x)."
        ) from None
    _check_p.bind(pred, *arrays, site=info)


def _predicate(pred: Any, msg: str, location: str) -> Any:
    try:
        pred = jnp.asarray(pred)
    except TypeError:
        raise TypeError(
            f"check({msg!r}) at {location}: the predicate must be a boolean scalar, got "
            f"{type(pred).__name__}: {pred!r}."
        ) from None
    if pred.dtype != jnp.bool_:
        raise TypeError(
            f"check({msg!r}) at {location}: the predicate must be a boolean scalar, got "
            f"{jax.typeof(pred).str_short()}. Compare it (x > 0) or cast it (x != 0)."
        )
    if pred.shape != ():
        raise ValueError(
            f"check({msg!r}) at {location}: the predicate must be a boolean scalar, got "
            f"{jax.typeof(pred).str_short()}. Reduce it with jnp.all(...) (or jnp.any)."
        )
    return pred
