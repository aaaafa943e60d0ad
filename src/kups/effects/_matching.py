"""Which equations hold sub-programs that run as part of the program."""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

# Primitives whose jaxpr parameters are combiners (how to add two elements, how to
# compare them), not sub-programs of the user's: they are re-bound as they are.
COMBINER_PRIMITIVES: frozenset[str] = frozenset(
    {
        "scatter",
        "scatter-add",
        "scatter_add",
        "scatter-mul",
        "scatter_mul",
        "scatter-min",
        "scatter_min",
        "scatter-max",
        "scatter_max",
        "scatter-apply",
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "select_and_scatter_add",
        "select_and_gather_add",
        "sort",
        "argsort",
    }
)

_JAXPR_TYPES = (Jaxpr, ClosedJaxpr)


def has_jaxpr_params(params: dict[str, Any]) -> bool:
    for value in params.values():
        if isinstance(value, _JAXPR_TYPES):
            return True
        if type(value) is tuple and value and isinstance(value[0], _JAXPR_TYPES):
            return True
        if hasattr(value, "_fields") and any(isinstance(v, _JAXPR_TYPES) for v in value):
            return True  # custom_linear_solve keeps its jaxprs in a namedtuple
    return False


def is_control_flow(eqn: JaxprEqn) -> bool:
    """Whether `eqn` runs sub-programs of the user's (not only combiners)."""
    return eqn.primitive.name not in COMBINER_PRIMITIVES and has_jaxpr_params(eqn.params)


def contains_subjaxprs(ctx: Any, eqn: JaxprEqn, invals: list[Any]) -> bool:
    """The stock matching rule: true for control-flow equations.

    True when `eqn`'s parameters hold sub-programs that run as part of the program
    (`jit`, `scan`, `while`, `cond`, `shard_map`, ...); false for equations with no
    jaxpr and for those whose only jaxprs are combiners (`scatter-add`'s
    `update_jaxpr`, generic `reduce`, `reduce_window`, `sort`).

    **Arguments:**

    - `ctx`: the current context (unused).
    - `eqn`: the equation.
    - `invals`: its input values (unused).

    **Returns:**

    Whether `eqn` is a control-flow equation.
    """
    del ctx, invals
    return is_control_flow(eqn)
