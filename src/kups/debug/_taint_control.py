"""`report="reaching"`: control flow (calls, loops, `cond`, `shard_map`) and the
report made of the outputs' origins."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, JaxprEqn
from jax.sharding import PartitionSpec as P

from kups.effects import (
    Dispatcher,
    Handler,
    HandlerResult,
    default_cond_handler,
    default_dispatcher,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reduce_shards,
    shard_map_axes,
)

from ._position import _loop_start, _shard_indices, _spec_names
from ._report import NanReport
from ._sites import _located, _Sites, scan_layout
from ._taint_crossing import with_pieces, with_rows, without_pieces, without_rows
from ._taint_origin import (
    _EXTERNAL,
    _FINITE,
    _IO,
    _UNKNOWN,
    _as_slot,
    _earliest,
    _Flag,
    _float_origin,
    _is_float_aval,
    _Origin,
    _Taint,
    fenced,
)
from ._taint_rows import (
    MAX_ROWS,
    _Rows,
    _RowSlot,
    broadcast_rows,
    carried_rows,
    cond_rows,
    no_rows,
    rows_origin,
)
from ._taint_rules import _earliest_over, _flush, _taint_equation


def _taint_call(
    interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any], handler: Handler
) -> HandlerResult:
    """A call (`jit`, `checkpoint`, custom derivatives, ...): the body takes the
    equation's inputs one to one."""
    state = _flush(interpreter, state)
    origins = interpreter.origins_of(eqn.invars, eqn)
    entries = with_pieces(origins, interpreter.pieces_of(eqn.invars))
    io = _IO(
        "call",
        (),
        with_rows(entries, [interpreter.rows_of(v) for v in eqn.invars]),
        interpreter.finite_atoms(eqn.invars),
    )
    result = handler(interpreter, state._replace(io=io), eqn, invals)
    return _left(interpreter, state, eqn, result)


def _left(interpreter: Any, state: _Taint, eqn: JaxprEqn, result: HandlerResult) -> HandlerResult:
    """Sets the origins of `eqn`'s outputs from the `_IO` the body left in the
    context, and puts back the position and scope of `state`."""
    io = result.ctx.io
    avals = [v.aval for v in eqn.outvars]
    pieces: list[Any] = []
    rows: list[Any] = []
    if isinstance(io, _IO) and io.role == "out" and len(io.origins) == len(avals):
        entries, rows = without_rows(io.origins)
        origins, pieces = without_pieces(entries)
        origins = [_float_origin(a, o) for a, o in zip(avals, origins, strict=True)]
    else:
        # The body was run passively (no floating output) or not at all.
        origins = [_float_origin(a, _EXTERNAL) for a in avals]
    interpreter.set_origins(eqn.outvars, origins)
    for var, own in zip(eqn.outvars, pieces, strict=False):
        if own is not None:
            interpreter.set_pieces(var, own)
    for var, own in zip(eqn.outvars, rows, strict=False):
        if own is not None:
            interpreter.set_rows(var, own)
    ctx = result.ctx._replace(io=None, pos=state.pos, here=state.here, scope=state.scope)
    return HandlerResult(ctx, result.outvals)


def _advance(slot: int, by: int, carried: _Taint, new: _Taint) -> _Taint:
    """The loop updater: the loop's iteration counter in `pos` moves by `by`."""
    del carried
    step = np.zeros(new.pos.shape, np.int32)
    step[slot] = by
    return new._replace(pos=new.pos + step)


def _taint_loop(
    loop_handler: Callable[..., HandlerResult],
    interpreter: Any,
    state: _Taint,
    eqn: JaxprEqn,
    invals: list[Any],
) -> HandlerResult:
    """`scan` and `while`: carries get traced origins; the loop's counter is the
    next slot of `pos` (-1 outside, so one step starts it at 0)."""
    if state.scope.passive:
        return loop_handler(interpreter, state, eqn, invals)
    state = _flush(interpreter, state)
    origins = interpreter.origins_of(eqn.invars, eqn)
    length = state.pos.shape[0]
    if eqn.primitive.name == "scan":
        num_consts, num_carry = scan_layout(eqn)
        consts = origins[:num_consts]
        body = eqn.params["jaxpr"].jaxpr
        carry = _carry_slots(
            interpreter,
            eqn.invars[num_consts : num_consts + num_carry],
            origins[num_consts : num_consts + num_carry],
            carried_rows(
                body, body.invars[num_consts : num_consts + num_carry], body.outvars[:num_carry]
            ),
            length,
        )
        xs = origins[num_consts + num_carry :]
        steps = int(eqn.params["length"])
        ys = [
            no_rows(steps, length, eqn)
            if 0 < steps <= MAX_ROWS and _is_float_aval(v.aval)
            else _as_slot(_FINITE, v.aval, length)
            for v in eqn.outvars[num_carry:]
        ]
        io = _IO("scan", (len(consts), len(carry), len(xs), len(ys)), (*consts, *carry, *xs, *ys))
        io = fenced(io)
    else:
        body = eqn.params["body_jaxpr"]
        body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
        num_carry = len(body.outvars)
        num_body_consts = len(body.invars) - num_carry
        start = len(eqn.invars) - num_carry - num_body_consts
        consts = origins[start : start + num_body_consts]
        carry = _carry_slots(
            interpreter,
            eqn.invars[start + num_body_consts :],
            origins[start + num_body_consts :],
            carried_rows(body, body.invars[num_body_consts:], body.outvars),
            length,
        )
        io = fenced(_IO("while", (len(consts), len(carry)), (*consts, *carry)))
    depth = state.scope.loop_depth
    slot = 2 + depth
    start, by = _loop_start(eqn)
    step = np.zeros(state.pos.shape, np.int32)
    step[slot] = start + 1  # from -1, outside the loop
    inner = state._replace(
        io=io,
        pos=state.pos + step,
        scope=dataclasses.replace(state.scope, loop_depth=depth + 1),
    )
    result = loop_handler(
        interpreter, inner, eqn, invals, updater=functools.partial(_advance, slot, by)
    )
    io = result.ctx.io
    outs: list[Any] = []
    if isinstance(io, _IO) and io.role in ("scan", "while"):
        if io.role == "scan":
            _, carry, _, stacked = io.groups()
            outs = [*carry, *stacked]
        else:
            _, outs = io.groups()
        origins = [
            rows_origin(o.rows if isinstance(o, _RowSlot) else o)
            if isinstance(o, (_Rows, _RowSlot))
            else o
            for o in outs
        ]
        result = HandlerResult(
            result.ctx._replace(io=_IO("out", (), tuple(origins))), result.outvals
        )
    left = _left(interpreter, state, eqn, result)
    # Each row of a stacked output, or of a buffer the loop writes row by row,
    # keeps the origin of the iteration that wrote it.
    for var, out in zip(eqn.outvars[len(eqn.outvars) - len(outs) :], outs, strict=True):
        if isinstance(out, (_Rows, _RowSlot)):
            interpreter.set_rows(var, out.rows if isinstance(out, _RowSlot) else out)
    return left


def _carry_slots(
    interpreter: Any, atoms: list[Any], origins: list[Any], by_rows: list[bool], length: int
) -> list[Any]:
    """The loop slots of carries: `_Rows` for a buffer the body writes row by
    row (those it already has, or each row with the buffer's origin)."""
    slots = []
    for atom, origin, rows in zip(atoms, origins, by_rows, strict=True):
        slot = _as_slot(origin, atom.aval, length)
        if rows and isinstance(slot, _Origin):
            own = interpreter.rows_of(atom) or broadcast_rows(slot, atom.aval.shape[0])
            slot = _RowSlot(slot, own)
        slots.append(slot)
    return slots


def _taint_cond(interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any]) -> HandlerResult:
    if state.scope.passive:
        return default_cond_handler(interpreter, state, eqn, invals)
    state = _flush(interpreter, state)
    origins = interpreter.origins_of(eqn.invars[1:], eqn)
    rows = [interpreter.rows_of(v) for v in eqn.invars[1:]]
    # A buffer written row by row in the branches keeps its rows (see `_leave`).
    rowed = cond_rows(eqn, [r is not None for r in rows]) if any(rows) else ()
    inner = state._replace(io=fenced(_IO("cond", rowed, with_rows(origins, rows))))
    return _left(interpreter, state, eqn, default_cond_handler(interpreter, inner, eqn, invals))


@functools.lru_cache(maxsize=64)
def _earliest_shard(manual: tuple[Any, ...]) -> Callable[[_Taint], _Taint]:
    """`reduce_ctx`: each output's earliest origin over the shards (the first shard
    in mesh order on ties); the clock goes on from the shard that ran the most."""

    def reduce_ctx(state: _Taint) -> _Taint:
        own = state.here.reshape(())
        varying = own >= 0

        def reduce(origin: Any) -> Any:
            if not isinstance(origin, _Origin):
                return origin
            return _earliest_over(own, origin, manual)

        io = state.io
        io = _IO(io.role, io.counts, tuple(reduce(o) for o in io.origins))
        return state._replace(
            io=io,
            tick=reduce_shards(jnp.where(varying, state.tick, 0), manual, op="max"),
            pos=np.zeros(state.pos.shape, np.int32),
            here=jnp.zeros(state.here.shape, jnp.int32),
        )

    return reduce_ctx


def _taint_shard_map(
    interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    if state.scope.passive:
        return default_shard_map_handler(interpreter, state, eqn, invals)
    state = _flush(interpreter, state)
    mesh, manual_set = shard_map_axes(eqn)
    sizes = dict(mesh.shape)
    mesh_axes = tuple((name, sizes[name]) for name in mesh.axis_names)
    manual = tuple(name for name in mesh.axis_names if name in manual_set)
    names = {name for name, _ in state.scope.manual_axes} | set(manual)
    scope_axes = tuple((name, size) for name, size in mesh_axes if name in names)
    origins = interpreter.origins_of(eqn.invars, eqn)
    split = tuple(bool(_spec_names(spec) & set(manual)) for spec in eqn.params["in_specs"])
    inner = state._replace(
        io=fenced(
            _IO("shard_map", (len(origins), len(split)), (*origins, *[_Flag(s) for s in split]))
        ),
        here=_shard_indices(state.here, mesh_axes, manual),
        scope=dataclasses.replace(state.scope, manual_axes=scope_axes, mesh_axes=mesh_axes),
    )

    def ctx_in_specs(tree: _Taint) -> _Taint:
        return jax.tree.map(lambda _: P(), tree)._replace(here=P(*manual))

    result = default_shard_map_handler(
        interpreter,
        inner,
        eqn,
        invals,
        declare_ctx_in_specs=ctx_in_specs,
        reduce_ctx=_earliest_shard(manual),
    )
    return _left(interpreter, state, eqn, result)


def _taint_dispatcher(sites: _Sites) -> Dispatcher:
    dispatcher = default_dispatcher()
    for name, handler in list(dispatcher.handlers.items()):
        if name in ("scan", "while", "cond", "shard_map", "custom_linear_solve"):
            continue
        dispatcher.register_handler(name, functools.partial(_call_with, handler))
    dispatcher = (
        dispatcher.register_handler("scan", functools.partial(_taint_loop, default_scan_handler))
        .register_handler("while", functools.partial(_taint_loop, default_while_handler))
        .register_handler("cond", _taint_cond)
        .register_handler("shard_map", _taint_shard_map)
        # The solve is an equation like any other here: re-bound as it is, its
        # outputs checked (origins are not followed through the solver).
        .register_handler("custom_linear_solve", functools.partial(_taint_equation, sites))
        .register_fallback_handler(functools.partial(_taint_equation, sites))
    )
    for name, handler in dispatcher.handlers.items():
        dispatcher.register_handler(name, _located(sites, handler))
    return dispatcher


def _call_with(
    handler: Handler, interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    if state.scope.passive:
        return handler(interpreter, state, eqn, invals)
    return _taint_call(interpreter, state, eqn, invals, handler)


def _reaching_report(state: _Taint, sites: _Sites) -> NanReport:
    """The report of the earliest origin among the outputs'."""
    origins = [o for o in state.io.origins if isinstance(o, _Origin)]
    if not origins:
        nothing = jnp.int32(-1)
        depth = 0 if state.pos is None else state.pos.shape[0] - 2
        iterations = jnp.full((depth,), -1, jnp.int32)
        return NanReport(nothing, jnp.bool_(False), nothing, iterations, tuple(sites.sites))
    first = _earliest(origins)
    found = first.w < _UNKNOWN
    code = first.info[0]
    site = jnp.where(found, code // 2, -1)
    if isinstance(first.info, Tracer):
        iterations = first.info[2:]
    else:
        # Eagerly, JAX 0.10.2 cannot slice an array typed for a mesh down to zero
        # entries outside `jax.set_mesh`; on the host it is a plain copy.
        iterations = jnp.asarray(np.asarray(first.info)[2:])
    return NanReport(site, found & (code % 2 == 1), first.info[1], iterations, tuple(sites.sites))
