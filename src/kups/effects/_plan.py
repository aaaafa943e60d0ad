"""How an interpreter walks a jaxpr: per equation, whether it is control flow,
the values freed after it, and what the dispatcher lets it skip.

Computed once per jaxpr (cached weakly on it) rather than at every equation.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

from jax.extend.core import Jaxpr, JaxprEqn

from . import _compat
from ._effect import EFFECT_NAMES
from ._matching import contains_subjaxprs, holds_functions, is_control_flow
from ._untouched import Handled, Run, skipped_equations, untouched_runs

# Per jaxpr, its walking plan: for each equation, whether it is control flow and
# the variables whose last use it is (freed after it runs).
_PLANS: weakref.WeakKeyDictionary[Jaxpr, list[tuple[JaxprEqn, bool, list[Any]]]] = (
    weakref.WeakKeyDictionary()
)


def plan(jaxpr: Jaxpr) -> list[tuple[JaxprEqn, bool, list[Any]]]:
    cached = _PLANS.get(jaxpr)
    if cached is not None:
        return cached
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not _compat.is_literal(v):
                last[v] = i
        for v in eqn.outvars:
            last.setdefault(v, i)  # defined and never read: freed at once
    for v in jaxpr.outvars:
        if not _compat.is_literal(v):
            last[v] = len(jaxpr.eqns)
    for v in (*jaxpr.constvars, *jaxpr.invars):
        last.setdefault(v, -1)
    frees: list[list[Any]] = [[] for _ in jaxpr.eqns]
    for v, i in last.items():
        if 0 <= i < len(jaxpr.eqns):
            frees[i].append(v)
    plan = [(eqn, is_control_flow(eqn), free) for eqn, free in zip(jaxpr.eqns, frees, strict=True)]
    _PLANS[jaxpr] = plan
    return plan


# Per jaxpr, for each equation, whether it is a library primitive holding Python
# functions (see `holds_functions`); computed for interpreters that handle effects.
_HOLDERS: weakref.WeakKeyDictionary[Jaxpr, list[bool]] = weakref.WeakKeyDictionary()


def _function_holders(jaxpr: Jaxpr) -> list[bool]:
    holders = _HOLDERS.get(jaxpr)
    if holders is None:
        holders = _HOLDERS[jaxpr] = [
            holds_functions(eqn, _compat.KNOWN_PARAMS) for eqn in jaxpr.eqns
        ]
    return holders


class Walk(NamedTuple):
    """What an interpreter needs to walk one jaxpr with one dispatcher."""

    plan: list[tuple[JaxprEqn, bool, list[Any]]]
    # Per equation, whether it is control flow no handler touches (re-bound whole).
    skips: list[bool] | None
    # Staged: long runs of untouched equations, bound as one call, by first index.
    runs: dict[int, Run] | None
    # Whether effects go to handlers: an equation bound unchanged may then run
    # Python code that binds one unseen (a library primitive holding a function).
    watch_effects: bool
    holders: list[bool] | None
    handlers: dict[str, Any]
    rules: list[Any]
    fallback: Any


def walk_plan(jaxpr: Jaxpr, dispatcher: Any, handled: Handled | None) -> Walk:
    """How to walk `jaxpr` with `dispatcher` as it is now."""
    steps = plan(jaxpr)
    skips = skipped_equations(jaxpr, handled, steps)
    runs = untouched_runs(jaxpr, handled, steps, skips) if _compat.is_staging() else None
    watch_effects = not EFFECT_NAMES.isdisjoint(dispatcher._handlers)
    return Walk(
        steps,
        skips,
        runs,
        watch_effects,
        _function_holders(jaxpr) if watch_effects else None,
        dispatcher._handlers,
        # The stock rule only says what `is_control_flow` says; skip calling it.
        [rule for rule in dispatcher._rules if rule is not contains_subjaxprs],
        dispatcher._fallback,
    )
