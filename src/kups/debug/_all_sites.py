"""The record of `nan_sites`: every site that made a NaN or an Inf, with counts.

A recorder of the walk (`_walk.py`), like the one of `report="first"`: one table
`(sites, kinds, 2 + loop depth)` of int32, a row per site and kind holding
`[count, shard of the first event, iterations of the first event...]`. The
checks of one run of a jaxpr are added to their sites' counts at once, at its
end or before a loop or `shard_map` in it: one slice, add and update per run of
nearby sites (a check costs no operation of its own). The first event's columns
are written when the walk settles a loop body, a `shard_map` body or the
program: its checks all share one stamp, given at once to every site counted
there for the first time. The number
of rows is known before the walk, from the program: every equation that is not
control flow and has a floating output, in every sub-program.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr

from kups.effects import equations_in, reduce_shards, sub_jaxprs

from ._flags import _Check
from ._meshes import mesh_of, on_mesh
from ._position import _first_shard, _pick
from ._sites import _is_float_aval

# Checks of sites at most this far apart are added to the table in one update
# (the rows between them get zeros).
_JOIN_GAP = 16

_CAPACITY: weakref.WeakKeyDictionary[Jaxpr, int] = weakref.WeakKeyDictionary()


def _capacity(jaxpr: Jaxpr) -> int:
    """How many sites the walk of `jaxpr` can register at most."""
    count = _CAPACITY.get(jaxpr)
    if count is None:
        count = _CAPACITY[jaxpr] = sum(
            1
            for eqn, _ in equations_in(jaxpr)
            if not sub_jaxprs(eqn) and any(_is_float_aval(v.aval) for v in eqn.outvars)
        )
    return count


@dataclasses.dataclass(frozen=True)
class _AllSitesRecorder:
    """`kinds` are the watched kinds, in the order of the table's rows; the table
    has at least `minimum` sites (for a program whose walk registered more sites
    than it holds: a library primitive entered by tracing its implementation)."""

    kinds: tuple[str, ...]
    minimum: int = 0
    made_only = True
    batched = True

    def start(self, jaxpr: Jaxpr, depth: int) -> Any:
        capacity = max(_capacity(jaxpr), self.minimum)
        return self.empty(jnp.zeros((capacity, len(self.kinds), 2 + depth), jnp.int32))

    def empty(self, record: Any) -> Any:
        row = np.full(record.shape[-1], -1, np.int32)
        row[0] = 0
        return jnp.broadcast_to(row, record.shape)

    def record(self, record: Any, site: int, flags: dict[str, Any], stamp: Any) -> Any:
        del stamp  # the first event's stamp is written when the jaxpr settles
        return self.record_many(record, [_Check(site, flags)])

    def record_many(self, record: Any, checks: list[_Check]) -> Any:
        # The checks of one run of a jaxpr, by runs of nearby sites: their flags
        # stacked, masked where an input held one, and added to the table with
        # one slice and update per run. The sites between them (not checked
        # here) add nothing.
        checks = sorted((c for c in checks if c.site < record.shape[0]), key=lambda c: c.site)
        start = 0
        for end in range(1, len(checks) + 1):
            if end < len(checks) and checks[end].site - checks[end - 1].site <= _JOIN_GAP:
                continue
            record = self._add_run(record, checks[start:end])
            start = end
        return record  # sites beyond the table: counted by the walk, which walks again

    def _add_run(self, record: Any, run: list[_Check]) -> Any:
        """`record` with the flags of `run` (sorted, near each other) added."""
        lo, hi = run[0].site, run[-1].site + 1
        no = np.bool_(False)
        by_site: dict[int, _Check] = {c.site: c for c in run}
        rows = [by_site.get(site) for site in range(lo, hi)]
        kinds = len(self.kinds)
        # Flags of checks run inside an `auto_axes` / `explicit_axes` region are
        # typed for the region's mesh; outside, they are typed for the record's.
        mesh = mesh_of([jax.typeof(record)])
        made = jnp.stack(
            on_mesh([no if c is None else c.flags[kind] for c in rows for kind in self.kinds], mesh)
        )
        made = jax.lax.reshape(made, (hi - lo, kinds))
        inputs = max(len(c.inherited) for c in run)
        if inputs:
            # Whether an input of each check held one: its inputs' flags side by
            # side, `or`-ed in this kernel (not one kernel per check).
            held = jnp.stack(
                on_mesh(
                    [
                        c.inherited[i] if c is not None and i < len(c.inherited) else no
                        for c in rows
                        for i in range(inputs)
                    ],
                    mesh,
                )
            )
            held = jax.lax.reshape(held, (hi - lo, inputs))
            columns = [jax.lax.index_in_dim(held, i, 1, keepdims=False) for i in range(inputs)]
            held = functools.reduce(jax.lax.bitwise_or, columns)
            fresh = jax.lax.broadcast_in_dim(jax.lax.bitwise_not(held), made.shape, (0,))
            made = jax.lax.bitwise_and(made, fresh)
        made = jax.lax.reshape(jax.lax.convert_element_type(made, np.int32), (hi - lo, kinds, 1))
        count = jax.lax.slice(record, (lo, 0, 0), (hi, kinds, 1))
        return jax.lax.dynamic_update_slice(record, count + made, (lo, 0, 0))

    def settle(self, record: Any, jaxpr: Jaxpr, stamp: Any) -> Any:
        # Within one run of a loop body (or shard_map body, or the program) every
        # check has the same stamp: the sites counted for the first time since
        # the last settle get it, in one update of the table. Those of nested
        # loops were settled at their bodies' ends, with their own stamps.
        if not _capacity(jaxpr) or not record.shape[0]:
            return record
        fresh = (record[..., 0] > 0) & (record[..., 1] < 0)
        first = jnp.where(fresh[..., None], jnp.asarray(stamp, jnp.int32), record[..., 1:])
        return _with_count(record[..., 0], first)

    def reduce(self, record: Any, position: Any, own: Any, manual: tuple[Any, ...]) -> Any:
        del position
        found = record[..., 0] > 0
        keys = [record[..., 2 + d] for d in range(record.shape[-1] - 2)]
        chosen = _first_shard(found, keys, own, manual)
        count = reduce_shards(jnp.where(own >= 0, record[..., 0], 0), manual, op="sum")
        first = jnp.where((count > 0)[..., None], _pick(chosen, record[..., 1:], manual), -1)
        return _with_count(count, first)

    def merge(self, outer: Any, inner: Any) -> Any:
        count = outer[..., 0] + inner[..., 0]
        first = jnp.where((outer[..., 0] > 0)[..., None], outer[..., 1:], inner[..., 1:])
        return _with_count(count, first)


def _with_count(count: Any, first: Any) -> Any:
    """The record whose column 0 is `count` and the others `first`. A program
    without sites has an empty table, and XLA in JAX 0.11 crashes compiling a
    concatenate of empty operands inside an eager shard_map body."""
    if not count.size:
        return jnp.zeros((*count.shape, 1 + first.shape[-1]), jnp.int32)
    return jnp.concatenate([count[..., None], first], -1)
