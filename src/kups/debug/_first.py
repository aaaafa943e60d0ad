"""`report="first"`: the first equation that made a NaN or an Inf, anywhere.

A recorder of the walk (`_walk.py`): the record keeps the first failing site, and
whether it made a NaN, its shard and its loop iterations. Within one shard the
first check that fails is kept (one select per check); its shard and iterations
are written when the walk settles the loop body, `shard_map` body or program it
ran in, which all its checks share. Across shards, the record of the earliest
loop iterations (outermost first), then the earliest site in program order, then
the first shard in mesh order (the toolkit's `first_across_shards`).
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

from ._walk import _Check


class _First(NamedTuple):
    """- `code`: which equation first made a NaN/Inf, and whether a NaN:
      `2 * site + nan`; -1 when none did; `-3 - (2 * site + nan)` between the
      check that found it and the end of the loop body (or `shard_map` body, or
      program) it ran in, where `shard` and `iterations` are written.
    - `shard`: the row-major index in the whole mesh of the shard where it happened
      (coordinate 0 along axes that were not manual there), or -1.
    - `iterations`: the iteration of each loop around it, outermost first, padded
      with -1 to the deepest loop nesting of the program."""

    code: Any
    shard: Any
    iterations: Any

    @property
    def site(self) -> Any:
        """The index of the first equation that made a NaN/Inf, or -1."""
        return jnp.where(self.code >= 0, jax.lax.shift_right_arithmetic(self.code, 1), -1)

    @property
    def nan(self) -> Any:
        """Whether it made a NaN (otherwise an Inf)."""
        return (self.code >= 0) & (jax.lax.bitwise_and(self.code, 1) == 1)


@dataclasses.dataclass(frozen=True)
class _FirstRecorder:
    made_only = False
    batched = False

    def start(self, jaxpr: Jaxpr, depth: int) -> _First:
        del jaxpr
        return _First(jnp.int32(-1), jnp.int32(-1), jnp.full((depth,), -1, jnp.int32))

    def empty(self, record: _First) -> _First:
        return _First(
            jnp.int32(-1), jnp.int32(-1), jnp.full(record.iterations.shape, -1, jnp.int32)
        )

    def record(self, record: _First, site: int, flags: dict[str, Any], stamp: Any) -> _First:
        # One select per check; the stamp is written when the jaxpr settles.
        del stamp
        bad = functools.reduce(jax.lax.bitwise_or, flags.values())
        first = jax.lax.bitwise_and(bad, jax.lax.eq(record.code, np.int32(-1)))
        code = np.int32(-3 - 2 * site)
        if "nan" in flags:
            code = jax.lax.sub(code, jax.lax.convert_element_type(flags["nan"], np.int32))
        return record._replace(code=jax.lax.select_n(first, record.code, code))

    def record_many(self, record: _First, checks: list[_Check]) -> _First:
        for check in checks:
            record = self.record(record, check.site, check.flags, None)
        return record

    def settle(self, record: _First, jaxpr: Jaxpr, stamp: Any) -> _First:
        # The check that found it ran in this run of this jaxpr: every check of
        # one run shares one stamp.
        del jaxpr
        fresh = record.code <= -3
        here = jax.lax.squeeze(jax.lax.slice(stamp, (0,), (1,)), (0,))
        iterations = jax.lax.slice(stamp, (1,), (stamp.shape[0],))
        return _First(
            code=jnp.where(fresh, -3 - record.code, record.code),
            shard=jnp.where(fresh, here, record.shard),
            iterations=jnp.where(fresh, iterations, record.iterations),
        )

    def reduce(self, record: _First, position: Any, own: Any, manual: tuple[Any, ...]) -> _First:
        del own, manual
        order = event_order(record.iterations, record.site, record.iterations.shape[0])
        first, _ = first_across_shards(
            record, happened=record.code >= 0, order=order, position=position
        )
        return first

    def merge(self, outer: _First, inner: _First) -> _First:
        keep = outer.code != -1
        return _First(*(jnp.where(keep, a, b) for a, b in zip(outer, inner, strict=True)))
