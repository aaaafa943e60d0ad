"""`report="first"`: the first equation that made a NaN or an Inf, anywhere.

A recorder of the walk (`_walk.py`): the record keeps the first failing site, and
whether it made a NaN, its shard and its loop iterations. Within one shard the
first check that fails is kept; across shards, the record of the earliest loop
iterations (outermost first), then the earliest site in program order, then the
first shard in mesh order (the toolkit's `first_across_shards`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr

from kups.effects import event_order, first_across_shards


class _First(NamedTuple):
    """- `site`: the index of the first equation that made a NaN/Inf, or -1.
    - `nan`: whether it made a NaN (otherwise an Inf).
    - `shard`: the row-major index in the whole mesh of the shard where it happened
      (coordinate 0 along axes that were not manual there), or -1.
    - `iterations`: the iteration of each loop around it, outermost first, padded
      with -1 to the deepest loop nesting of the program."""

    site: Any
    nan: Any
    shard: Any
    iterations: Any


@dataclasses.dataclass(frozen=True)
class _FirstRecorder:
    made_only = False

    def start(self, jaxpr: Jaxpr, depth: int) -> _First:
        del jaxpr
        return _First(
            jnp.int32(-1), jnp.bool_(False), jnp.int32(-1), jnp.full((depth,), -1, jnp.int32)
        )

    def empty(self, record: _First) -> _First:
        return _First(
            jnp.int32(-1),
            jnp.bool_(False),
            jnp.int32(-1),
            jnp.full(record.iterations.shape, -1, jnp.int32),
        )

    def record(self, record: _First, site: int, flags: dict[str, Any], stamp: Any) -> _First:
        bad = functools.reduce(jax.lax.bitwise_or, flags.values())
        first = jax.lax.bitwise_and(bad, jax.lax.lt(record.site, np.int32(0)))
        nan = flags.get("nan", np.bool_(False))
        here = jax.lax.squeeze(jax.lax.slice(stamp, (0,), (1,)), (0,))
        iterations = jax.lax.slice(stamp, (1,), (stamp.shape[0],))
        return _First(
            site=jax.lax.select_n(first, record.site, np.int32(site)),
            nan=jax.lax.select_n(first, record.nan, nan),
            shard=jax.lax.select_n(first, record.shard, here),
            iterations=jax.lax.select_n(
                jax.lax.broadcast(first, iterations.shape), record.iterations, iterations
            ),
        )

    def reduce(self, record: _First, position: Any, own: Any, manual: tuple[Any, ...]) -> _First:
        del own, manual
        order = event_order(record.iterations, record.site, record.iterations.shape[0])
        first, _ = first_across_shards(
            record, happened=record.site >= 0, order=order, position=position
        )
        return first

    def settle(self, record: _First, jaxpr: Jaxpr, stamp: Any) -> _First:
        del jaxpr, stamp
        return record  # each check keeps its own stamp

    def merge(self, outer: _First, inner: _First) -> _First:
        keep = outer.site >= 0
        return _First(*(jnp.where(keep, a, b) for a, b in zip(outer, inner, strict=True)))
