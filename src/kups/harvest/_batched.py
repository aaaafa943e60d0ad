"""A name sown unbatched before a loop and batched inside it, under `jax.vmap`.

JAX binds a `sow` whose operands are all unbatched outside the batch, so
`reap(jax.vmap(f))` can see one name sown with the per-element shape before a
loop (a value that does not depend on the batched data: lineax's CG applies its
operator to a zero initial guess) and with the batched shape inside it. The
`batched` param of a `sow` bound under `vmap` counts the leading axes the batch
added; the unbatched value stands for every batch element, so the loop (or the
cond, whose branches must agree) carries it broadcast along them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn

from ._names import SowPath, path_of
from ._reaped import Reaped


def _batched_shapes(sow_eqn: JaxprEqn) -> list[tuple[tuple[int, ...], Any, int]]:
    """The shape, dtype and number of leading batch axes of each sown leaf."""
    params = sow_eqn.params
    offset = int(params["conditional"])
    leaves = sow_eqn.invars[offset:]
    batched = (params.get("batched") or (0,) * len(sow_eqn.invars))[offset:]
    avals: list[Any] = [v.aval for v in leaves]
    return [(a.shape, a.dtype, k) for a, k in zip(avals, batched, strict=True)]


def broadcast_unbatched(
    values: dict[SowPath, Any], in_loop: Iterable[JaxprEqn]
) -> dict[SowPath, Any]:
    """The values of `values` (sown before a loop) that a `clobber` sow in the
    loop (`in_loop`) sows batched: broadcast along the batch axes the sow has and
    the value lacks. Only a leaf whose shape is the sown shape without some of
    its leading batch axes, of the same dtype, is broadcast; any other mismatch
    is left for the loop's carry check to report."""
    changed: dict[SowPath, Any] = {}
    for sow_eqn in in_loop:
        path = path_of(sow_eqn)
        if path not in values or sow_eqn.params["mode"] != "clobber":
            continue
        value = changed.get(path, values[path])
        leaves, treedef = jax.tree.flatten(value)
        if treedef != sow_eqn.params["tree"]:
            continue
        new_leaves = []
        for leaf, (shape, dtype, batch_axes) in zip(leaves, _batched_shapes(sow_eqn), strict=True):
            extra = len(shape) - jnp.ndim(leaf)
            if (
                0 < extra <= batch_axes
                and jnp.result_type(leaf) == dtype
                and tuple(jnp.shape(leaf)) == tuple(shape[extra:])
            ):
                leaf = jnp.broadcast_to(leaf, shape)
            new_leaves.append(leaf)
        if any(a is not b for a, b in zip(new_leaves, leaves, strict=True)):
            changed[path] = jax.tree.unflatten(treedef, new_leaves)
    return changed


def with_batched(ctx: Reaped, sows: Iterable[JaxprEqn]) -> Reaped:
    """`ctx` with each value that one of `sows` (the sows of a loop or a cond)
    sows batched broadcast along the batch axes it lacks (`broadcast_unbatched`)."""
    broadcast = broadcast_unbatched(ctx.values, sows)
    return ctx.replace({**ctx.values, **broadcast}) if broadcast else ctx
