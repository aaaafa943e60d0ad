"""The walk shared by `find_nans(report="first")` and `nan_sites`: every equation
that is not control flow is re-bound and its floating outputs checked (unless all
its inputs are constants of the program); what a check finds goes to a
*recorder*, which keeps what its report needs.

The context (`_State`) holds the recorder's `record` and the toolkit's
`Position` (loop iterations, shard coordinates), kept by `track_position`. A
`shard_map` body starts with an empty record; the recorder combines the shards'
records before they leave, and the body's record with the one from before.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn

from kups.effects import (
    Dispatcher,
    HandlerResult,
    InterpreterPolicy,
    Position,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reinterpret,
    shard_map_axes,
    sub_jaxprs,
    track_position,
)

from ._constants import (
    _CALLS,
    _FramingInterpreter,
    _in_frame,
    _is_constant,
)
from ._flags import (
    _PLAIN_CALLS,
    _across_collective,
    _Carried,
    _Check,
    _flags,
    _held_flag,
    _held_through,
    _inherited,
    _known,
    _moves_data,
    _passes_through,
)
from ._meshes import mesh_of, on_mesh
from ._position import _loop_depth
from ._sites import _is_float, _located, _Scope, _Sites

_KINDS = ("nan", "inf")


def _check_kinds(kinds: Any, entry: str) -> tuple[str, ...]:
    """`kinds` in the canonical order, or a clear error."""
    chosen = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not chosen or any(kind not in _KINDS for kind in chosen):
        raise ValueError(
            f"{entry}(fn, kinds={kinds!r}): kinds is a non-empty tuple of 'nan' and 'inf', "
            f"such as ('nan',) to watch NaNs only, or ('nan', 'inf') for both."
        )
    return tuple(kind for kind in _KINDS if kind in chosen)


class _Recorder(Protocol):
    """What a report keeps of the checks (`record` is a pytree of arrays).

    `made_only`: whether a check reports only what the equation made itself (not
    a NaN/Inf that one of its inputs already held). `batched`: whether the walk
    gives it the checks of each run of a jaxpr at once (`record_many`), at the
    end of the jaxpr or before a loop or `shard_map` in it.
    """

    made_only: bool
    batched: bool

    def start(self, jaxpr: Jaxpr, depth: int) -> Any:
        """The empty record of a program `jaxpr` whose loops nest `depth` deep."""
        ...

    def empty(self, record: Any) -> Any:
        """An empty record shaped like `record` (a `shard_map` body's start)."""
        ...

    def record(self, record: Any, site: int, flags: dict[str, Any], stamp: Any) -> Any:
        """`record` after a check of `site` found `flags` (kind to traced bool), at
        `stamp`: `[shard, iteration of each loop...]` (see `_stamp`)."""
        ...

    def record_many(self, record: Any, checks: list[_Check]) -> Any:
        """`record` after the checks of one run of a jaxpr, all at once (for a
        `batched` recorder, whose `record` the walk does not call)."""
        ...

    def reduce(self, record: Any, position: Position, own: Any, manual: tuple[Any, ...]) -> Any:
        """Every shard's `record` combined over the `manual` axes (the same result on
        every shard); `position` is the shard's, `own` its index in the mesh."""
        ...

    def merge(self, outer: Any, inner: Any) -> Any:
        """The record from before a `shard_map` with the one its body made."""
        ...

    def settle(self, record: Any, jaxpr: Jaxpr, stamp: Any) -> Any:
        """`record` at the end of `jaxpr`, a program, a loop body or a `shard_map`
        body (where the stamp changes next), whose equations ran at `stamp`."""
        ...


class _State(NamedTuple):
    """The context of the walk.

    - `record`: the recorder's record (`None` until the program's jaxpr is seen).
    - `position`: the loop iterations and shard of the current equation.
    - `scope`: static facts about where the current equation is (`_Scope`).
    - `carried`: what a loop, a `cond` or a call hands its body (`_Carried`), else
      `None`.
    """

    record: Any
    position: Position
    scope: _Scope
    carried: _Carried | None = None


def _initial_state() -> _State:
    return _State(record=None, position=Position(), scope=_Scope())


class _WalkInterpreter(_FramingInterpreter):
    """Starts the record when it meets the program's jaxpr."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        recorder: _Recorder,
        kinds: tuple[str, ...],
        policy: InterpreterPolicy,
        label: str,
    ) -> None:
        super().__init__(
            dispatcher, policy=policy, label=label, policy_hint=f"{label}(fn, policy=...)"
        )
        self.recorder = recorder
        self.kinds = kinds
        self.depth = 0
        # Per jaxpr being run: whether a variable held a watched NaN/Inf (a traced
        # bool), for recorders that count only what an equation made itself.
        self.held: list[dict[Any, Any]] = []
        # Per jaxpr being run, for a recorder that takes its checks in batches:
        # the checks not yet in the record.
        self.pending: list[list[_Check]] = []
        # Per jaxpr being run: its loop depth and shard_map nesting, which change
        # at the jaxprs whose end the recorder settles.
        self.levels: list[tuple[int, int] | None] = []
        # `_stamp`'s cache: by the ids of the shard coordinates and counters it was
        # made of, and the mesh in effect.
        self.stamps: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Any, ctx: Any, args: Any
    ) -> tuple[list[Any], Any]:
        if isinstance(ctx, _State) and ctx.record is None:
            self.depth = _loop_depth(jaxpr)
            # Typed for the mesh the checks will be, when the program is on one.
            mesh = mesh_of(v.aval for v in (*jaxpr.invars, *jaxpr.outvars))
            record = on_mesh(self.recorder.start(jaxpr, self.depth), mesh)
            ctx = ctx._replace(record=record)
        level = (ctx.position.depth, len(ctx.position.levels)) if isinstance(ctx, _State) else None
        settle = level is not None and (not self.levels or self.levels[-1] != level)
        carried = ctx.carried if isinstance(ctx, _State) else None
        held: dict[Any, Any] = {}
        if carried is not None:
            ctx = ctx._replace(carried=None)
            start = carried.start(jaxpr)
            for var, flag in zip(jaxpr.invars[start:], carried.flags, strict=False):
                if flag is not None:
                    held[var] = flag
        self.held.append(held)
        self.levels.append(level)
        self.pending.append([])
        # The stamps made while it runs are values of its trace: dropped after it.
        stamps = self.stamps
        self.stamps = dict(stamps)
        try:
            outs, ctx = super().interpret_jaxpr(jaxpr, consts, ctx, args)
            handed = (
                carried is not None and not carried.loop and carried.back and self.recorder.batched
            )
            if not handed:
                ctx = self.flush(ctx)
            if carried is not None and carried.loop and not carried.gives_back(jaxpr):
                # A while loop's condition: the flags stay those of the carries.
                ctx = ctx._replace(carried=carried)
            elif carried is not None and carried.loop:
                flags = tuple(
                    None if flag is None else _held_flag(held, var, value, self.kinds)
                    for var, value, flag in zip(jaxpr.outvars, outs, carried.flags, strict=False)
                )
                ctx = ctx._replace(carried=_Carried(carried.offset, flags, body=carried.body))
            elif carried is not None and carried.back:
                known = tuple(_known(held, v) for v in jaxpr.outvars)
                # A call's last checks are recorded with the caller's: one update
                # of the record, not one per call.
                checks = tuple(self.pending[-1]) if handed else ()
                ctx = ctx._replace(carried=_Carried(0, known, loop=False, checks=checks))
            if settle and ctx.record is not None:
                stamp = _stamp(self, ctx)
                ctx = ctx._replace(record=self.recorder.settle(ctx.record, jaxpr, stamp))
        finally:
            self.held.pop()
            self.levels.pop()
            self.pending.pop()
            self.stamps = stamps
        return outs, ctx

    def flush(self, ctx: Any) -> Any:
        """`ctx` with the pending checks of the current jaxpr in its record."""
        checks = self.pending[-1] if self.pending else None
        if not checks or not isinstance(ctx, _State) or ctx.record is None:
            return ctx
        record = self.recorder.record_many(ctx.record, list(checks))
        checks.clear()
        return ctx._replace(record=record)


def _stamp(interpreter: Any, state: _State) -> Any:
    """`[shard, iteration of each loop...]` of the current equation, padded with -1
    to the program's loop depth: computed once per shard and loop counters
    (they change only at loop and `shard_map` boundaries)."""
    position = state.position
    if position.coords is None and not position.depth:
        # Outside loops and shard_map: a constant (no value to cache it by).
        return np.array([0] + [-1] * interpreter.depth, np.int32)
    key = (position.coords, *position.loops)
    # Made inside an `auto_axes` / `explicit_axes` region, it is typed for the
    # region's mesh: one per mesh in effect.
    index = (*map(id, key), jax.sharding.get_abstract_mesh())
    cached = interpreter.stamps.get(index)
    if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
        return cached[1]
    padding = [np.int32(-1)] * (interpreter.depth - position.depth)
    here = _mesh_index(position, state.scope.mesh_axes)
    parts = [jax.lax.reshape(jnp.asarray(v, jnp.int32), (1,)) for v in (here, *position.loops)]
    parts += [np.full((len(padding),), -1, np.int32)] if padding else []
    stamp = jax.lax.concatenate(parts, 0)
    interpreter.stamps[index] = (key, stamp)
    return stamp


def _mesh_index(position: Position, mesh_axes: tuple[tuple[Any, int], ...]) -> Any:
    """The shard's row-major index in the whole mesh (coordinate 0 along axes that
    are not manual around it; 0 outside `shard_map`): its place in mesh order."""
    shard = position.shard
    if shard is None:
        return jnp.int32(0)
    strides, stride = {}, 1
    for name, size in reversed(mesh_axes):
        strides[name] = stride
        stride *= size
    weights = np.array([strides[axis] for axis in position.shard_axes], np.int32)
    return jnp.sum(shard * weights, dtype=jnp.int32)


def _check_equation(
    sites: _Sites,
    kinds: tuple[str, ...],
    interpreter: Any,
    state: _State,
    eqn: JaxprEqn,
    invals: list[Any],
) -> HandlerResult:
    """The fallback handler: re-binds the equation and checks its float outputs,
    unless they are constants of the program (see `_constant_equations`)."""
    outvals = default_primitive_handler(interpreter, state, eqn, invals).outvals
    floats = [value for value in outvals if _is_float(value)]
    if not floats or _is_constant(state.scope.frame, eqn):
        return HandlerResult(state, outvals)
    made_only = interpreter.recorder.made_only
    if made_only and interpreter.held and _passes_through(interpreter, state, eqn, invals):
        return HandlerResult(state, outvals)
    if _moves_data(state, eqn):
        return HandlerResult(state, outvals)
    site = sites.add(eqn, state)
    flags, held = _flags(floats, kinds, exact=made_only, either=made_only)
    inherited: tuple[Any, ...] = ()
    if made_only:
        inherited = _inherited(interpreter, state, eqn, invals, held, kinds)
        if state.scope.manual_axes:
            inherited = _across_collective(eqn, inherited)
    if interpreter.recorder.batched:
        # The recorder masks the flags of a whole run at once.
        interpreter.pending[-1].append(_Check(site, flags, inherited))
        return HandlerResult(state, outvals)
    if inherited:
        fresh = jax.lax.bitwise_not(functools.reduce(jax.lax.bitwise_or, inherited))
        flags = {kind: jax.lax.bitwise_and(flag, fresh) for kind, flag in flags.items()}
    record = interpreter.recorder.record(state.record, site, flags, _stamp(interpreter, state))
    return HandlerResult(state._replace(record=record), outvals)


@functools.lru_cache(maxsize=64)
def _reduce_shards(
    recorder: _Recorder, manual: tuple[Any, ...], leaving: Callable[[_State], _State]
) -> Callable[[_State], _State]:
    """`reduce_ctx` of a `shard_map`: the shards' records combined, then
    `leaving` (the position's own). Cached so that the framework's body cache
    recognises it."""

    def reduce_ctx(state: _State) -> _State:
        own = _mesh_index(state.position, state.scope.mesh_axes)
        return leaving(
            state._replace(record=recorder.reduce(state.record, state.position, own, manual))
        )

    return reduce_ctx


def _check_shard_map(
    interpreter: Any,
    state: _State,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    declare_ctx_in_specs: Any,
    reduce_ctx: Any,
) -> HandlerResult:
    """The body starts with an empty record; the shards' records, combined, are
    merged with the one from before. Wrapped by `track_position`, which gives
    the options that hand each shard its coordinates."""
    recorder = interpreter.recorder
    mesh, manual = shard_map_axes(eqn)
    sizes = dict(mesh.shape)
    mesh_axes = tuple((name, sizes[name]) for name in mesh.axis_names)
    names = {name for name, _ in state.scope.manual_axes} | set(manual)
    scope_axes = tuple((name, size) for name, size in mesh_axes if name in names)
    inner = state._replace(
        record=recorder.empty(state.record),
        scope=dataclasses.replace(state.scope, manual_axes=scope_axes, mesh_axes=mesh_axes),
    )
    result = default_shard_map_handler(
        interpreter,
        inner,
        eqn,
        invals,
        declare_ctx_in_specs=declare_ctx_in_specs,
        reduce_ctx=_reduce_shards(recorder, manual, reduce_ctx),
    )
    merged = state._replace(record=recorder.merge(state.record, result.ctx.record))
    return HandlerResult(merged, result.outvals)


def _settled_before(handler: Any) -> Any:
    """`handler` of a loop or a `shard_map`, whose body the walk settles with
    stamps of its own: what the checks before it found is settled first, with
    the stamp it was found at (not the body's)."""

    def settled(interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]) -> Any:
        state = interpreter.flush(state)
        if isinstance(state, _State) and state.record is not None:
            body = sub_jaxprs(eqn)[-1]
            body = getattr(body, "jaxpr", body)
            record = interpreter.recorder.settle(state.record, body, _stamp(interpreter, state))
            state = state._replace(record=record)
        return handler(interpreter, state, eqn, invals)

    return settled


def _dispatcher(sites: _Sites, kinds: tuple[str, ...]) -> Dispatcher:
    dispatcher = (
        default_dispatcher()
        .register_handler(
            "scan", _held_through(_settled_before(track_position(default_scan_handler)))
        )
        .register_handler(
            "while",
            _held_through(
                _settled_before(
                    track_position(functools.partial(default_while_handler, thread_condition=True))
                )
            ),
        )
        .register_handler("shard_map", _settled_before(track_position(_check_shard_map)))
        .register_fallback_handler(functools.partial(_check_equation, sites, kinds))
    )
    for name, handler in dispatcher.handlers.items():
        if name in _CALLS:
            handler = _in_frame(handler)
        if name in _PLAIN_CALLS or name == "cond":
            handler = _held_through(handler)
        dispatcher.register_handler(name, _located(sites, handler))
    return dispatcher


def _walk(
    fn: Callable[..., Any],
    recorder: _Recorder,
    kinds: tuple[str, ...],
    policy: InterpreterPolicy,
    label: str,
) -> Callable[..., tuple[Any, Any, _Sites]]:
    """`fn` walked with `recorder`: `(*args) -> (out, record, sites)`; `label`
    names the entry point in messages."""

    def walked(*args: Any, **kwargs: Any) -> tuple[Any, Any, _Sites]:
        sites = _Sites(kinds)
        interpreter = _WalkInterpreter(_dispatcher(sites, kinds), recorder, kinds, policy, label)
        out, state = reinterpret(fn, interpreter)(_initial_state(), *args, **kwargs)
        return out, state.record, sites

    return walked
