"""The context of `plant`, and how a planted value reaches the sow it replaces:
one entry per enclosing scan iteration and shard."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn
from jax.sharding import PartitionSpec
from jax.tree_util import GetAttrKey

from kups.effects import source_line, varying_axes

from ._names import NameKey, SowPath, Tag, describe, named, path_of, show_path

# How `plant` gets from a planted value to the value one sow receives: the
# planted value's leading axes, outermost first, each either a shard_map's shard
# axes (`(SHARD, number of manual axes)`: entry 0 of each, once the shard_map
# has split them) or a scan's iteration axis (the scan's level, an int: its
# iteration counter is `counters[level]`).
SHARD = "shard"


class Planted:
    """The context of `plant`: the planted values as the user gave them (scopes
    are nested dicts), how to index the value at each path for the sow at hand,
    and one iteration counter per enclosing scan."""

    def __init__(
        self,
        tag: Tag,
        values: Mapping[str, Any],
        pending: Mapping[SowPath, tuple[Any, ...]],
        loops: tuple[tuple[int, bool], ...],
        counters: tuple[Any, ...],
    ):
        self.tag = tag
        self.values = dict(values)
        self.pending = {path: ops for path, ops in pending.items() if ops}
        self.loops = loops  # (length, reverse) of each enclosing scan, outermost first
        self.counters = counters

    def ops(self, path: SowPath) -> tuple[Any, ...]:
        return self.pending.get(path, ())

    def replace(
        self,
        *,
        values: Mapping[str, Any] | None = None,
        pending: Mapping[SowPath, tuple[Any, ...]] | None = None,
        loops: tuple[tuple[int, bool], ...] | None = None,
        counters: tuple[Any, ...] | None = None,
    ) -> Planted:
        return Planted(
            self.tag,
            self.values if values is None else values,
            self.pending if pending is None else pending,
            self.loops if loops is None else loops,
            self.counters if counters is None else counters,
        )


def _flatten_planted(ctx: Planted) -> tuple[list[tuple[Any, Any]], Any]:
    names = tuple(sorted(ctx.values))
    children = [(NameKey(ctx.tag, (name,)), ctx.values[name]) for name in names]
    children.append((GetAttrKey("counters"), ctx.counters))
    return children, (ctx.tag, names, tuple(sorted(ctx.pending.items())), ctx.loops)


def _unflatten_planted(aux: Any, children: Iterable[Any]) -> Planted:
    tag, names, pending, loops = aux
    *values, counters = children
    return Planted(tag, dict(zip(names, values, strict=True)), dict(pending), loops, counters)


jax.tree_util.register_pytree_with_keys(Planted, _flatten_planted, _unflatten_planted)

MISSING = object()


def lookup(tag: Tag, values: Mapping[str, Any], path: SowPath, eqn: JaxprEqn) -> Any:
    """The planted value at `path` (scopes are nested dicts), or `MISSING`."""
    node: Any = values
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping):
            raise TypeError(
                f"{describe(tag, path)} is sown at {source_line(eqn)}, inside scope "
                f"{show_path(path[:depth])!r}, but the value planted for {show_path(path[:depth])!r} is "
                f"a {type(node).__name__}, not a dict. Plant the names of a scope as a dict: "
                f"values[scope][name], as reap returns them."
            )
        if key not in node:
            return MISSING
        node = node[key]
    return node


def replace_at(tree: Any, path: SowPath, new: Any) -> Any:
    """`tree` (nested dicts) with the entry at `path` replaced by `new`."""
    if not path:
        return new
    return {**tree, path[0]: replace_at(tree[path[0]], path[1:], new)}


def unused_paths(
    values: Mapping[str, Any], used: set[SowPath], prefix: SowPath = ()
) -> list[SowPath]:
    """The paths of `values` that no sow used (a scope counts as a dict of names)."""
    unused = []
    for key, value in values.items():
        path = (*prefix, key)
        if path in used:
            continue
        inside = any(p[: len(path)] == path for p in used)
        if inside and isinstance(value, Mapping):
            unused.extend(unused_paths(value, used, path))
        else:
            unused.append(path)
    return unused


def split_axis(leaf: Any, *, axis: int, sizes: list[int]) -> Any:
    """`leaf` with its axis `axis` split into axes of `sizes`."""
    shape = jnp.shape(leaf)
    return jnp.reshape(leaf, (*shape[:axis], *sizes, *shape[axis + 1 :]))


def shard_spec(
    leaf: Any, varying: frozenset[Any], *, axis: int, manual_axes: tuple[Any, ...]
) -> PartitionSpec:
    """The in-spec of a planted leaf whose axes from `axis` on are the manual axes."""
    del leaf
    return PartitionSpec(*(None,) * axis, *(a if a in varying else None for a in manual_axes))


def varying_axes_of(
    sows: list[JaxprEqn], value: Any, manual_axes: tuple[Any, ...], check_vma: bool
) -> Any:
    """For each leaf of a planted `value`, the manual axes over which the values
    sown into it (by `sows`, inside a shard_map body) vary.

    Without `check_vma`, JAX does not track them: every value may vary.
    """
    treedef = jax.tree.structure(value)
    everywhere = jax.tree.unflatten(treedef, [frozenset(manual_axes)] * treedef.num_leaves)
    if not check_vma or any(e.params["tree"] != treedef for e in sows):
        return everywhere
    per_leaf = [
        frozenset().union(*(varying_axes(e.invars[i + e.params["conditional"]].aval) for e in sows))
        for i in range(treedef.num_leaves)
    ]
    return jax.tree.unflatten(treedef, per_leaf)


def check_axis(tag: Tag, path: SowPath, ctx: Planted, size: int, where: str, eqn: JaxprEqn) -> None:
    """The planted value at `path` has `size` entries along its next pending axis."""
    axis = pending_axes(ctx.ops(path))
    for leaf in jax.tree.leaves(lookup(tag, ctx.values, path, eqn)):
        shape = jnp.shape(leaf)
        if len(shape) <= axis or shape[axis] != size:
            raise ValueError(
                f"kups.harvest: the value planted for {named(path)} of tag {tag!r} "
                f"has shape {shape}, but {where} needs {size} entries along its axis {axis} (one "
                f"per iteration or shard, as reap returns it)."
            )


def pending_axes(ops: tuple[Any, ...]) -> int:
    """How many leading axes of a planted value `ops` index away."""
    return sum(op[1] if isinstance(op, tuple) else 1 for op in ops)


def entry_for(ctx: Planted, op: Any, leaf: Any) -> Any:
    """The entry of `leaf` along its leading axis for the current shard or iteration."""
    if isinstance(op, tuple):  # (SHARD, number of manual axes)
        return leaf[(0,) * op[1]]
    length, reverse = ctx.loops[op]
    if length == 0:
        # The body of a zero-length scan is traced but never runs: any value of the
        # entry's type will do. The (zero) sum over the empty axis keeps the leaf's
        # varying manual axes, which a scan carry inside shard_map must keep.
        return jnp.sum(leaf, axis=0, dtype=jnp.result_type(leaf))
    iteration = ctx.counters[op]
    index = length - 1 - iteration if reverse else iteration
    return jax.lax.dynamic_index_in_dim(leaf, index, axis=0, keepdims=False)


def planted_leaves(tag: Tag, eqn: JaxprEqn, value: Any, invals: list[Any]) -> list[Any]:
    """The planted value's leaves, checked against what the sow at `eqn` sows."""
    params = eqn.params
    leaves, treedef = jax.tree.flatten(value)
    sown = jax.tree.unflatten(params["tree"], invals)

    def mismatch(detail: str) -> ValueError:
        return ValueError(
            f"kups.harvest: the value planted for {named(path_of(eqn))} of tag {tag!r} "
            f"does not fit the sow at {source_line(eqn)}: {detail}. Plant a value of the form "
            f"reap returns for this name."
        )

    if treedef != params["tree"]:
        raise mismatch(f"its structure is {treedef}, the sown value's is {params['tree']}")
    out = []
    for leaf, inval in zip(leaves, invals, strict=True):
        leaf_type, sown_type = jax.typeof(leaf), jax.typeof(inval)
        if leaf_type.shape != sown_type.shape:
            raise mismatch(
                f"it has shape {leaf_type.shape} (per sow), the sown value "
                f"{jax.tree.map(jnp.shape, sown)}"
            )
        if leaf_type.dtype != sown_type.dtype:
            if not leaf_type.weak_type:
                raise mismatch(f"it has dtype {leaf_type.dtype}, the sown value {sown_type.dtype}")
            leaf = jax.lax.convert_element_type(leaf, sown_type.dtype)
        out.append(leaf)
    return out
