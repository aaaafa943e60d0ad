"""`check` and `checked`: runtime assertions inside jitted programs.

`check(pred, msg, *fmt_args)` records a condition where it runs: inside `jit`,
`scan`, `while_loop`, `cond`/`switch`, `jax.checkpoint`, custom derivatives and
`shard_map`. `checked(fn)` runs `fn` under an interpreter that turns every check
into a few array operations on an error value, which comes back beside `fn`'s
output. Nothing is raised inside the compiled program; the first failure is
reported afterwards, with where it happened.

How it works: the interpreter's context is an error record with a `failed` flag
and one slot per check site (`_Slot`): whether that site failed, the values of
its format arguments at the failing point, the loop iterations and the shard
coordinates. Messages and source lines stay on the Python side, in the
context's static structure. A site's slot starts at zeros; the first failing
check fills its slot and sets `failed`, which masks every later check.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import string
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.interpreters import batching

from kups.effects import (
    Dispatcher,
    Handler,
    HandlerResult,
    Interpreter,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    define_effect,
    reinterpret,
    shard_map_axes,
)

__all__ = ["CheckFailed", "Error", "check", "checked"]

Params = ParamSpec("Params")
Out = TypeVar("Out")

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
    """`str.format` with positional fields only, every argument used, and the
    `str` of numpy scalars for an empty format spec (`'{}'.format(np.float32(0.1))`
    would print the float64 expansion `0.10000000149011612`)."""

    def get_value(self, key: int | str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if isinstance(key, str):
            raise KeyError(
                f"named field {{{key}}}: fmt_args are positional, use {{}} or {{0}} instead"
            )
        if key >= len(args):
            raise IndexError(
                f"the message has a field for argument {key} but only {len(args)} "
                f"fmt_args were given"
            )
        return args[key]

    def check_unused_args(
        self, used_args: set[int | str], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        unused = [i for i in range(len(args)) if i not in used_args]
        if unused:
            raise IndexError(
                f"{len(args)} fmt_args were given but the message does not use "
                f"argument{'s' if len(unused) > 1 else ''} {', '.join(map(str, unused))}"
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

    def __repr__(self) -> str:
        return f"<check {self.msg!r} at {self.location}>"

    def format(self, arrays: Sequence[Any]) -> str:
        """The message formatted with `arrays` for the array format arguments."""
        array_iter, static_iter = iter(arrays), iter(self.statics)
        leaves = [_scalar(next(array_iter)) if a else next(static_iter) for a in self.is_array]
        args = jax.tree.unflatten(self.fmt_tree, leaves)
        return _FORMATTER.format(self.msg, *args)


def _scalar(value: Any) -> Any:
    """A numpy scalar for a 0-d array, so that format specs like `.2f` apply."""
    value = np.asarray(value)
    return value[()] if value.ndim == 0 else value


@dataclasses.dataclass(frozen=True)
class _Site:
    """A check call together with the loops and shard_map axes around it where it
    runs. One slot of the error record belongs to each site."""

    info: _CheckInfo
    num_loops: int
    shard_axes: tuple[Hashable, ...]
    batch_ndim: int


def _caller_location() -> str:
    """`file.py:LINE` of the code that called the function calling this one."""
    frame = sys._getframe(2)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def check(pred: Any, msg: str, *fmt_args: Any) -> None:
    """Asserts `pred` where it runs, even inside `jax.jit` and control flow.

    Under `checked`, a `False` predicate records a failure: `msg.format(*fmt_args)`
    with the values of `fmt_args` at the failing point, and where it happened
    (the loop iterations, the shard, the source line of the `check`). The first
    failure in execution order is kept (between the shards of a `shard_map`, or
    the elements of a `vmap`, which run side by side: the first in mesh or batch
    order). Outside `checked`, `check` does nothing.

    **Arguments:**

    - `pred`: a boolean scalar (a Python `bool` or a `bool[]` array), `True` when
      all is well. Reduce an array condition with `jnp.all`.
    - `msg`: the message, a `str.format` template with positional fields (`{}`,
      `{0}`, `{:.3f}`) for `fmt_args`; write `{{` and `}}` for literal braces.
    - `fmt_args`: pytrees of arrays (and static Python values) for the message's
      fields, one per field.

    **Raises:**

    `TypeError` or `ValueError` (at trace time, naming the message and the line of
    the `check`) for a predicate that is not a boolean scalar, or format
    arguments that do not match the message.

    **Example:**

    ```python
    import jax.numpy as jnp
    from kups.checks import check, checked


    def safe_log(x):
        check(jnp.all(x > 0), "log of a non-positive number: min {}", jnp.min(x))
        return jnp.log(x)


    out, error = checked(safe_log)(jnp.array([1.0, -2.0]))
    assert error.get().startswith("log of a non-positive number: min -2.0")
    ```
    """
    location = _caller_location()
    if not isinstance(msg, str):
        raise TypeError(
            f"check(pred, msg, *fmt_args) at {location}: msg must be a str, got "
            f"{type(msg).__name__}: {msg!r}."
        )
    pred = _predicate(pred, msg, location)
    leaves, fmt_tree = jax.tree.flatten(fmt_args)
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
        raise ValueError(
            f"check({msg!r}) at {location}: the message does not format with its "
            f"{len(fmt_args)} fmt_args ({type(err).__name__}: {err}). Give one positional "
            f"argument per field, e.g. check(x > 0, 'x is {{}}', x)."
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
# The error record: the interpreter's context, and what `checked` returns.
# ---------------------------------------------------------------------------


class _Slot(eqx.Module):
    """What one check site recorded: zeros until it fails, then the values of the
    format arguments, the loop iterations (outermost first) and the shard
    coordinates (one per manual mesh axis) of the first failure."""

    site: _Site = eqx.field(static=True)
    failed: jax.Array
    values: tuple[jax.Array, ...]
    iterations: jax.Array
    shard: jax.Array
    batch: jax.Array

    @staticmethod
    def empty(site: _Site) -> _Slot:
        return _Slot(
            site=site,
            failed=jnp.zeros((), jnp.bool_),
            values=tuple(jnp.zeros(aval.shape, aval.dtype) for aval in site.info.avals),
            iterations=jnp.zeros((site.num_loops,), jnp.int32),
            shard=jnp.zeros((len(site.shard_axes),), jnp.int32),
            batch=jnp.zeros((site.batch_ndim,), jnp.int32),
        )

    def message(self, outer_batch: tuple[int, ...] = ()) -> str:
        """The failure message (the slot must be concrete and failed). `outer_batch`:
        the element of a `vmap` of the whole checked function."""
        site = self.site
        text = site.info.format(list(self.values))
        batch = [*outer_batch, *np.asarray(self.batch).tolist()]
        if batch:
            text += f" at vmap index {batch[0] if len(batch) == 1 else tuple(batch)}"
        iterations = np.asarray(self.iterations).tolist()
        if len(iterations) == 1:
            text += f" at iteration {iterations[0]}"
        elif iterations:
            text += f" at iterations {', '.join(map(str, iterations))} (outermost loop first)"
        if site.shard_axes:
            coordinates = np.asarray(self.shard).tolist()
            text += " on shard " + ", ".join(
                f"{axis}={index}" for axis, index in zip(site.shard_axes, coordinates)
            )
        return f"{text} ({site.info.location})"


class _Ctx(eqx.Module):
    """The interpreter's context: the error record, plus the iteration counters of
    the loops (outermost first) and the manual mesh axes around the current
    equation."""

    failed: jax.Array
    slots: tuple[_Slot, ...]
    loops: tuple[jax.Array, ...]
    shard_axes: tuple[Hashable, ...] = eqx.field(static=True)

    def with_sites(self, sites: Iterable[_Site]) -> _Ctx:
        """This context with an empty slot for each site it has none for."""
        known = {slot.site for slot in self.slots}
        new = tuple(_Slot.empty(site) for site in dict.fromkeys(sites) if site not in known)
        return dataclasses.replace(self, slots=self.slots + new) if new else self


class Error(eqx.Module):
    """What `checked` returns beside the output: the first failed check, if any.

    It is a pytree, so it can be returned from `jax.jit` (and passed through
    `vmap`, `lax.cond`, ...). Read it with `get` or `throw` once it is concrete,
    outside the jitted function.

    **Fields:**

    - `failed`: a `bool[]` array, `True` when a check failed.
    """

    failed: jax.Array
    slots: tuple[_Slot, ...]

    def get(self) -> str | None:
        """The message of the first failed check, or `None` when every check passed.

        The message is the check's `msg` formatted with the values at the failing
        point, then where it failed: `at iteration 3` (0-based; for nested loops
        each level, outermost first), `on shard x=2, y=1` (inside `shard_map`) and
        the source line of the `check`, e.g.
        `"x must be positive, got -1.0 at iteration 3 (model.py:12)"`.

        Under `jax.vmap` (inside the checked function, or of it), the first
        failing element (in row-major order) is reported with `at vmap index i`.

        **Raises:**

        `TypeError` under a JAX trace (inside `jit`): return the error from the
        jitted function and call `get` on the result.
        """
        if self._is_traced():
            raise TypeError(
                "Error.get() needs a concrete error, but this one is traced (it is being "
                "used inside jax.jit or another transformation). Return the Error from "
                "the transformed function and call .get() or .throw() on the result, "
                "outside jit."
            )
        failed = np.asarray(self.failed)
        if not failed.any():
            return None
        # A vmapped checked function returns a batched error: its first failing
        # element (row-major) is reported, with its index.
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(failed)), failed.shape))
        for slot in self.slots:
            element = jax.tree.map(lambda leaf: np.asarray(leaf)[index], slot)
            if element.failed:
                return element.message(outer_batch=index)
        raise AssertionError("kups.checks: the error is failed but no check site failed.")

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
# Handlers.
# ---------------------------------------------------------------------------


def _check_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    del interpreter
    pred, *values = invals
    site = _site(eqn, len(ctx.loops), ctx.shard_axes)
    ctx = ctx.with_sites([site])
    batch = jnp.zeros((0,), jnp.int32)
    if site.batch_ndim:  # under vmap (see `_batch_check`): the first failing element
        first = jnp.argmin(pred.reshape(-1))
        values = [value.reshape(-1, *value.shape[site.batch_ndim :])[first] for value in values]
        batch = jnp.stack(jnp.unravel_index(first, pred.shape)).astype(jnp.int32)
        pred = jnp.all(pred)
    fails = jnp.logical_and(jnp.logical_not(pred), jnp.logical_not(ctx.failed))
    iterations = jnp.stack(ctx.loops) if ctx.loops else jnp.zeros((0,), jnp.int32)
    shard = (
        jnp.stack([lax.axis_index(axis) for axis in ctx.shard_axes])
        if ctx.shard_axes
        else jnp.zeros((0,), jnp.int32)
    )

    def record(slot: _Slot) -> _Slot:
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

    ctx = dataclasses.replace(
        ctx,
        failed=jnp.logical_or(ctx.failed, fails),
        slots=tuple(record(slot) for slot in ctx.slots),
    )
    return HandlerResult(ctx, list(invals))


def _select(pred: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """`new` where `pred`, else `old`. Not `jnp.where`: on an empty array (JAX 0.10.2)
    it returns an operand without joining the varying manual axes, which breaks a
    loop carry inside shard_map."""
    return lax.select(jnp.broadcast_to(pred, old.shape), new, old)


def _site(eqn: JaxprEqn, num_loops: int, shard_axes: tuple[Hashable, ...]) -> _Site:
    pred_aval: Any = eqn.invars[0].aval
    batch_ndim = pred_aval.ndim  # the predicate is a scalar but for vmap axes
    return _Site(eqn.params["site"], num_loops, shard_axes, batch_ndim)


def _sites_in(
    jaxprs: Iterable[Jaxpr | ClosedJaxpr], num_loops: int, shard_axes: tuple[Hashable, ...]
) -> Iterator[_Site]:
    """The sites of the checks in `jaxprs` and in everything they call, as the
    handlers below will see them: a `scan` or `while` body adds a loop level, a
    `shard_map` body its manual axes."""
    for jaxpr in jaxprs:
        if isinstance(jaxpr, ClosedJaxpr):
            jaxpr = jaxpr.jaxpr
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if eqn.primitive is _check_p:
                yield _site(eqn, num_loops, shard_axes)
            elif name in ("scan", "while"):
                yield from _sites_in(jaxprs_in_params(eqn.params), num_loops + 1, shard_axes)
            elif name == "shard_map":
                _, manual_axes = shard_map_axes(eqn)
                inner_axes = (*shard_axes, *manual_axes)
                yield from _sites_in(jaxprs_in_params(eqn.params), num_loops, inner_axes)
            else:
                yield from _sites_in(jaxprs_in_params(eqn.params), num_loops, shard_axes)


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
    varying = jax.typeof(value).manual_axis_type.varying
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
    sites = list(_sites_in([params["jaxpr"]], len(ctx.loops) + 1, ctx.shard_axes))
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
    condition_sites = list(_sites_in([params["cond_jaxpr"]], num_loops, ctx.shard_axes))
    body_sites = list(_sites_in([params["body_jaxpr"]], num_loops, ctx.shard_axes))
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

    def body(state: tuple[Any, _Ctx, list[Any]]) -> tuple[Any, _Ctx, list[Any]]:
        _, ctx, carry = state
        carry, ctx = interpreter(params["body_jaxpr"], ctx, *body_consts, *carry)
        ctx = _advance(1, ctx, ctx)
        pred, ctx = condition(ctx, carry)
        return pred, ctx, carry

    pred, ctx = condition(ctx, init)
    _, ctx, outvals = lax.while_loop(lambda state: state[0], body, (pred, ctx, list(init)))
    return ctx, list(outvals)


def _cond_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    sites = list(_sites_in(eqn.params["branches"], len(ctx.loops), ctx.shard_axes))
    ctx = _before_control_flow(ctx, sites)
    return default_cond_handler(interpreter, ctx, eqn, invals)


def _shard_map_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    mesh, manual_axes = shard_map_axes(eqn)
    num_shards = math.prod(mesh.shape[axis] for axis in manual_axes)
    reduce_ctx = functools.partial(
        _first_failing_shard, manual_axes, num_shards, eqn.params["check_vma"]
    )
    inner = dataclasses.replace(ctx, shard_axes=(*ctx.shard_axes, *manual_axes))
    inner, outvals = default_shard_map_handler(
        interpreter, inner, eqn, invals, reduce_ctx=reduce_ctx
    )
    return HandlerResult(dataclasses.replace(inner, shard_axes=ctx.shard_axes), outvals)


def _first_failing_shard(
    axes: tuple[Hashable, ...], num_shards: int, check_vma: bool, ctx: _Ctx
) -> _Ctx:
    """Every shard's context replaced by that of the first failing shard in mesh
    order (shard 0's when none failed), so that it leaves the shard_map replicated.

    The chosen shard's values are selected with a `psum` of values masked to that
    shard, which is exact and gives values replicated over `axes`.
    """
    shard = lax.axis_index(axes)
    first = lax.pmin(jnp.where(ctx.failed, shard, num_shards), axes)
    chosen = jnp.where(first == num_shards, 0, first)
    mine = shard == chosen

    def select(value: jax.Array) -> jax.Array:
        # Under check_vma, values that do not vary over `axes` are already equal on
        # every shard; without it, types do not say, so every value is reduced.
        if check_vma and not set(axes) & jax.typeof(value).manual_axis_type.varying:
            return value
        if value.dtype == jnp.bool_:
            masked = jnp.where(mine, value, False).astype(jnp.int32)
            return lax.psum(masked, axes).astype(jnp.bool_)
        return lax.psum(jnp.where(mine, value, jnp.zeros_like(value)), axes)

    return jax.tree.map(select, ctx)


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
        inside = {site.info for site in _sites_in(jaxprs_in_params(eqn.params), 0, ())}
        if not inside:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        scoped = dataclasses.replace(
            ctx, slots=tuple(slot for slot in ctx.slots if slot.site.info in inside)
        )
        scoped, outvals = handler(interpreter, scoped, eqn, invals)
        returned = {slot.site: slot for slot in scoped.slots}
        slots = tuple(returned.pop(slot.site, slot) for slot in ctx.slots)
        return HandlerResult(
            dataclasses.replace(scoped, slots=slots + tuple(returned.values())), outvals
        )

    return dispatch


def _dispatcher() -> Dispatcher:
    dispatcher = default_dispatcher()
    handlers = {
        **dispatcher.handlers,
        "scan": _scan_handler,
        "while": _while_handler,
        "cond": _cond_handler,
        "shard_map": _shard_map_handler,
    }
    for name, handler in handlers.items():
        dispatcher.register_handler(name, _scoped(handler))
    return dispatcher.register_handler(_check_p, _check_handler)


def checked(fn: Callable[Params, Out]) -> Callable[Params, tuple[Out, Error]]:
    """Runs `fn` with its `check`s recorded, and returns the first failure.

    The checks anywhere in `fn` (also inside `jit`, `scan`, `fori_loop`,
    `while_loop`, `cond`/`switch`, `jax.checkpoint`, `custom_jvp`/`custom_vjp`
    and `shard_map`) are evaluated as part of the program. The wrapped function
    can itself be jitted, with the `Error` returned from the jitted function.

    Where a failure happened: the iteration of each enclosing `scan` or
    `while_loop` (0-based, the number of iterations done before it; with
    `scan(reverse=True)` the index of the `xs` entry, like the stacked outputs),
    and inside `shard_map` the coordinates of the shard on the manual mesh axes.
    When several shards fail, the first one in mesh order is reported.

    **Arguments:**

    - `fn`: the function to run. Arguments that are not arrays are static, as in
      `equinox.filter_jit`.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, error)`: `fn`'s output and an `Error`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.checks import CheckFailed, check, checked


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
    ```
    """
    if not callable(fn):
        raise TypeError(f"checked(fn) needs a callable, got {type(fn).__name__}: {fn!r}.")

    @functools.wraps(fn)
    def wrapped(*args: Params.args, **kwargs: Params.kwargs) -> tuple[Out, Error]:
        interpreter = Interpreter(_dispatcher(), label="kups.checks")
        ctx = _Ctx(failed=jnp.zeros((), jnp.bool_), slots=(), loops=(), shard_axes=())
        out, ctx = reinterpret(fn, interpreter)(ctx, *args, **kwargs)
        return out, Error(failed=ctx.failed, slots=ctx.slots)

    return wrapped
