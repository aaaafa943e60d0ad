"""Small public types shared by the interpreter and the handlers."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax

from . import _compat


class HandlerResult(NamedTuple):
    """What a handler returns: the new context and one value per equation output.

    **Arguments:**

    - `ctx`: the context after the equation.
    - `outvals`: a `list` with one value per `eqn.outvars`, of the same shape and
      dtype as the equation's outputs.
    """

    ctx: Any
    outvals: list[Any]


class InterpreterPolicy(enum.Enum):
    """What the interpreter does with a control-flow equation that no handler takes.

    - `RAISE`: raise `NotImplementedError` naming the primitive, the user's source
      line and how to register a handler (the default: effects inside the
      sub-program would otherwise be lost without a word).
    - `WARN`: warn the same, then re-bind the equation unchanged.
    - `IGNORE`: re-bind the equation unchanged.
    """

    RAISE = "raise"
    WARN = "warn"
    IGNORE = "ignore"


def check_policy(policy: Any, caller: str) -> None:
    """Raises a `TypeError` unless `policy` is an `InterpreterPolicy`.

    For wrappers that take `policy=` and pass it to the `Interpreter` they build;
    the message names `caller` and, for a string such as `"ignore"`, the member
    meant.

    **Arguments:**

    - `policy`: what the user passed.
    - `caller`: how the user called it, e.g. `"count_primitives(fn, policy=...)"`.
    """
    if isinstance(policy, InterpreterPolicy):
        return
    hint = ""
    if isinstance(policy, str) and policy.upper() in InterpreterPolicy.__members__:
        hint = f" For {policy!r}, pass InterpreterPolicy.{policy.upper()}."
    raise TypeError(
        f"{caller} takes an InterpreterPolicy, one of InterpreterPolicy.RAISE, "
        f"InterpreterPolicy.WARN or InterpreterPolicy.IGNORE (from kups.effects import "
        f"InterpreterPolicy); got {policy!r}.{hint}"
    )


class ScanSemantics(enum.Enum):
    """How `default_scan_handler` threads the context through the iterations.

    - `CARRY`: the context is a loop carry; each iteration sees the previous
      iteration's context.
    - `RESULT`: leaves that existed before the scan are carried; leaves the body
      adds come back stacked along a new leading axis, entry `i` belonging to
      `xs[i]`, like the scan's own stacked outputs.
    """

    CARRY = "carry"
    RESULT = "result"


class Uninitialized(jax.ShapeDtypeStruct):
    """A context leaf with no value yet.

    It is a `jax.ShapeDtypeStruct` with the shape, dtype, sharding and manual axes
    of `aval`, so specs and initial values can be computed from it.

    **Arguments:**

    - `aval`: an abstract value (`jax.typeof(x)`), a `ShapeDtypeStruct` or an array.
    """

    def __init__(self, aval: Any):
        if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
            raise TypeError(
                f"Uninitialized(aval) needs an abstract value with a shape and a dtype, "
                f"got {type(aval).__name__}: {aval!r}."
            )
        if isinstance(aval, jax.ShapeDtypeStruct):
            struct = aval
        else:
            if not isinstance(aval, _compat.ShapedArray):
                aval = _compat.aval_of(aval)
            struct = _compat.shape_dtype_struct(aval)
        super().__init__(
            struct.shape,
            struct.dtype,
            sharding=struct.sharding,
            weak_type=struct.weak_type,
            manual_axis_type=getattr(struct, "manual_axis_type", None),
        )

    def __repr__(self) -> str:
        axes = _compat.varying_axes(self)
        suffix = f", varying over {sorted(axes)}" if axes else ""
        return f"Uninitialized({self.dtype.name}{list(self.shape)}{suffix})"
