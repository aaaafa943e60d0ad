"""Recording failures: the interpreter's context and its handlers.

The context is a `failed` flag and the error record (one record, which every
check site shares) with a `Position` (the toolkit's), kept right through loops
and `shard_map` by `track_position`. The first failing check fills the record
and sets `failed`, which masks every later check; between the shards of a
`shard_map`, the first failure (earliest iterations, then program order, then
mesh order) is kept.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import JaxprEqn

from kups.effects import (
    Handler,
    HandlerResult,
    Interpreter,
    Position,
    default_primitive_handler,
    event_order,
    first_across_shards,
    sub_jaxprs,
    while_with_predicate,
)

from ._automatic import _CONDITIONS, _automatic_checks
from ._error import _padded, _Record, _Site
from ._first import first_true, unravel, value_at
from ._sites import _batch_ndim, _relative_sites, _sites_in


class _Ctx(eqx.Module):
    """The interpreter's context: whether a check failed, the record of the first
    failure, where the current equation runs, and the kinds of checks being
    recorded."""

    failed: jax.Array
    record: _Record
    position: Position
    kinds: frozenset[str] = eqx.field(static=True)

    def with_sites(self, sites: Iterable[_Site]) -> _Ctx:
        """This context with room in its record for `sites`."""
        record = self.record.with_sites(sites)
        return self if record is self.record else dataclasses.replace(self, record=record)

    def site(self, info: Any, batch_ndim: int = 0) -> _Site:
        """The site of a check or automatic check met here."""
        position = self.position
        return _Site(info, position.depth, position.shard_axes, batch_ndim)


def _record(
    ctx: _Ctx, site: _Site, bad: jax.Array, values: Sequence[jax.Array], batch: jax.Array | None
) -> _Ctx:
    """`ctx` with `site`'s failure recorded if `bad` and nothing failed before.

    While nothing has failed, every site writes the record (it is read only once
    `failed` is set); once something has, the record is kept. Each update is
    gated by the flag as it was before the site, and the flag after it is
    computed once (an optimization barrier): XLA would otherwise copy the chain
    of flags up to each site into the code of each update, quadratic in the
    number of checks of a loop body (minutes of compilation for a few hundred).
    """
    ctx = ctx.with_sites([site])
    record = ctx.record
    layout = record.layout
    kept = ctx.failed
    position = ctx.position
    payload = list(record.values)
    for place, value in zip(layout.places(site), values, strict=True):
        payload[place] = _select(kept, payload[place], value)
    record = _Record(
        layout,
        _select(kept, record.code, jnp.int32(layout.code(site))),
        tuple(payload),
        _select(kept, record.iterations, _padded(position.iteration, layout.depth, -1)),
        _select(kept, record.shard, _padded(position.shard, layout.axes, 0)),
        _select(kept, record.batch, _padded(batch, layout.batch_ndim, 0)),
    )
    failed = lax.optimization_barrier(jnp.logical_or(kept, bad))
    return dataclasses.replace(ctx, failed=failed, record=record)


def _select(pred: jax.Array, old: Any, new: Any) -> Any:
    """`old` where `pred`, else `new` (`None` stays `None`). Not `jnp.where`: on an
    empty array (JAX 0.10.2) it returns an operand without joining the varying
    manual axes, which breaks a loop carry inside shard_map."""
    if old is None:
        return None
    return lax.select(jnp.broadcast_to(pred, old.shape), old, new)


def _check_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    del interpreter
    pred, *values = invals
    site = ctx.site(eqn.params["site"], _batch_ndim(eqn))
    batch = None
    if site.batch_ndim:  # under vmap (see `_batch_check`): the first failing element
        first, flat = first_true(jnp.logical_not(pred))
        values = [value_at(value, flat, first, site.batch_ndim) for value in values]
        batch = unravel(first, pred.shape)
        pred = jnp.all(pred)
    ctx = _record(ctx, site, jnp.logical_not(pred), values, batch)
    return HandlerResult(ctx, list(invals))


def _automatic_handler(
    interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The fallback handler under automatic checks: re-binds the equation, then
    records whatever of `ctx.kinds` went wrong in it."""
    ctx, outvals = default_primitive_handler(interpreter, ctx, eqn, invals)
    for info in _automatic_checks(eqn, ctx.kinds, ctx.position.enclosing):
        bad, payload = _CONDITIONS[info.kind](eqn, invals, outvals)
        ctx = _record(ctx, ctx.site(info), bad, payload, None)
    return HandlerResult(ctx, outvals)


def _with_sites(handler: Handler) -> Handler:
    """`handler` for a loop or `cond` (inside `track_position`): the record first
    gets room for every check the body or any branch may reach, so that it keeps
    its structure through the iterations and is the same out of every branch.

    Inside `shard_map`, the flag and the record are also made varying over the
    manual axes: a check records its shard's coordinates, so they vary after it,
    and a loop carry or cond output must have the same type everywhere.
    """

    @functools.wraps(handler)
    def prepared(
        interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any], **options: Any
    ) -> HandlerResult:
        position = ctx.position
        where = (position.depth, position.shard_axes, ctx.kinds, position.enclosing)
        ctx = ctx.with_sites(_sites_in(sub_jaxprs(eqn), *where))
        if position.levels:
            failed, record = position.vary((ctx.failed, ctx.record))
            ctx = dataclasses.replace(ctx, failed=failed, record=record)
        if eqn.primitive.name == "while" and any(_sites_in([eqn.params["cond_jaxpr"]], *where)):
            return _while_checking_condition(interpreter, ctx, eqn, invals, options["updater"])
        return handler(interpreter, ctx, eqn, invals, **options)

    return prepared


def _while_checking_condition(
    interpreter: Interpreter,
    ctx: _Ctx,
    eqn: JaxprEqn,
    invals: list[Any],
    updater: Callable[[Any, Any], Any],
) -> HandlerResult:
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
        carry, after = interpreter(params["body_jaxpr"], ctx, *body_consts, *carry)
        after = updater(ctx, after)
        pred, after = condition(after, carry)
        return pred, after, carry

    pred, ctx = condition(ctx, init)
    ctx, outvals = while_with_predicate(pred, ctx, list(init), step)
    return HandlerResult(ctx, outvals)


def _first_failing_shard(ctx: _Ctx) -> _Ctx:
    """`reduce_ctx` of a `shard_map`: every shard's record replaced by that of the
    shard whose failure came first (earliest iterations, then program order, then
    mesh order), in one collective round (`first_across_shards`)."""
    record = ctx.record
    iterations = jnp.zeros((0,), jnp.int32) if record.iterations is None else record.iterations
    # Iterations past a site's loops are -1 already: the key of `event_order`.
    order = event_order(iterations, record.code, record.layout.depth)
    record, failed = first_across_shards(
        record, happened=ctx.failed, order=order, position=ctx.position
    )
    return dataclasses.replace(ctx, failed=failed, record=record)


def _scoped(handler: Handler) -> Handler:
    """`handler` for control flow with a check inside; control flow with none is
    re-bound unchanged, so check-free parts of a program compile as they are."""

    @functools.wraps(handler)
    def dispatch(
        interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        if not any(_relative_sites(jaxpr, ctx.kinds) for jaxpr in sub_jaxprs(eqn)):
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        return handler(interpreter, ctx, eqn, invals)

    return dispatch
