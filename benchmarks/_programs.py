"""The programs the benchmarks trace, interpret and run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

# One `lax` call is exactly one equation; the cycle mixes unary and binary ops.
_OPS: tuple[Callable[[Any, Any], Any], ...] = (
    lambda y, w: lax.sin(y),
    lambda y, w: lax.mul(y, w),
    lambda y, w: lax.tanh(y),
    lambda y, w: lax.add(y, w),
    lambda y, w: lax.cos(y),
    lambda y, w: lax.sub(y, w),
)


def chain(y: Any, w: Any, num_eqns: int) -> Any:
    """`num_eqns` elementwise equations applied to `y` (with `w` as second operand)."""
    for i in range(num_eqns):
        y = _OPS[i % len(_OPS)](y, w)
    return y


def straight_line(num_eqns: int) -> Callable[[Any, Any], Any]:
    """A program of `num_eqns` straight-line equations on `(x, w)`."""

    def program(x: Any, w: Any) -> Any:
        return chain(x, w, num_eqns)

    return program


BLOCK = 50  # equations per control-flow block of the mixed programs
_KINDS = ("plain", "scan", "cond", "while", "jit", "checkpoint")


def _block(kind: str, y: Any, w: Any) -> Any:
    # The block bodies are closures built at each call, so that JAX's tracing
    # caches (keyed on the function) never hit: every trace does the full work.
    if kind == "plain":
        return chain(y, w, BLOCK)
    if kind == "scan":

        def scan_body(carry: Any, _: Any) -> tuple[Any, None]:
            return chain(carry, w, BLOCK), None

        return lax.scan(scan_body, y, None, length=4)[0]
    if kind == "cond":

        def left(y: Any) -> Any:
            return chain(y, w, BLOCK // 2)

        def right(y: Any) -> Any:
            return chain(y, w, BLOCK - BLOCK // 2)

        return lax.cond(y[0] > 0, left, right, y)
    if kind == "while":

        def cond_fun(state: Any) -> Any:
            return state[0] < 3

        def body_fun(state: Any) -> Any:
            return state[0] + 1, chain(state[1], w, BLOCK - 1)

        return lax.while_loop(cond_fun, body_fun, (0, y))[1]
    if kind == "jit":

        def jitted(y: Any) -> Any:
            return chain(y, w, BLOCK)

        return jax.jit(jitted)(y)
    if kind == "checkpoint":

        def remat_body(y: Any) -> Any:
            return chain(y, w, BLOCK)

        return jax.checkpoint(remat_body)(y)
    raise ValueError(kind)


def mixed_control_flow(num_eqns: int) -> Callable[[Any, Any], Any]:
    """About `num_eqns` equations (counted into sub-programs) in blocks of `BLOCK`,
    cycling through straight-line, `scan`, `cond`, `while`, nested `jit` and
    `checkpoint` blocks."""
    num_blocks = max(1, num_eqns // BLOCK)

    def program(x: Any, w: Any) -> Any:
        y = x
        for i in range(num_blocks):
            y = _block(_KINDS[i % len(_KINDS)], y, w)
        return y

    return program


def small_inputs() -> tuple[jax.Array, jax.Array]:
    return jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32), jnp.full((8,), 0.5, jnp.float32)


def sub_jaxprs(jaxpr: Jaxpr) -> list[Jaxpr]:
    """The jaxprs held in the equations' params (one level down)."""
    found = []
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.append(sub)
    return found


def count_eqns(jaxpr: Jaxpr | ClosedJaxpr) -> int:
    """Equations in `jaxpr` and, recursively, in every sub-jaxpr."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    return len(jaxpr.eqns) + sum(count_eqns(sub) for sub in sub_jaxprs(jaxpr))
