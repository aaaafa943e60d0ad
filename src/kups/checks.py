"""`check` and `checked`: runtime assertions inside jitted programs.

`check(pred, msg, *fmt_args, **fmt_kwargs)` records a condition where it runs:
inside `jit`, `scan`, `while_loop`, `cond`/`switch`, `jax.checkpoint`, custom
derivatives and `shard_map`. `checked(fn, errors=...)` runs `fn` under an
interpreter that turns every check into a few array operations on an error
value, which comes back beside `fn`'s output. With `errors=` it also checks the
program's own operations: out-of-bounds indices (`index_checks`), division by
zero (`div_checks`) and NaNs made from NaN-free inputs (`nan_checks`). Nothing
is raised inside the compiled program; the first failure is reported afterwards,
with where it happened.

How it works: the interpreter's context is an error record with a `failed` flag
and one slot per check site (`_Slot`): whether that site failed, the values of
its format arguments at the failing point, the loop iterations and the shard
coordinates. Messages and source lines stay on the Python side, in the
context's static structure. A site's slot starts at zeros; the first failing
check fills its slot and sets `failed`, which masks every later check. A user
check is a site by its call; an automatic check is a site by what it reports
(kind, primitive, source line, operand shape), so that the same site is found
when a loop body is scanned before it runs and when it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import string
import sys
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from kups.effects import (
    Dispatcher,
    Handler,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    check_policy,
    contains_subjaxprs,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    define_effect,
    reinterpret,
    shard_map_axes,
    skip_when_untouched,
    source_location,
    varying_axes,
    while_with_predicate,
    wraps_with_leading,
)

__all__ = [
    "CheckFailed",
    "Error",
    "all_checks",
    "automatic_checks",
    "check",
    "checked",
    "div_checks",
    "float_checks",
    "index_checks",
    "nan_checks",
    "user_checks",
]

Params = ParamSpec("Params")
Out = TypeVar("Out")

# ---------------------------------------------------------------------------
# Which failures `checked` looks for: frozensets of check kinds, combined with |.
# ---------------------------------------------------------------------------

user_checks: frozenset[str] = frozenset({"user"})
"""A `check(pred, ...)` whose predicate is false."""
index_checks: frozenset[str] = frozenset({"index"})
"""An out-of-bounds index in `gather`, `scatter*`, `dynamic_slice` or
`dynamic_update_slice` (which JAX clamps, fills or drops without a word)."""
div_checks: frozenset[str] = frozenset({"div"})
"""A zero divisor in `div` or `rem` (integer or float)."""
nan_checks: frozenset[str] = frozenset({"nan"})
"""An operation whose output holds a NaN while none of its inputs does."""
float_checks: frozenset[str] = nan_checks | div_checks
"""`nan_checks | div_checks`, as in `jax.experimental.checkify`."""
automatic_checks: frozenset[str] = float_checks | index_checks
"""Every check `checked` adds by itself: `index_checks | div_checks | nan_checks`."""
all_checks: frozenset[str] = automatic_checks | user_checks
"""`automatic_checks | user_checks`."""

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


class CheckFailed(Exception):
    """Raised by `Error.throw()` when a check failed; its message says which and where."""


# ---------------------------------------------------------------------------
# What a check is, statically.
# ---------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class _AutoCheck:
    """The static part of an automatic check: what it reports and where. Compared
    by value, so that an equation met when a loop body is scanned ahead and when it
    runs is the same site (and equal reports of one line share a slot, which is
    harmless: only the first failure is ever recorded)."""

    kind: str
    primitive: str
    location: str
    template: str  # `str.format` template with positional fields for the payload
    payload: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each value

    @property
    def avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct(shape, np.dtype(dtype)) for shape, dtype in self.payload)

    def format(self, arrays: Sequence[Any]) -> str:
        return _FORMATTER.format(self.template, *(_scalar(a) for a in arrays))


_Info = _CheckInfo | _AutoCheck


def _scalar(value: Any) -> Any:
    """A numpy scalar for a 0-d array, so that format specs like `.2f` apply."""
    value = np.asarray(value)
    return value[()] if value.ndim == 0 else value


@dataclasses.dataclass(frozen=True)
class _Site:
    """A check together with the loops and shard_map axes around it where it runs.
    One slot of the error record belongs to each site."""

    info: _Info
    num_loops: int
    shard_axes: tuple[Hashable, ...]
    batch_ndim: int


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


# ---------------------------------------------------------------------------
# Automatic checks: what the program's own operations may get wrong.
# ---------------------------------------------------------------------------

_SCATTERS = frozenset(
    {
        "scatter",
        *(f"scatter{sep}{op}" for sep in "-_" for op in ("add", "sub", "mul", "min", "max")),
    }
)
_INDEXING = frozenset({"gather", "dynamic_slice", "dynamic_update_slice"}) | _SCATTERS
_DIVISIONS = frozenset({"div", "rem"})
# Operations that only move, pick or relabel elements: from NaN-free inputs they
# cannot make a NaN, so nan_checks does not spend a reduction on them. (`gather`
# is not one: in "fill" mode it writes NaN for an out-of-bounds index.)
_MOVES_ONLY = frozenset(
    {
        "broadcast_in_dim",
        "concatenate",
        "convert_element_type",
        "copy",
        "copy_p",
        "dynamic_slice",
        "dynamic_update_slice",
        "expand_dims",
        "reshape",
        "rev",
        "select_n",
        "slice",
        "squeeze",
        "transpose",
    }
)


_UNKNOWN = "unknown"


def _eqn_location(eqn: JaxprEqn, enclosing: str = _UNKNOWN) -> str:
    """`file.py:LINE` of the user's code behind `eqn`; for an equation with no user
    frame of its own (JAX keeps none inside the jitted body of a `jnp` function
    such as `floor_divide`), that of the control flow around it, `enclosing`."""
    location = source_location(eqn)
    return enclosing if location is None else f"{os.path.basename(location[0])}:{location[1]}"


def _is_inexact(dtype: Any) -> bool:
    return isinstance(dtype, np.dtype) and bool(jnp.issubdtype(dtype, jnp.inexact))


class _IndexLayout(NamedTuple):
    """How an indexing equation reads its indices: the operand axis of each entry of
    the indices' last dimension and the largest in-bounds start on that axis."""

    operand_axes: tuple[int, ...]
    upper: tuple[int, ...]


def _index_layout(eqn: JaxprEqn) -> _IndexLayout | None:
    """The index layout of a `gather`, `scatter*`, `dynamic_slice` or
    `dynamic_update_slice`, or `None` when it reads no index."""
    name, params = eqn.primitive.name, eqn.params
    operand_shape = tuple(eqn.invars[0].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
    ndim = len(operand_shape)
    if name == "dynamic_slice":
        window = tuple(params["slice_sizes"])
        axes = tuple(range(ndim))
    elif name == "dynamic_update_slice":
        window = tuple(eqn.invars[1].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
        axes = tuple(range(ndim))
    elif name == "gather":
        if math.prod(eqn.invars[1].aval.shape) == 0:  # pyright: ignore[reportAttributeAccessIssue]
            return None
        window = tuple(params["slice_sizes"])
        axes = tuple(params["dimension_numbers"].start_index_map)
    else:  # scatter*: the update window's extent along each operand axis
        if math.prod(eqn.invars[1].aval.shape) == 0:  # pyright: ignore[reportAttributeAccessIssue]
            return None
        numbers = params["dimension_numbers"]
        updates_shape = eqn.invars[2].aval.shape  # pyright: ignore[reportAttributeAccessIssue]
        size_one = {*numbers.inserted_window_dims, *getattr(numbers, "operand_batching_dims", ())}
        window_dims = iter(numbers.update_window_dims)
        window = tuple(
            1 if d in size_one else updates_shape[next(window_dims)] for d in range(ndim)
        )
        axes = tuple(numbers.scatter_dims_to_operand_dims)
    if not axes:
        return None
    return _IndexLayout(axes, tuple(operand_shape[a] - window[a] for a in axes))


def _index_array(eqn: JaxprEqn, invals: Sequence[Any]) -> jax.Array:
    """The indices an equation reads, with one entry per operand axis last."""
    name = eqn.primitive.name
    ndim = len(eqn.invars[0].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
    if name == "dynamic_slice":
        return jnp.stack([jnp.asarray(i) for i in invals[1 : 1 + ndim]])
    if name == "dynamic_update_slice":
        return jnp.stack([jnp.asarray(i) for i in invals[2 : 2 + ndim]])
    return jnp.asarray(invals[1])


def _automatic_checks(
    eqn: JaxprEqn, kinds: frozenset[str], enclosing: str
) -> tuple[_AutoCheck, ...]:
    """The automatic checks of `kinds` that apply to `eqn` (no control flow), inside
    control flow at `enclosing`."""
    name = eqn.primitive.name
    found = []
    scalar = ((), "int32")
    if "index" in kinds and name in _INDEXING and _index_layout(eqn) is not None:
        shape = tuple(eqn.invars[0].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
        template = (
            f"out-of-bounds index {{}} on axis {{}} of an operand of shape {shape} in "
            f"'{name}' (in bounds: 0 to {{}})"
        )
        found.append(
            _AutoCheck("index", name, _eqn_location(eqn, enclosing), template, (scalar,) * 3)
        )
    if "div" in kinds and name in _DIVISIONS:
        divisor_shape = tuple(eqn.invars[1].aval.shape)  # pyright: ignore[reportAttributeAccessIssue]
        if divisor_shape:
            template = f"division by zero in '{name}' (divisor element {{}})"
            payload = (((len(divisor_shape),), "int32"),)
        else:
            template, payload = f"division by zero in '{name}'", ()
        found.append(_AutoCheck("div", name, _eqn_location(eqn, enclosing), template, payload))
    if (
        "nan" in kinds
        and name not in _MOVES_ONLY
        and not eqn.effects  # effects (a `sow`, a callback) pass their values on
        and any(_is_inexact(v.aval.dtype) for v in eqn.outvars)  # pyright: ignore[reportAttributeAccessIssue]
    ):
        template = f"'{name}' produced a NaN from inputs without NaN"
        found.append(_AutoCheck("nan", name, _eqn_location(eqn, enclosing), template, ()))
    return tuple(found)


def _out_of_bounds(
    eqn: JaxprEqn, invals: Sequence[Any], outvals: Sequence[Any]
) -> tuple[jax.Array, list[jax.Array]]:
    del outvals
    layout = _index_layout(eqn)
    assert layout is not None
    indices = _index_array(eqn, invals)
    upper = np.asarray(layout.upper)
    # A bound past the index dtype's range is one no index of that dtype passes.
    bound = np.minimum(upper, np.iinfo(indices.dtype).max).astype(indices.dtype)
    outside = jnp.logical_or(indices < 0, indices > bound)
    first = jnp.argmax(outside.reshape(-1))
    entry = first % len(layout.operand_axes)
    payload = [
        indices.reshape(-1)[first].astype(jnp.int32),
        jnp.asarray(layout.operand_axes, jnp.int32)[entry],
        jnp.asarray(upper, jnp.int32)[entry],
    ]
    return jnp.any(outside), payload


def _zero_divisor(
    eqn: JaxprEqn, invals: Sequence[Any], outvals: Sequence[Any]
) -> tuple[jax.Array, list[jax.Array]]:
    del outvals
    zero = jnp.asarray(invals[1]) == 0
    if not zero.ndim:
        return zero, []
    first = jnp.unravel_index(jnp.argmax(zero.reshape(-1)), zero.shape)
    return jnp.any(zero), [jnp.stack(first).astype(jnp.int32)]


def _new_nan(
    eqn: JaxprEqn, invals: Sequence[Any], outvals: Sequence[Any]
) -> tuple[jax.Array, list[jax.Array]]:
    def any_nan(values: Iterable[Any]) -> jax.Array:
        flags = [jnp.any(jnp.isnan(v)) for v in map(jnp.asarray, values) if _is_inexact(v.dtype)]
        return functools.reduce(jnp.logical_or, flags, jnp.zeros((), jnp.bool_))

    return jnp.logical_and(any_nan(outvals), jnp.logical_not(any_nan(invals))), []


_CONDITIONS: dict[
    str, Callable[[JaxprEqn, Sequence[Any], Sequence[Any]], tuple[jax.Array, list[jax.Array]]]
] = {"index": _out_of_bounds, "div": _zero_divisor, "nan": _new_nan}


# ---------------------------------------------------------------------------
# The error record: the interpreter's context, and what `checked` returns.
# ---------------------------------------------------------------------------


class _Slot(eqx.Module):
    """What one check site recorded: zeros until it fails, then the values of the
    format arguments, the loop iterations (outermost first) and the shard
    coordinates (one per manual mesh axis) of the first failure. Where there is
    no loop, shard_map or vmap around the site, that field is `None`: a program
    with many sites carries no empty arrays."""

    site: _Site = eqx.field(static=True)
    failed: jax.Array
    values: tuple[jax.Array, ...]
    iterations: jax.Array | None
    shard: jax.Array | None
    batch: jax.Array | None

    @staticmethod
    def empty(site: _Site) -> _Slot:
        return _Slot(
            site=site,
            failed=jnp.zeros((), jnp.bool_),
            values=tuple(jnp.zeros(aval.shape, aval.dtype) for aval in site.info.avals),
            iterations=_zeros(site.num_loops),
            shard=_zeros(len(site.shard_axes)),
            batch=_zeros(site.batch_ndim),
        )


def _zeros(size: int) -> jax.Array | None:
    return jnp.zeros((size,), jnp.int32) if size else None


class _Ctx(eqx.Module):
    """The interpreter's context: the error record, plus the iteration counters of
    the loops (outermost first), the manual mesh axes around the current equation,
    the kinds of checks being recorded and the source line of the innermost
    control flow around it (for equations with none of their own)."""

    failed: jax.Array
    slots: tuple[_Slot, ...]
    loops: tuple[jax.Array, ...]
    shard_axes: tuple[Hashable, ...] = eqx.field(static=True)
    kinds: frozenset[str] = eqx.field(static=True)
    enclosing: str = eqx.field(static=True, default=_UNKNOWN)
    # Inside shard_map: this shard's coordinate along each of `shard_axes`, as an
    # int32 array of shape `(1,) * k + (len(shard_axes),)` (k: the manual axes of
    # the innermost shard_map), handed in sharded rather than read by
    # `axis_index`, which JAX before 0.10.2 cannot lower for the axis of an
    # enclosing shard_map inside a nested one.
    coords: jax.Array | None = None

    def with_sites(self, sites: Iterable[_Site]) -> _Ctx:
        """This context with an empty slot for each site it has none for."""
        known = {slot.site for slot in self.slots}
        new = tuple(_Slot.empty(site) for site in dict.fromkeys(sites) if site not in known)
        return dataclasses.replace(self, slots=self.slots + new) if new else self


@dataclasses.dataclass(frozen=True)
class _Failure:
    """The first failure of a concrete error, read out."""

    kind: str
    message: str
    iteration: tuple[int, ...] | None
    shard: dict[Hashable, int] | None
    vmap_index: tuple[int, ...]
    source: str

    def describe(self) -> str:
        text = self.message
        if self.vmap_index:
            index = self.vmap_index
            text += f" at vmap index {index[0] if len(index) == 1 else index}"
        if self.iteration is not None:
            if len(self.iteration) == 1:
                text += f" at iteration {self.iteration[0]}"
            else:
                text += (
                    f" at iterations {', '.join(map(str, self.iteration))} (outermost loop first)"
                )
        if self.shard is not None:
            text += " on shard " + ", ".join(f"{axis}={i}" for axis, i in self.shard.items())
        return f"{text} ({self.source})"


class Error(eqx.Module):
    """What `checked` returns beside the output: the first failed check, if any.

    It is a pytree, so it can be returned from `jax.jit` (and passed through
    `vmap`, `lax.cond`, ...). Read it (`get`, `throw`, or the fields below) once it
    is concrete, outside the jitted function; reading a traced error is a
    `TypeError` that says so.

    **Fields:**

    - `failed`: a `bool[]` array, `True` when a check failed.
    - `message`: the formatted message of the first failure (without where it
      happened), or `None`.
    - `iteration`: the iteration of each loop (`scan`, `fori_loop`, `while_loop`)
      around the failure, outermost first, or `None` (no failure, or not in a loop).
    - `shard`: the failing shard's coordinates on the manual mesh axes of the
      `shard_map`s around it (`{"x": 2, "y": 1}`), or `None`.
    - `source`: `"file.py:LINE"` of the failing `check` or operation, or `None`.
    - `kind`: `"user"`, `"index"`, `"div"` or `"nan"`, or `None`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.checks import check, checked


    def f(xs):
        def step(carry, x):
            check(x < 3, "x={x}", x=x)
            return carry, None

        return jax.lax.scan(step, 0, xs)[0]


    _, error = jax.jit(checked(f))(jnp.arange(5))
    assert (error.message, error.iteration, error.shard) == ("x=3", (3,), None)
    ```
    """

    failed: jax.Array
    slots: tuple[_Slot, ...]

    def _first_failure(self, reading: str) -> _Failure | None:
        if self._is_traced():
            raise TypeError(
                f"Error.{reading} needs a concrete error, but this one is traced (it is "
                f"being used inside jax.jit or another transformation). Return the Error "
                f"from the transformed function and read .{reading} on the result, "
                f"outside jit."
            )
        failed = np.asarray(self.failed)
        if not failed.any():
            return None
        # A vmapped checked function returns a batched error: its first failing
        # element (row-major) is reported, with its index.
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(failed)), failed.shape))
        for slot in self.slots:
            element = jax.tree.map(lambda leaf: np.asarray(leaf)[index], slot)
            if not element.failed:
                continue
            site = slot.site
            return _Failure(
                kind=site.info.kind,
                message=site.info.format(list(element.values)),
                iteration=None
                if element.iterations is None
                else tuple(element.iterations.tolist()),
                shard=None
                if element.shard is None
                else dict(zip(site.shard_axes, element.shard.tolist(), strict=True)),
                vmap_index=(*index, *([] if element.batch is None else element.batch.tolist())),
                source=site.info.location,
            )
        raise AssertionError("kups.checks: the error is failed but no check site failed.")

    def get(self) -> str | None:
        """The message of the first failed check, or `None` when every check passed.

        The message is the check's `msg` formatted with the values at the failing
        point (`message`), then where it failed: `at iteration 3` (0-based; for
        nested loops each level, outermost first), `on shard x=2, y=1` (inside
        `shard_map`) and the source line, e.g.
        `"x must be positive, got -1.0 at iteration 3 (model.py:12)"`.

        Under `jax.vmap` (inside the checked function, or of it), the first
        failing element (in row-major order) is reported with `at vmap index i`.

        **Raises:**

        `TypeError` under a JAX trace (inside `jit`): return the error from the
        jitted function and call `get` on the result.
        """
        failure = self._first_failure("get()")
        return None if failure is None else failure.describe()

    @property
    def message(self) -> str | None:
        """The formatted message of the first failure, without where it happened."""
        failure = self._first_failure("message")
        return None if failure is None else failure.message

    @property
    def iteration(self) -> tuple[int, ...] | None:
        """One index per loop around the first failure, outermost first; `None` when
        nothing failed or the failure was not inside a loop."""
        failure = self._first_failure("iteration")
        return None if failure is None else failure.iteration

    @property
    def shard(self) -> dict[Hashable, int] | None:
        """The first failing shard's coordinates, `{axis: index}` over the manual
        mesh axes around it; `None` when nothing failed or not inside `shard_map`."""
        failure = self._first_failure("shard")
        return None if failure is None else failure.shard

    @property
    def source(self) -> str | None:
        """`"file.py:LINE"` of the failing `check` or operation, or `None`."""
        failure = self._first_failure("source")
        return None if failure is None else failure.source

    @property
    def kind(self) -> str | None:
        """Which kind of check failed (`"user"`, `"index"`, `"div"`, `"nan"`), or `None`."""
        failure = self._first_failure("kind")
        return None if failure is None else failure.kind

    def _is_traced(self) -> bool:
        return any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(self))

    def throw(self) -> None:
        """Raises `CheckFailed` with the message of `get()` if a check failed."""
        message = self.get()
        if message is not None:
            raise CheckFailed(message)

    def __repr__(self) -> str:
        if self._is_traced():
            return f"Error(<traced>, {len(self.slots)} check sites)"
        return f"Error({self.get()!r})"


# ---------------------------------------------------------------------------
# Recording a failure.
# ---------------------------------------------------------------------------


def _record(
    ctx: _Ctx, site: _Site, bad: jax.Array, values: Sequence[jax.Array], batch: jax.Array | None
) -> _Ctx:
    """`ctx` with `site`'s slot filled if `bad` and nothing failed before."""
    ctx = ctx.with_sites([site])
    fails = jnp.logical_and(bad, jnp.logical_not(ctx.failed))
    iterations = jnp.stack(ctx.loops) if ctx.loops else None
    shard = None if ctx.coords is None else ctx.coords.reshape(len(ctx.shard_axes))

    def fill(slot: _Slot) -> _Slot:
        if slot.site != site:
            return slot
        return _Slot(
            site=site,
            failed=jnp.logical_or(slot.failed, fails),
            values=tuple(
                _select(fails, new, old) for new, old in zip(values, slot.values, strict=True)
            ),
            iterations=_select(fails, iterations, slot.iterations),
            shard=_select(fails, shard, slot.shard),
            batch=_select(fails, batch, slot.batch),
        )

    return dataclasses.replace(
        ctx,
        failed=jnp.logical_or(ctx.failed, fails),
        slots=tuple(fill(slot) for slot in ctx.slots),
    )


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `pred`, else `old` (`None` stays `None`). Not `jnp.where`: on an
    empty array (JAX 0.10.2) it returns an operand without joining the varying
    manual axes, which breaks a loop carry inside shard_map."""
    if old is None:
        return None
    return lax.select(jnp.broadcast_to(pred, old.shape), new, old)


def _check_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    del interpreter
    pred, *values = invals
    site = _Site(eqn.params["site"], len(ctx.loops), ctx.shard_axes, _batch_ndim(eqn))
    batch = None
    if site.batch_ndim:  # under vmap (see `_batch_check`): the first failing element
        first = jnp.argmin(pred.reshape(-1))
        values = [value.reshape(-1, *value.shape[site.batch_ndim :])[first] for value in values]
        batch = jnp.stack(jnp.unravel_index(first, pred.shape)).astype(jnp.int32)
        pred = jnp.all(pred)
    ctx = _record(ctx, site, jnp.logical_not(pred), values, batch)
    return HandlerResult(ctx, list(invals))


def _batch_ndim(eqn: JaxprEqn) -> int:
    return eqn.invars[0].aval.ndim  # pyright: ignore[reportAttributeAccessIssue]  # the predicate is a scalar but for vmap axes


def _automatic_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The fallback handler under automatic checks: re-binds the equation, then
    records whatever of `ctx.kinds` went wrong in it."""
    ctx, outvals = default_primitive_handler(interpreter, ctx, eqn, invals)
    for info in _automatic_checks(eqn, ctx.kinds, ctx.enclosing):
        bad, payload = _CONDITIONS[info.kind](eqn, invals, outvals)
        site = _Site(info, len(ctx.loops), ctx.shard_axes, 0)
        ctx = _record(ctx, site, bad, payload, None)
    return HandlerResult(ctx, outvals)


# ---------------------------------------------------------------------------
# Where the checks are: a program's sites, found before it runs.
# ---------------------------------------------------------------------------

# Per jaxpr and kinds: its sites relative to it, `(info, loops, shard_axes,
# batch_ndim)` with the loops and manual axes it adds around each one.
_RelativeSite = tuple[_Info, int, tuple[Hashable, ...], int]
_SITES: weakref.WeakKeyDictionary[Jaxpr, dict[frozenset[str], tuple[_RelativeSite, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _relative_sites(jaxpr: Jaxpr | ClosedJaxpr, kinds: frozenset[str]) -> tuple[_RelativeSite, ...]:
    open_jaxpr: Jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    per_kinds = _SITES.setdefault(open_jaxpr, {})
    sites = per_kinds.get(kinds)
    if sites is None:
        sites = per_kinds[kinds] = tuple(_walk(open_jaxpr, kinds))
    return sites


def _walk(jaxpr: Jaxpr, kinds: frozenset[str]) -> Iterator[_RelativeSite]:
    """The sites the handlers below will meet in `jaxpr`: a `scan` or `while` body
    adds a loop level, a `shard_map` body its manual axes; an equation that is not
    control flow goes to the fallback handler, whose checks apply to it. An
    automatic check with no source line of its own takes that of the nearest
    control flow around it that has one (`_located`)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.primitive is _check_p:
            if "user" in kinds:
                yield eqn.params["site"], 0, (), _batch_ndim(eqn)
        elif contains_subjaxprs(None, eqn, []):
            loops = 1 if name in ("scan", "while") else 0
            axes = shard_map_axes(eqn)[1] if name == "shard_map" else ()
            location = _eqn_location(eqn)
            for sub in jaxprs_in_params(eqn.params):
                for info, num_loops, shard_axes, batch_ndim in _relative_sites(sub, kinds):
                    info = _located(info, location)
                    yield info, num_loops + loops, (*axes, *shard_axes), batch_ndim
        elif kinds & automatic_checks:
            for info in _automatic_checks(eqn, kinds, _UNKNOWN):
                yield info, 0, (), 0


def _located(info: _Info, enclosing: str) -> _Info:
    if isinstance(info, _AutoCheck) and info.location == _UNKNOWN:
        return dataclasses.replace(info, location=enclosing)
    return info


def _sites_in(
    jaxprs: Iterable[Jaxpr | ClosedJaxpr],
    num_loops: int,
    shard_axes: tuple[Hashable, ...],
    kinds: frozenset[str],
    enclosing: str,
) -> Iterator[_Site]:
    """The sites of the checks in `jaxprs` and in everything they call, as the
    handlers will see them inside `num_loops` loops and `shard_axes`, and inside
    control flow at `enclosing`."""
    for jaxpr in jaxprs:
        for info, loops, axes, batch_ndim in _relative_sites(jaxpr, kinds):
            yield _Site(
                _located(info, enclosing), num_loops + loops, (*shard_axes, *axes), batch_ndim
            )


# ---------------------------------------------------------------------------
# Control flow.
# ---------------------------------------------------------------------------


def _before_control_flow(ctx: _Ctx, sites: list[_Site]) -> _Ctx:
    """The context a loop or cond starts with: a slot for every check the loop body
    or any branch may reach, so that the context keeps its structure through the
    iterations and is the same out of every branch.

    Inside `shard_map`, the flag and those slots are also made varying over the
    manual axes: a check records its shard's coordinates, so they vary after it,
    and a loop carry or cond output must have the same type everywhere.
    """
    ctx = ctx.with_sites(sites)
    if not ctx.shard_axes:
        return ctx
    axes = ctx.shard_axes
    sites_set = set(sites)
    return dataclasses.replace(
        ctx,
        failed=_varying(ctx.failed, axes),
        slots=tuple(
            jax.tree.map(functools.partial(_varying, axes=axes), slot)
            if slot.site in sites_set
            else slot
            for slot in ctx.slots
        ),
    )


def _varying(value: jax.Array, axes: tuple[Hashable, ...]) -> jax.Array:
    """`value`, cast to vary over those of `axes` it does not vary over yet."""
    varying = varying_axes(value)
    missing = tuple(axis for axis in axes if axis not in varying)
    return lax.pcast(value, missing, to="varying") if missing else value


def _push_loop(ctx: _Ctx, start: int) -> _Ctx:
    return dataclasses.replace(ctx, loops=(*ctx.loops, jnp.asarray(start, jnp.int32)))


def _pop_loop(ctx: _Ctx) -> _Ctx:
    return dataclasses.replace(ctx, loops=ctx.loops[:-1])


def _advance(step: int, carried: _Ctx, new: _Ctx) -> _Ctx:
    """The updater of a loop: the body's context with the loop's counter moved on."""
    return dataclasses.replace(new, loops=(*new.loops[:-1], carried.loops[-1] + step))


def _scan_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    # With reverse=True the counter counts down, so a failure reports the index
    # of the `xs` entry being processed (the same index as the stacked outputs).
    params = eqn.params
    step = -1 if params["reverse"] else 1
    start = params["length"] - 1 if params["reverse"] else 0
    sites = list(
        _sites_in([params["jaxpr"]], len(ctx.loops) + 1, ctx.shard_axes, ctx.kinds, ctx.enclosing)
    )
    ctx = _push_loop(_before_control_flow(ctx, sites), start)
    ctx, outvals = default_scan_handler(
        interpreter, ctx, eqn, invals, updater=functools.partial(_advance, step)
    )
    return HandlerResult(_pop_loop(ctx), outvals)


def _while_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    params = eqn.params
    num_loops = len(ctx.loops) + 1
    condition_sites = list(
        _sites_in([params["cond_jaxpr"]], num_loops, ctx.shard_axes, ctx.kinds, ctx.enclosing)
    )
    body_sites = list(
        _sites_in([params["body_jaxpr"]], num_loops, ctx.shard_axes, ctx.kinds, ctx.enclosing)
    )
    ctx = _push_loop(_before_control_flow(ctx, condition_sites + body_sites), 0)
    if condition_sites:
        ctx, outvals = _while_checking_condition(interpreter, ctx, eqn, invals)
    else:
        ctx, outvals = default_while_handler(
            interpreter, ctx, eqn, invals, updater=functools.partial(_advance, 1)
        )
    return HandlerResult(_pop_loop(ctx), outvals)


def _while_checking_condition(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> tuple[_Ctx, list[Any]]:
    """A `while_loop` whose condition has checks.

    The condition runs before the first iteration and after every one; a check in
    it reports the number of iterations done so far (`iteration 0` for the first
    evaluation). `default_while_handler(thread_condition=True)` runs the condition
    after the body but before the updater, which would report the same iteration
    for the first two evaluations.
    """
    params = eqn.params
    num_cond_consts, num_body_consts = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = invals[:num_cond_consts]
    body_consts = invals[num_cond_consts : num_cond_consts + num_body_consts]
    init = invals[num_cond_consts + num_body_consts :]

    def condition(ctx: _Ctx, carry: Sequence[Any]) -> tuple[Any, _Ctx]:
        (pred,), ctx = interpreter(params["cond_jaxpr"], ctx, *cond_consts, *carry)
        return pred, ctx

    def step(ctx: _Ctx, carry: list[Any]) -> tuple[Any, _Ctx, list[Any]]:
        carry, ctx = interpreter(params["body_jaxpr"], ctx, *body_consts, *carry)
        ctx = _advance(1, ctx, ctx)
        pred, ctx = condition(ctx, carry)
        return pred, ctx, carry

    pred, ctx = condition(ctx, init)
    return while_with_predicate(pred, ctx, list(init), step)


def _cond_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    sites = list(
        _sites_in(eqn.params["branches"], len(ctx.loops), ctx.shard_axes, ctx.kinds, ctx.enclosing)
    )
    ctx = _before_control_flow(ctx, sites)
    return default_cond_handler(interpreter, ctx, eqn, invals)


def _shard_map_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    mesh, manual_axes = shard_map_axes(eqn)
    sizes = tuple(mesh.shape[axis] for axis in manual_axes)
    inner_axes = (*ctx.shard_axes, *manual_axes)
    reduce_ctx = _first_failing_shard(
        manual_axes, sizes, inner_axes, bool(eqn.params.get("check_vma", True))
    )
    inner = dataclasses.replace(ctx, shard_axes=inner_axes, coords=_shard_coords(ctx.coords, sizes))

    def ctx_in_specs(tree: _Ctx) -> _Ctx:
        return dataclasses.replace(jax.tree.map(lambda _: P(), tree), coords=P(*manual_axes, None))

    inner, outvals = default_shard_map_handler(
        interpreter, inner, eqn, invals, declare_ctx_in_specs=ctx_in_specs, reduce_ctx=reduce_ctx
    )
    return HandlerResult(
        dataclasses.replace(inner, shard_axes=ctx.shard_axes, coords=ctx.coords), outvals
    )


def _shard_coords(outer: jax.Array | None, sizes: tuple[int, ...]) -> jax.Array:
    """Every shard's coordinates for a shard_map over manual axes of `sizes`: an
    array of shape `(*sizes, k + len(sizes))` whose row at `(i, j, ...)` is the
    enclosing shard's `k` coordinates followed by `i, j, ...`; sharded over the
    manual axes, each shard gets its own row."""
    grid = jnp.stack(
        jnp.meshgrid(*(jnp.arange(n, dtype=jnp.int32) for n in sizes), indexing="ij"), -1
    )
    if outer is None:
        return grid
    outer = jnp.broadcast_to(outer.reshape(-1), (*sizes, outer.size))
    return jnp.concatenate([outer, grid], -1)


@functools.lru_cache(maxsize=256)
def _first_failing_shard(
    axes: tuple[Hashable, ...],
    sizes: tuple[int, ...],
    all_axes: tuple[Hashable, ...],
    check_vma: bool,
) -> Callable[[_Ctx], _Ctx]:
    """`reduce_ctx` for a shard_map over the manual `axes` of `sizes` (`all_axes`:
    those and the manual axes of enclosing shard_maps): every shard's context replaced by
    that of the first failing shard in mesh order (shard 0's when none failed), so
    that it leaves the shard_map replicated. Cached, so that the framework's body
    cache recognises it.

    One collective: each shard writes its flag and slots, as bytes, into its own
    row of a table that is zero elsewhere, and a `psum` of the table gives every
    shard every row (exactly: one shard adds to each byte). Each shard then picks
    the first failing row itself. The values go in varying over every manual
    axis, which a collective over several axes needs (a value that varies over
    some of them only is an error in JAX 0.10).
    """

    def reduce_ctx(ctx: _Ctx) -> _Ctx:
        slot_leaves, slot_tree = jax.tree.flatten(ctx.slots)
        # Under check_vma, values that do not vary over `axes` are already equal on
        # every shard; without it, types do not say, so every value is reduced.
        reduced = [not check_vma or bool(set(axes) & varying_axes(leaf)) for leaf in slot_leaves]
        picked = [ctx.failed, *(leaf for leaf, r in zip(slot_leaves, reduced) if r)]
        if check_vma:
            picked = [_varying(value, all_axes) for value in picked]
        rows = [_to_bytes(value) for value in picked]
        row = jnp.concatenate(rows)
        table = jnp.zeros((math.prod(sizes), row.shape[0]), jnp.uint8)
        if check_vma:
            table = _varying(table, all_axes)
        # This shard's row: its index over `axes` in mesh order, from its coordinates.
        assert ctx.coords is not None
        own = ctx.coords.reshape(-1)[len(all_axes) - len(axes) :]
        index = sum((own[i] * math.prod(sizes[i + 1 :]) for i in range(len(axes))), jnp.int32(0))
        table = lax.dynamic_update_slice(table, row[None], (index, 0))
        table = lax.psum(table, axes)
        # Row `i` is shard `i` in mesh order; the flag is each row's first byte.
        chosen = table[jnp.argmax(table[:, 0] != 0)]
        offsets = np.cumsum([0, *(r.shape[0] for r in rows)])
        values = iter(
            _from_bytes(chosen[start:stop], value.shape, value.dtype)
            for start, stop, value in zip(offsets[:-1], offsets[1:], picked, strict=True)
        )
        failed = next(values)
        slot_leaves = [next(values) if r else leaf for leaf, r in zip(slot_leaves, reduced)]
        return dataclasses.replace(
            ctx,
            failed=failed,
            slots=jax.tree.unflatten(slot_tree, slot_leaves),
            # Replicated, to leave the body; the caller keeps its own.
            coords=jnp.zeros(ctx.coords.shape, jnp.int32),
        )

    return reduce_ctx


def _to_bytes(value: jax.Array) -> jax.Array:
    """The bytes of `value`, flat (`uint8`)."""
    if value.dtype == jnp.bool_:
        return value.reshape(-1).astype(jnp.uint8)
    if jnp.issubdtype(value.dtype, jnp.complexfloating):
        value = jnp.stack([jnp.real(value), jnp.imag(value)], axis=-1)
    return lax.bitcast_convert_type(value, jnp.uint8).reshape(-1)


def _from_bytes(data: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The inverse of `_to_bytes`: an array of that shape and dtype."""
    if dtype == jnp.bool_:
        return (data != 0).reshape(shape)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = _from_bytes(data, (*shape, 2), jnp.finfo(dtype).dtype)
        return lax.complex(parts[..., 0], parts[..., 1])
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(data, dtype).reshape(shape)
    return lax.bitcast_convert_type(data.reshape(*shape, dtype.itemsize), dtype)


def _scoped(handler: Handler) -> Handler:
    """`handler`, given only the slots of the checks inside the equation.

    Control flow with no check inside is re-bound unchanged, so check-free parts
    of a program compile as they are; otherwise only the slots it may fill enter
    the loop carry, the jit's arguments or the shard_map's reduction. The slots
    keep their order, and new ones come last, as if every slot had gone in (so
    that the branches of a cond still return the same context).
    """

    @functools.wraps(handler)
    def dispatch(
        interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        relative = [
            info
            for jaxpr in jaxprs_in_params(eqn.params)
            for info, *_ in _relative_sites(jaxpr, ctx.kinds)
        ]
        if not relative:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        # Only a body with automatic checks that have no source line of their own
        # needs this equation's: other bodies keep the context as it was, so that a
        # function called from several lines is still interpreted once.
        enclosing = ctx.enclosing
        if any(_located(info, "") != info for info in relative):
            enclosing = _eqn_location(eqn, enclosing)
        inside = {_located(info, enclosing) for info in relative}
        scoped = dataclasses.replace(
            ctx,
            slots=tuple(slot for slot in ctx.slots if slot.site.info in inside),
            enclosing=enclosing,
        )
        scoped, outvals = handler(interpreter, scoped, eqn, invals)
        returned = {slot.site: slot for slot in scoped.slots}
        slots = tuple(returned.pop(slot.site, slot) for slot in ctx.slots)
        return HandlerResult(
            dataclasses.replace(
                scoped, slots=slots + tuple(returned.values()), enclosing=ctx.enclosing
            ),
            outvals,
        )

    return dispatch


def _dispatcher(kinds: frozenset[str]) -> Dispatcher:
    dispatcher = default_dispatcher()
    handlers = {
        **dispatcher.handlers,
        "scan": _scan_handler,
        "while": _while_handler,
        "cond": _cond_handler,
        "shard_map": _shard_map_handler,
    }
    # Control flow with no check inside is re-bound whole (see `_scoped`).
    for name, handler in handlers.items():
        dispatcher.register_handler(name, skip_when_untouched(_scoped(handler)))
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
        interpreter = Interpreter(_dispatcher(kinds), policy=policy, label="kups.checks")
        interpreter.policy_hint = "checked(fn, policy=...)"
        ctx = _Ctx(failed=jnp.zeros((), jnp.bool_), slots=(), loops=(), shard_axes=(), kinds=kinds)
        out, ctx = reinterpret(fn, interpreter)(ctx, *args, **kwargs)
        return out, Error(failed=ctx.failed, slots=ctx.slots)

    return wrapped
