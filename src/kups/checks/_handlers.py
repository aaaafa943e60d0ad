"""Recording failures: the interpreter's context and its handlers.

The context is the error record (a `failed` flag and one slot per check site)
with a `Position` (the toolkit's), kept right through loops and `shard_map` by
`track_position`. The first failing check fills its slot and sets `failed`,
which masks every later check; between the shards of a `shard_map`, the first
failure (earliest iterations, then program order, then mesh order) is kept.
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
    source_of,
    sub_jaxprs,
    while_with_predicate,
)

from ._automatic import _CONDITIONS, _automatic_checks
from ._error import _Site, _Slot
from ._first import first_true, unravel, value_at
from ._sites import _batch_ndim, _located, _relative_sites, _sites_in


class _Ctx(eqx.Module):
    """The interpreter's context: the error record, where the current equation
    runs, and the kinds of checks being recorded."""

    failed: jax.Array
    slots: tuple[_Slot, ...]
    position: Position
    kinds: frozenset[str] = eqx.field(static=True)

    def with_sites(self, sites: Iterable[_Site]) -> _Ctx:
        """This context with an empty slot for each site it has none for."""
        known = {slot.site for slot in self.slots}
        new = tuple(_Slot.empty(site) for site in dict.fromkeys(sites) if site not in known)
        return dataclasses.replace(self, slots=self.slots + new) if new else self

    def site(self, info: Any, batch_ndim: int = 0) -> _Site:
        """The site of a check or automatic check met here."""
        position = self.position
        return _Site(info, position.depth, position.shard_axes, batch_ndim)


def _record(
    ctx: _Ctx, site: _Site, bad: jax.Array, values: Sequence[jax.Array], batch: jax.Array | None
) -> _Ctx:
    """`ctx` with `site`'s slot filled if `bad` and nothing failed before."""
    ctx = ctx.with_sites([site])
    fails = jnp.logical_and(bad, jnp.logical_not(ctx.failed))
    position = ctx.position
    iterations = position.iteration if position.depth else None

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
            shard=_select(fails, position.shard, slot.shard),
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


def _with_slots(handler: Handler) -> Handler:
    """`handler` for a loop or `cond` (inside `track_position`): the context first
    gets a slot for every check the body or any branch may reach, so that it keeps
    its structure through the iterations and is the same out of every branch.

    Inside `shard_map`, the flag and those slots are also made varying over the
    manual axes: a check records its shard's coordinates, so they vary after it,
    and a loop carry or cond output must have the same type everywhere.
    """

    @functools.wraps(handler)
    def prepared(
        interpreter: Interpreter, ctx: _Ctx, eqn: JaxprEqn, invals: list[Any], **options: Any
    ) -> HandlerResult:
        position = ctx.position
        where = (position.depth, position.shard_axes, ctx.kinds, position.enclosing)
        sites = list(dict.fromkeys(_sites_in(sub_jaxprs(eqn), *where)))
        ctx = ctx.with_sites(sites)
        if position.levels:
            inside = set(sites)
            slots = tuple(
                position.vary(slot) if slot.site in inside else slot for slot in ctx.slots
            )
            ctx = dataclasses.replace(ctx, failed=position.vary(ctx.failed), slots=slots)
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
    depth = max((slot.site.num_loops for slot in ctx.slots), default=0)
    order = jnp.zeros((depth + 1,), jnp.int32)
    for index, slot in enumerate(ctx.slots):
        iterations = jnp.zeros((0,), jnp.int32) if slot.iterations is None else slot.iterations
        key = event_order(iterations, index, depth)
        order = lax.select(jnp.broadcast_to(slot.failed, key.shape), key, order)
    slots, failed = first_across_shards(
        ctx.slots, happened=ctx.failed, order=order, position=ctx.position
    )
    return dataclasses.replace(ctx, failed=failed, slots=slots)


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
            info for jaxpr in sub_jaxprs(eqn) for info, *_ in _relative_sites(jaxpr, ctx.kinds)
        ]
        if not relative:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        enclosing = source_of(eqn, ctx.position.enclosing)
        inside = {_located(info, enclosing) for info in relative}
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
