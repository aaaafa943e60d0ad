"""Where the checks are: a program's check sites, found before it runs.

A loop carries, and every branch of a `cond` returns, a context of one
structure; so before a loop or cond runs, the error record gets an empty slot
for every check its body may reach. The walk is cached per jaxpr.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Iterable, Iterator

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from kups.effects import shard_map_axes, sub_jaxprs

from ._automatic import _UNKNOWN, _AutoCheck, _automatic_checks, _eqn_location, automatic_checks
from ._check import _check_p
from ._error import _Info, _Site

# Per jaxpr and kinds: its sites relative to it, `(info, loops, shard_axes,
# batch_ndim)` with the loops and manual axes it adds around each one.
_RelativeSite = tuple[_Info, int, tuple[Hashable, ...], int]
_SITES: weakref.WeakKeyDictionary[Jaxpr, dict[frozenset[str], tuple[_RelativeSite, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _relative_sites(jaxpr: Jaxpr | ClosedJaxpr, kinds: frozenset[str]) -> tuple[_RelativeSite, ...]:
    open_jaxpr: Jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    per_kinds = _SITES.setdefault(open_jaxpr, {})
    sites = per_kinds.get(kinds)
    if sites is None:
        sites = per_kinds[kinds] = tuple(_walk(open_jaxpr, kinds))
    return sites


def _walk(jaxpr: Jaxpr, kinds: frozenset[str]) -> Iterator[_RelativeSite]:
    """The sites the handlers below will meet in `jaxpr`: a `scan` or `while` body
    adds a loop level, a `shard_map` body its manual axes; an equation that is not
    control flow goes to the fallback handler, whose checks apply to it. An
    automatic check with no source line of its own takes that of the nearest
    control flow around it that has one (`_located`)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.primitive is _check_p:
            if "user" in kinds:
                yield eqn.params["site"], 0, (), _batch_ndim(eqn)
        elif subs := sub_jaxprs(eqn):
            loops = 1 if name in ("scan", "while") else 0
            axes = shard_map_axes(eqn)[1] if name == "shard_map" else ()
            location = _eqn_location(eqn)
            for sub in subs:
                for info, num_loops, shard_axes, batch_ndim in _relative_sites(sub, kinds):
                    info = _located(info, location)
                    yield info, num_loops + loops, (*axes, *shard_axes), batch_ndim
        elif kinds & automatic_checks:
            for info in _automatic_checks(eqn, kinds, _UNKNOWN):
                yield info, 0, (), 0


def _located(info: _Info, enclosing: str | None) -> _Info:
    """`info`, with the line of the control flow around it if it has none."""
    if isinstance(info, _AutoCheck) and info.location == _UNKNOWN and enclosing is not None:
        return dataclasses.replace(info, location=enclosing)
    return info


def _sites_in(
    jaxprs: Iterable[Jaxpr | ClosedJaxpr],
    num_loops: int,
    shard_axes: tuple[Hashable, ...],
    kinds: frozenset[str],
    enclosing: str | None,
) -> Iterator[_Site]:
    """The sites of the checks in `jaxprs` and in everything they call, as the
    handlers will see them inside `num_loops` loops and `shard_axes`, and inside
    control flow at `enclosing`."""
    for jaxpr in jaxprs:
        for info, loops, axes, batch_ndim in _relative_sites(jaxpr, kinds):
            yield _Site(
                _located(info, enclosing), num_loops + loops, (*shard_axes, *axes), batch_ndim
            )


def _batch_ndim(eqn: JaxprEqn) -> int:
    """The vmap axes of a check: its predicate is a scalar but for them."""
    return eqn.invars[0].aval.ndim  # pyright: ignore[reportAttributeAccessIssue]
