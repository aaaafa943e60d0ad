"""`report="first"`: the first equation that made a NaN or an Inf, anywhere.

A fallback handler re-binds every equation that is not control flow and checks
its floating outputs, unless all its inputs are constants of the program; the
context records the first site that failed, the loop iterations at that moment
and the shard. Loops push an iteration counter (advanced by the loop handlers'
`updater`); the record's iteration vector is padded to the deepest loop nesting
inside a loop or `cond` before it is entered, so that loop carries and branches
keep one shape. A `shard_map` body starts with an empty record and hands out the
first record of any shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn
from jax.sharding import PartitionSpec as P

from kups.effects import (
    Dispatcher,
    HandlerResult,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    shard_map_axes,
)

from ._constants import _CALLS, _in_frame, _is_constant
from ._position import _NO_SHARD, _all_axes, _eqn_loop_depth, _loop_depth, _shard_indices
from ._sites import _is_float, _located, _Scope, _Sites


class _State(NamedTuple):
    """The context `find_nans` threads through the program.

    - `site`: the index of the first equation that produced a NaN/Inf, or -1.
    - `nan`: whether that equation produced a NaN (otherwise an Inf).
    - `shard`: the row-major index in the whole mesh of the first shard (in mesh
      order) where it happened (coordinate 0 along axes that were not manual
      there), or -1.
    - `when`: the value of `tick` when that equation ran, or -1.
    - `tick`: how many checked equations have run so far on this shard: the
      clock that orders records from different shards.
    - `here`: the current shard's index in the same form: 0 outside `shard_map`;
      inside, a block of shape `(1, ...)`, one dimension per manual axis.
    - `iterations`: the iteration of each loop around that equation, outermost
      first, padded with -1 to the deepest loop nesting seen so far.
    - `counters`: the current iteration of each loop around the current equation.
    - `scope`: static facts about where the current equation is (`_Scope`).
    """

    site: Any
    nan: Any
    shard: Any
    iterations: Any
    when: Any
    tick: Any
    here: Any
    counters: tuple[Any, ...]
    scope: _Scope


def _initial_state() -> _State:
    return _State(
        site=jnp.int32(-1),
        nan=jnp.bool_(False),
        shard=jnp.int32(-1),
        iterations=jnp.zeros((0,), jnp.int32),
        when=jnp.int32(-1),
        tick=jnp.int32(0),
        here=jnp.int32(0),
        counters=(),
        scope=_Scope(),
    )


def _pad_iterations(state: _State, length: int) -> _State:
    """The state with `iterations` padded (with -1) to at least `length` entries."""
    missing = length - state.iterations.shape[0]
    if missing <= 0:
        return state
    padding = jnp.full((missing,), -1, jnp.int32)
    return state._replace(iterations=jnp.concatenate([state.iterations, padding]))


def _select(pred: Any, new: _State, old: _State) -> _State:
    """`new` where `pred`, else `old`, for the record fields (not the position)."""
    length = max(new.iterations.shape[0], old.iterations.shape[0])
    new, old = _pad_iterations(new, length), _pad_iterations(old, length)
    return old._replace(
        site=jnp.where(pred, new.site, old.site),
        nan=jnp.where(pred, new.nan, old.nan),
        shard=jnp.where(pred, new.shard, old.shard),
        iterations=jnp.where(pred, new.iterations, old.iterations),
        when=jnp.where(pred, new.when, old.when),
    )


def _check_equation(
    sites: _Sites, interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The fallback handler: re-binds the equation and checks its float outputs,
    unless they are constants of the program (see `_constant_equations`)."""
    outvals = default_primitive_handler(interpreter, state, eqn, invals).outvals
    floats = [value for value in outvals if _is_float(value)]
    if not floats or _is_constant(state.scope.frame, eqn):
        return HandlerResult(state, outvals)
    site = sites.add(eqn, state)
    bad = functools.reduce(jnp.logical_or, [~jnp.isfinite(value).all() for value in floats])
    nan = functools.reduce(jnp.logical_or, [jnp.isnan(value).any() for value in floats])
    first = bad & (state.site < 0)
    state = state._replace(
        site=jnp.where(first, jnp.int32(site), state.site),
        nan=jnp.where(first, nan, state.nan),
        shard=jnp.where(first, state.here.reshape(()), state.shard),
        iterations=jnp.where(first, _position(state), state.iterations),
        when=jnp.where(first, state.tick, state.when),
        # Saturates rather than wrapping around after 2**31 - 2 equations.
        tick=jnp.minimum(state.tick, _NO_SHARD - 2) + 1,
    )
    return HandlerResult(state, outvals)


def _position(state: _State) -> Any:
    """The current loop counters, padded with -1 like `state.iterations`."""
    length = state.iterations.shape[0]
    if length == 0:
        return state.iterations
    padding = [jnp.int32(-1)] * (length - len(state.counters))
    return jnp.stack([jnp.asarray(c, jnp.int32) for c in (*state.counters, *padding)])


def _next_iteration(carried: _State, new: _State) -> _State:
    """The loop updater: the innermost loop counter advances after each iteration."""
    del carried
    *outer, current = new.counters
    return new._replace(counters=(*outer, current + 1))


def _check_loop(
    loop_handler: Callable[..., HandlerResult],
    interpreter: Any,
    state: _State,
    eqn: JaxprEqn,
    invals: list[Any],
) -> HandlerResult:
    """Runs a loop with one more counter; `iterations` is first padded to the
    deepest nesting inside, so that the loop carries a context of fixed shape."""
    outer_counters = state.counters
    state = _pad_iterations(state, len(outer_counters) + _eqn_loop_depth(eqn))
    state = state._replace(counters=(*outer_counters, jnp.int32(0)))
    result = loop_handler(interpreter, state, eqn, invals, updater=_next_iteration)
    return HandlerResult(result.ctx._replace(counters=outer_counters), result.outvals)


def _check_cond(interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]) -> HandlerResult:
    """Pads `iterations` for the deepest loop in any branch, so that every branch
    returns a context of the same shape."""
    depth = max(_loop_depth(branch.jaxpr) for branch in eqn.params["branches"])
    state = _pad_iterations(state, len(state.counters) + depth)
    return default_cond_handler(interpreter, state, eqn, invals)


@functools.lru_cache(maxsize=64)
def _first_shard(manual: tuple[Any, ...]) -> Callable[[_State], _State]:
    """`reduce_ctx` that keeps the record that was made first (by each shard's
    count of equations run), and among records made at the same count the one of
    the first shard in mesh order. The result is the same on every shard (cached
    so that the framework's body cache recognises it)."""

    def reduce_ctx(state: _State) -> _State:
        own = state.here.reshape(())
        found = state.site >= 0
        when = jnp.where(found, state.when, _NO_SHARD)
        first_when = _all_axes(jax.lax.pmin, when, manual)
        key = jnp.where(found & (when == first_when), state.shard, _NO_SHARD)
        first_key = _all_axes(jax.lax.pmin, key, manual)
        # Exactly one shard among those with the first key.
        chosen = own == _all_axes(jax.lax.pmin, jnp.where(key == first_key, own, _NO_SHARD), manual)

        def pick(value: Any) -> Any:
            return _all_axes(jax.lax.psum, jnp.where(chosen, value, jnp.zeros_like(value)), manual)

        any_found = first_key < _NO_SHARD
        return state._replace(
            site=jnp.where(any_found, pick(state.site), -1),
            nan=pick(state.nan.astype(jnp.int32)) > 0,
            shard=jnp.where(any_found, pick(state.shard), -1),
            iterations=jnp.where(any_found, pick(state.iterations), -1),
            when=jnp.where(any_found, pick(state.when), -1),
            # The clock goes on from the shard that ran the most equations
            # (`where` on `own` makes it varying, as pmax needs with check_vma).
            tick=_all_axes(jax.lax.pmax, jnp.where(own >= 0, state.tick, 0), manual),
            # Replicated, to leave the body; the caller keeps its own.
            here=jnp.zeros(state.here.shape, jnp.int32),
        )

    return reduce_ctx


def _check_shard_map(
    interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The body starts with no record; the earliest record of any shard comes out
    and replaces the outer one if that is empty."""
    mesh, manual_set = shard_map_axes(eqn)
    sizes = dict(mesh.shape)
    mesh_axes = tuple((name, sizes[name]) for name in mesh.axis_names)
    manual = tuple(name for name in mesh.axis_names if name in manual_set)
    names = {name for name, _ in state.scope.manual_axes} | set(manual)
    scope = tuple((name, size) for name, size in mesh_axes if name in names)
    inner = _initial_state()._replace(
        iterations=jnp.full(state.iterations.shape, -1, jnp.int32),
        tick=state.tick,
        here=_shard_indices(state.here, mesh_axes, manual),
        counters=state.counters,
        scope=_Scope(scope, mesh_axes, state.scope.frame),
    )

    def ctx_in_specs(tree: _State) -> _State:
        return jax.tree.map(lambda _: P(), tree)._replace(here=P(*manual))

    result = default_shard_map_handler(
        interpreter,
        inner,
        eqn,
        invals,
        declare_ctx_in_specs=ctx_in_specs,
        reduce_ctx=_first_shard(manual),
    )
    merged = _select(state.site < 0, result.ctx, state)._replace(tick=result.ctx.tick)
    return HandlerResult(merged, result.outvals)


def _dispatcher(sites: _Sites) -> Dispatcher:
    dispatcher = (
        default_dispatcher()
        .register_handler("scan", functools.partial(_check_loop, default_scan_handler))
        .register_handler(
            "while",
            functools.partial(
                _check_loop, functools.partial(default_while_handler, thread_condition=True)
            ),
        )
        .register_handler("cond", _check_cond)
        .register_handler("shard_map", _check_shard_map)
        .register_fallback_handler(functools.partial(_check_equation, sites))
    )
    for name, handler in dispatcher.handlers.items():
        if name in _CALLS:
            handler = _in_frame(handler)
        dispatcher.register_handler(name, _located(sites, handler))
    return dispatcher
