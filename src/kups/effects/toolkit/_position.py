"""Where an equation runs: the iteration of every enclosing loop and the shard.

`Position` is a context component; `track_position` wraps the control-flow
handlers so that it stays right through `scan`, `while`, `cond` and `shard_map`.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Jaxpr, JaxprEqn
from jax.sharding import PartitionSpec as P

from .._equations import shard_map_axes, varying_axes
from .._matching import sub_jaxprs
from .._types import HandlerResult
from ._source import source_of

Handler = Callable[..., HandlerResult]


class ShardLevel(NamedTuple):
    """The manual axes one `shard_map` adds: names and sizes in mesh order, and
    whether JAX checks the values' varying manual axes (`check_vma`)."""

    axes: tuple[Hashable, ...]
    sizes: tuple[int, ...]
    check_vma: bool


class Position(eqx.Module):
    """Where the current equation runs, as a context component.

    Put one in your context (a field named `position`, by default) and wrap your
    control-flow handlers with `track_position`; then a handler reads:

    - `iteration`: an `int32[depth]` array, one index per enclosing loop,
      outermost first. A `scan` counts the index of its `xs` entry (entry `i`
      belongs to `xs[i]`, like the scan's stacked outputs, also for
      `reverse=True`); a `while_loop` (and a `fori_loop` that JAX turned into
      one) its 0-based trip number.
    - `shard`: the coordinates of this shard on the manual mesh axes of the
      enclosing `shard_map`s (`shard_axes`, mesh order), an `int32` array, or
      `None` outside `shard_map`.
    - `enclosing`: `"file.py:LINE"` of the innermost control flow around the
      equation, the fallback of `source_of`.

    **Arguments:**

    None: `Position()` is the position outside every loop and `shard_map`.

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from kups.effects import HandlerResult, Interpreter, default_dispatcher, define_effect
    from kups.effects import default_scan_handler, reinterpret
    from kups.effects.toolkit import Position, track_position

    where_p = define_effect("doc_where")


    class Ctx(eqx.Module):
        position: Position
        seen: jax.Array


    def record(interpreter, ctx, eqn, invals):
        seen = ctx.position.iteration if ctx.position.depth else ctx.seen
        return HandlerResult(Ctx(ctx.position, seen), list(invals))


    dispatcher = default_dispatcher().register_handler(where_p, record)
    dispatcher.register_handler("scan", track_position(default_scan_handler))


    def f(xs):
        return jax.lax.scan(lambda c, x: (c + where_p.bind(x)[0], None), 0.0, xs)[0]


    _, ctx = reinterpret(f, Interpreter(dispatcher))(
        Ctx(Position(), jnp.zeros(1, jnp.int32)), jnp.ones(4)
    )
    assert ctx.seen.tolist() == [3]  # the last iteration that ran
    ```
    """

    loops: tuple[jax.Array, ...] = ()
    coords: jax.Array | None = None
    levels: tuple[ShardLevel, ...] = eqx.field(static=True, default=())
    enclosing: str | None = eqx.field(static=True, default=None)

    @property
    def depth(self) -> int:
        """How many loops enclose the equation."""
        return len(self.loops)

    @property
    def iteration(self) -> jax.Array:
        """`int32[depth]`: the iteration of each enclosing loop, outermost first."""
        if not self.loops:
            return jnp.zeros((0,), jnp.int32)
        return jnp.stack([jnp.asarray(i, jnp.int32) for i in self.loops])

    @property
    def shard_axes(self) -> tuple[Hashable, ...]:
        """The manual mesh axes around the equation, outermost `shard_map` first."""
        return tuple(axis for level in self.levels for axis in level.axes)

    @property
    def shard(self) -> jax.Array | None:
        """`int32[len(shard_axes)]`: this shard's coordinates, or `None`."""
        if self.coords is None:
            return None
        return self.coords.reshape(len(self.shard_axes))

    def vary(self, tree: Any) -> Any:
        """`tree` with every array cast to vary over all manual axes around it.

        A value that a shard records (its coordinates, what failed there) differs
        between shards; a loop carry or a `cond` output that holds it must be
        typed as varying from the start (JAX checks it under `check_vma=True`).

        **Arguments:**

        - `tree`: a pytree of arrays.

        **Returns:**

        The same pytree, each array varying over `shard_axes` (unchanged outside
        `shard_map`).
        """
        axes = self.shard_axes
        if not axes:
            return tree

        def cast(value: Any) -> Any:
            varying = varying_axes(value)
            missing = tuple(axis for axis in axes if axis not in varying)
            return lax.pcast(value, missing, to="varying") if missing else value

        return jax.tree.map(cast, tree)


def _get(ctx: Any, field: str) -> Position:
    return ctx[field] if isinstance(ctx, dict) else getattr(ctx, field)


def _put(ctx: Any, field: str, value: Any) -> Any:
    if isinstance(ctx, dict):
        return {**ctx, field: value}
    if hasattr(ctx, "_replace"):
        return ctx._replace(**{field: value})
    return dataclasses.replace(ctx, **{field: value})


def _shard_coords(outer: jax.Array | None, sizes: tuple[int, ...]) -> jax.Array:
    """Every shard's coordinates, an array of shape `(*sizes, k + len(sizes))`
    whose row at `(i, j, ...)` is the enclosing shard's `k` coordinates followed by
    `i, j, ...`; sharded over the manual axes, each shard gets its own row. Handed
    in rather than read by `axis_index`, which JAX before 0.10.2 cannot lower for
    the axis of an enclosing shard_map inside a nested one."""
    grid = jnp.stack(
        jnp.meshgrid(*(jnp.arange(n, dtype=jnp.int32) for n in sizes), indexing="ij"), -1
    )
    if outer is None:
        return grid
    outer = jnp.broadcast_to(outer.reshape(-1), (*sizes, outer.size))
    return jnp.concatenate([outer, grid], -1)


_FRAMELESS: weakref.WeakKeyDictionary[Jaxpr, bool] = weakref.WeakKeyDictionary()


def _has_frameless(jaxpr: Jaxpr) -> bool:
    """Whether an equation in `jaxpr` (or deeper) has no user source line, so that
    `source_of` falls back to the enclosing one there. Cached per jaxpr."""
    found = _FRAMELESS.get(jaxpr)
    if found is None:
        found = _FRAMELESS[jaxpr] = any(
            source_of(eqn) is None or any(map(_has_frameless, sub_jaxprs(eqn)))
            for eqn in jaxpr.eqns
        )
    return found


@functools.lru_cache(maxsize=512)
def _advance(field: str, step: int, updater: Callable[[Any, Any], Any] | None) -> Any:
    """The loop updater: the effect's own, then the innermost counter moved on.
    Cached, so that the framework's body cache recognises it."""

    def update(carried: Any, new: Any) -> Any:
        ctx = new if updater is None else updater(carried, new)
        before, after = _get(carried, field), _get(ctx, field)
        loops = (*after.loops[:-1], before.loops[-1] + step)
        return _put(ctx, field, dataclasses.replace(after, loops=loops))

    return update


def _position_specs(field: str, tree: Any, spec: Any) -> Any:
    """`spec` (a context's specs, or one for all its leaves) as a tree whose
    `Position` is one spec per leaf: one `PartitionSpec` given for the whole
    position is given to each of its leaves."""
    if isinstance(spec, P):
        spec = jax.tree.map(lambda _: spec, tree)
    position = _get(spec, field)
    if isinstance(position, P):
        spec = _put(spec, field, jax.tree.map(lambda _: position, _get(tree, field)))
    return spec


@functools.lru_cache(maxsize=512)
def _in_specs(field: str, manual: tuple[Hashable, ...], declare: Any) -> Any:
    def specs(tree: Any) -> Any:
        spec = _position_specs(field, tree, P() if declare is None else declare(tree))
        position = _get(spec, field)
        return _put(spec, field, dataclasses.replace(position, coords=P(*manual, None)))

    return specs


@functools.lru_cache(maxsize=512)
def _out_specs(field: str, declare: Any) -> Any:
    if declare is None:
        return None

    def specs(tree: Any) -> Any:
        return _position_specs(field, tree, declare(tree))

    return specs


@functools.lru_cache(maxsize=512)
def _leaving(field: str, reduce: Any) -> Any:
    def reduce_ctx(ctx: Any) -> Any:
        ctx = ctx if reduce is None else reduce(ctx)
        position = _get(ctx, field)
        assert position.coords is not None
        # Replicated, to leave the body; the caller restores its own.
        coords = jnp.zeros(position.coords.shape, jnp.int32)
        return _put(ctx, field, dataclasses.replace(position, coords=coords))

    return reduce_ctx


def track_position(handler: Handler, *, field: str = "position", varying: bool = False) -> Handler:
    """`handler`, with the context's `Position` kept right inside the equation.

    Wrap the handler of each control-flow primitive (`scan`, `while`, `cond`,
    `shard_map`, `jit`, ...). Inside the equation the position's `enclosing`
    is the equation's source line (where an equation inside has none of its
    own); a `scan` or `while` adds a loop counter that
    advances after every iteration; a `shard_map` adds its manual axes and hands
    each shard its coordinates. Afterwards the position is the one before.

    The wrapper takes the loop and shard_map options of the handlers it wraps
    and composes its own with them: a given `updater=` runs before the counter
    moves on, a given `reduce_ctx=` runs inside the body with the shard's
    position still there, `declare_ctx_in_specs=` and `declare_ctx_out_specs=`
    are kept for the rest of the context (a spec tree may give the position one
    `PartitionSpec`, `P()`, for all its leaves). So the wrapped handler must take
    `updater=` (for loops) and `declare_ctx_in_specs=`, `declare_ctx_out_specs=`,
    `reduce_ctx=` (for `shard_map`), like the default handlers.

    **Arguments:**

    - `handler`: a handler, such as `default_scan_handler` or your own one that
      calls it.
    - `field`: the name of the context's `Position` (an attribute of a
      dataclass, `equinox.Module` or `NamedTuple`, or a key of a dict).
    - `varying`: inside `shard_map`, cast the rest of the context to vary over
      the manual axes before a loop or `cond` (`Position.vary`), for an effect
      that records per-shard values there (a loop carry must keep its type).

    **Returns:**

    A handler.

    **Example:**

    ```python
    from kups.effects import default_dispatcher
    from kups.effects.toolkit import track_position

    dispatcher = default_dispatcher()
    for name in ("scan", "while", "cond", "shard_map", "jit"):
        dispatcher.register_handler(name, track_position(dispatcher.handlers[name]))
    ```
    """

    @functools.wraps(handler)
    def tracked(
        interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any], **options: Any
    ) -> Any:
        name = eqn.primitive.name
        before: Position = _get(ctx, field)
        inside = before
        # Only a body that needs it gets the equation's line as its fallback: the
        # position is part of the context's structure, and a function called
        # from several lines is then still interpreted once.
        if any(map(_has_frameless, sub_jaxprs(eqn))):
            inside = dataclasses.replace(before, enclosing=source_of(eqn, before.enclosing))
        if name in ("scan", "while"):
            reverse = name == "scan" and eqn.params["reverse"]
            start = eqn.params["length"] - 1 if reverse else 0
            inside = dataclasses.replace(inside, loops=(*inside.loops, jnp.int32(start)))
            options["updater"] = _advance(field, -1 if reverse else 1, options.get("updater"))
        elif name == "shard_map":
            mesh, manual = shard_map_axes(eqn)
            sizes = tuple(int(mesh.shape[axis]) for axis in manual)
            level = ShardLevel(manual, sizes, bool(eqn.params.get("check_vma", True)))
            inside = dataclasses.replace(
                inside,
                levels=(*inside.levels, level),
                coords=_shard_coords(inside.coords, sizes),
            )
            options["declare_ctx_in_specs"] = _in_specs(
                field, manual, options.get("declare_ctx_in_specs")
            )
            options["reduce_ctx"] = _leaving(field, options.get("reduce_ctx"))
            out_specs = _out_specs(field, options.get("declare_ctx_out_specs"))
            if out_specs is not None:
                options["declare_ctx_out_specs"] = out_specs
        if varying and name in ("scan", "while", "cond") and inside.levels:
            ctx = inside.vary(_put(ctx, field, None))
        ctx, outvals = handler(interpreter, _put(ctx, field, inside), eqn, invals, **options)
        return HandlerResult(_put(ctx, field, before), outvals)

    return tracked
