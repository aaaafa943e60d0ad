"""Flattening a context into traced values and static Python values.

A context is any pytree. Its array-like leaves (arrays, tracers, NumPy and Python
scalars) are values that flow through sub-programs; its other leaves (strings,
functions, ...) are static and travel beside the traced program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.tree_util import KeyPath, keystr

from . import _compat
from ._types import Uninitialized

_SCALAR_TYPES = (bool, int, float, complex, np.generic, np.ndarray)


def is_value(leaf: Any) -> bool:
    """Whether a context leaf is a traced value (not a static Python object)."""
    if isinstance(leaf, _compat.Tracer):  # the usual leaf, checked before the ABC
        return True
    if isinstance(leaf, Uninitialized):
        return False
    return isinstance(leaf, (jax.Array, *_SCALAR_TYPES))


def _aval(leaf: Any) -> Any:
    return _compat.aval_of(leaf)


@dataclass(frozen=True)
class CtxSpec:
    """The static description of a context: its tree, its static leaves and the
    abstract values of its traced leaves."""

    treedef: Any
    paths: tuple[KeyPath, ...]
    value_mask: tuple[bool, ...]
    statics: tuple[Any, ...]
    avals: tuple[Any, ...]

    @property
    def num_values(self) -> int:
        return len(self.avals)

    def hash_key(self) -> Any:
        """A hashable key, or `None` when a static leaf is not hashable."""
        try:
            hash(self.statics)
        except TypeError:
            return None
        return (self.treedef, self.value_mask, self.statics, self.avals)

    def match_key(self) -> Any:
        """`hash_key` with each aval's sharding left out (see `_compat.aval_match_key`);
        call only when `hash_key` is not `None`."""
        return (
            self.treedef,
            self.value_mask,
            self.statics,
            tuple(map(_compat.aval_match_key, self.avals)),
        )

    def unflatten(self, values: Sequence[Any]) -> Any:
        values_iter = iter(values)
        statics_iter = iter(self.statics)
        leaves = [next(values_iter) if m else next(statics_iter) for m in self.value_mask]
        return jax.tree.unflatten(self.treedef, leaves)

    def uninitialized(self) -> Any:
        """The context with every leaf an `Uninitialized` of its aval."""
        avals = iter(self.avals)
        statics = iter(self.statics)
        leaves = [Uninitialized(next(avals)) if m else next(statics) for m in self.value_mask]
        return jax.tree.unflatten(self.treedef, leaves)

    def same_as(self, other: CtxSpec) -> bool:
        return (
            self.treedef == other.treedef
            and self.value_mask == other.value_mask
            and _statics_equal(self.statics, other.statics)
            and all(map(same_type, self.avals, other.avals))
        )

    def describe(self) -> dict[str, str]:
        """`{path: 'f32[3]'}` for every leaf, for error messages."""
        out: dict[str, str] = {}
        avals = iter(self.avals)
        statics = iter(self.statics)
        for path, m in zip(self.paths, self.value_mask, strict=True):
            out[keystr(path)] = next(avals).str_short() if m else f"static {next(statics)!r}"
        return out


def _statics_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        try:
            if not bool(x == y):
                return False
        except Exception:  # noqa: BLE001 - objects whose == is not a bool are different
            return False
    return True


def same_type(a: Any, b: Any) -> bool:
    """Same shape and dtype (weak types and shardings aside)."""
    return a.shape == b.shape and a.dtype == b.dtype


def split(ctx: Any) -> tuple[CtxSpec, list[Any]]:
    """The spec of `ctx` and its traced leaves, in order."""
    leaves, treedef = jax.tree_util.tree_flatten(ctx)
    paths = _paths_of(treedef, ctx)
    mask = tuple(map(is_value, leaves))
    values = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
    statics = tuple(leaf for leaf, m in zip(leaves, mask, strict=True) if not m)
    avals = tuple(map(_aval, values))
    return CtxSpec(treedef, paths, mask, statics, avals), values


# The key paths of the leaves of a tree structure: the same for every context of
# that structure, and several times dearer to flatten with than without them.
_PATHS: dict[Any, tuple[KeyPath, ...]] = {}
_MAX_PATHS = 4096


def _paths_of(treedef: Any, ctx: Any) -> tuple[KeyPath, ...]:
    paths = _PATHS.get(treedef)
    if paths is None:
        paths = tuple(p for p, _ in jax.tree_util.tree_flatten_with_path(ctx)[0])
        if len(_PATHS) >= _MAX_PATHS:
            _PATHS.clear()
        _PATHS[treedef] = paths
    return paths


def spec_from_avals(spec: CtxSpec, avals: Sequence[Any]) -> CtxSpec:
    return CtxSpec(spec.treedef, spec.paths, spec.value_mask, spec.statics, tuple(avals))


def diff(a: CtxSpec, b: CtxSpec) -> list[str]:
    """Human-readable differences between two context specs, by path."""
    da, db = a.describe(), b.describe()
    lines = []
    for path in sorted(set(da) | set(db)):
        left, right = da.get(path, "absent"), db.get(path, "absent")
        if left != right:
            lines.append(f"  ctx{path}: {left} vs {right}")
            if left.startswith("static ") and right.startswith("static "):
                lines.append(
                    f"  (ctx{path} is not an array, so kups keeps it static and it cannot "
                    f"change here; if it holds arrays, register its type as a pytree, e.g. "
                    f"with jax.tree_util.register_dataclass or as an equinox.Module)"
                )
    if not lines and a.treedef == b.treedef and a.value_mask == b.value_mask:
        # Static leaves that differ but print the same.
        statics = iter(zip(a.statics, b.statics, strict=True))
        for path, m in zip(a.paths, a.value_mask, strict=True):
            if not m:
                left, right = next(statics)
                if not _statics_equal((left,), (right,)):
                    lines.append(
                        f"  ctx{keystr(path)}: static {left!r} vs static {right!r} (objects "
                        f"that are not equal, though they print the same: kups compares "
                        f"static leaves with ==; give the type an __eq__, or, if it holds "
                        f"arrays, register it as a pytree, e.g. with "
                        f"jax.tree_util.register_dataclass or as an equinox.Module)"
                    )
    if not lines and a.treedef != b.treedef:
        lines.append(f"  tree structure: {a.treedef} vs {b.treedef}")
    return lines


def _holds_tracer(leaf: Any) -> bool:
    """Whether a static leaf is, or directly holds in an attribute, a tracer."""
    if isinstance(leaf, _compat.Tracer):
        return True
    attributes = list(getattr(leaf, "__dict__", {}).values())
    attributes += [getattr(leaf, name, None) for name in getattr(type(leaf), "__slots__", ())]
    return any(isinstance(value, _compat.Tracer) for value in attributes)


def leaked_static_paths(ctx_before: Any, ctx_after: Any) -> list[tuple[str, str]]:
    """`(path, type name)` of the static leaves of `ctx_after` that are new (not a
    leaf of `ctx_before`) and hold a tracer: an object that is not a pytree,
    carrying an array out of a traced body, where the array's tracer is dead."""
    if all(map(is_value, jax.tree.leaves(ctx_after))):
        return []  # the usual context: arrays only, nothing static to look at
    before = {id(leaf) for leaf in jax.tree.leaves(ctx_before)}
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(ctx_after)
    return [
        (keystr(path), type(leaf).__name__)
        for path, leaf in path_leaves
        if not is_value(leaf) and id(leaf) not in before and _holds_tracer(leaf)
    ]


def uninitialized_paths(ctx: Any) -> list[str]:
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(ctx)
    return [keystr(p) for p, leaf in path_leaves if isinstance(leaf, Uninitialized)]
