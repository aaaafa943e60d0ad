"""`report="reaching"`: which inputs' origins an overwrite or a `select_n` keeps,
judged by what it takes of each (`_taint_rules` applies them)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn

from ._taint_origin import _Origin, _validated
from ._taint_tables import _OVERWRITES


def _survivors(
    eqn: JaxprEqn, invals: list[Any], origins: list[Any], kinds: tuple[str, ...]
) -> list[Any]:
    """The origins of an overwrite's operand and update (`_OVERWRITES`): the
    operand's is kept only if what the update leaves of it is not finite (checked
    with the update replaced by zeros)."""
    of, at = _OVERWRITES[eqn.primitive.name]
    operand, update = origins[of], origins[at]
    with_zeros = list(invals)
    with_zeros[at] = jnp.zeros_like(invals[at])
    rest = eqn.primitive.bind(*with_zeros, **eqn.params)
    if eqn.primitive.multiple_results:  # equinox's maybe_set: one output
        (rest,) = rest
    kept = [update] if isinstance(update, _Origin) else []
    if isinstance(operand, _Origin):
        kept.append(_validated(operand, rest, kinds))
    return kept


def _taken(invals: list[Any], i: int) -> Any:
    """What a `select_n`'s predicate takes of case `i`, zeros where it takes
    another case."""
    cases = [value if j == i else jnp.zeros_like(value) for j, value in enumerate(invals)]
    return jax.lax.select_n(invals[0], *cases[1:])


def _selected(invals: list[Any], origins: list[Any], kinds: tuple[str, ...]) -> list[Any]:
    """The origins of a `select_n`'s cases, each kept only if what the predicate
    takes of it is not finite."""
    return [
        _validated(origin, _taken(invals, i), kinds)
        for i, origin in enumerate(origins)
        if i > 0 and isinstance(origin, _Origin)
    ]


def _taken_pieces(
    invals: list[Any], i: int, origins: list[Any], axis: int, bounds: tuple[int, ...], kinds: Any
) -> list[Any]:
    """The piece origins of a `select_n`'s case `i`, each kept only if what the
    predicate takes of the case in that piece is not finite."""
    taken = _taken(invals, i)
    return [
        _validated(origin, jax.lax.slice_in_dim(taken, bounds[k], bounds[k + 1], axis=axis), kinds)
        for k, origin in enumerate(origins)
    ]
