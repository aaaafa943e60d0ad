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


# ------------------------------------------- programs with one handled primitive

SOW_TAG = "probe"  # the tag the "pay only for what you handle" programs sow under
# A `sow` function: `kups.harvest.sow`, or a peer's with the same keywords.
SowFn = Callable[..., Any]


def _no_sow(value: Any, **_: Any) -> Any:
    return value


def model_inputs() -> tuple[jax.Array, jax.Array]:
    """`(x, w)` for `jnp_model`: a vector of 8 and an 8 x 8 weight."""
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    w = jnp.linspace(-0.3, 0.3, 64, dtype=jnp.float32).reshape(8, 8)
    return x, w


def _model_stage(h: Any, w: Any, *, inner: bool, sow: SowFn) -> Any:
    """One stage of `jnp_model`: a jitted block of a `scan` and a `fori_loop`
    around `jnp` code (whose `clip`, `norm`, `silu`, `var`, `where` are jits
    themselves), then more `jnp` code. With `inner`, the scan body also sows (in
    the `append` mode) and calls `jnp.cumsum` (a jit around the `cumsum`
    primitive): the one place in the program a handler has anything to do."""

    # Fresh closures at each call, so that tracing `f` never hits JAX's caches
    # for the user's own functions (the `jnp` functions' caches hit, as they do in
    # any program).
    def step(carry: Any, _: Any) -> tuple[Any, None]:
        z = jnp.tanh(carry @ w)
        z = jnp.clip(z, -2.0, 2.0)
        z = z / (1.0 + jnp.linalg.norm(z))
        if inner:
            z = z + 0.1 * jnp.cumsum(z)
            z = sow(z, tag=SOW_TAG, name="inner", mode="append")
        return z, None

    def loop_body(_: Any, h: Any) -> Any:
        return jax.nn.silu(h) * 0.5 + jnp.var(h)

    def block(h: Any) -> Any:
        h, _ = lax.scan(step, h, None, length=2)
        return lax.fori_loop(0, 2, loop_body, h)

    h = jax.jit(block)(h)
    h = jnp.where(h > 0, h, 0.1 * h)
    return jnp.sin(h) + jnp.mean(h)


def _stage_eqns() -> int:
    x, w = model_inputs()
    closed = jax.make_jaxpr(lambda h, w: _model_stage(h, w, inner=False, sow=_no_sow))(x, w)
    return count_eqns(closed)


def jnp_model(num_eqns: int, sow: SowFn = _no_sow) -> Callable[[Any, Any], Any]:
    """About `num_eqns` equations (counted into sub-programs) of `jnp` code in
    stages of nested `jit`s and loops (see `_model_stage`), on `model_inputs()`.

    `sow` (`kups.harvest.sow`, or a peer's) sows twice under `SOW_TAG`: once in
    the first stage's innermost loop body, once at the top level. Without it the
    program is the same with the sows left out. The program calls `jnp.cumsum`
    once, in the same loop body.
    """
    num_stages = max(1, round(num_eqns / _stage_eqns()))

    def program(x: Any, w: Any) -> Any:
        h = x
        for i in range(num_stages):
            h = _model_stage(h, w, inner=i == 0, sow=sow)
            if i == num_stages // 2:
                h = sow(h, tag=SOW_TAG, name="top", mode="strict")
        return jnp.sum(h)

    return program


def straight_line_handled(num_eqns: int, sow: SowFn = _no_sow) -> Callable[[Any, Any], Any]:
    """`straight_line(num_eqns)` with, halfway down the top level, one `cumsum`
    (`lax.cumsum`) and, with `sow`, one sow under `SOW_TAG` (on `small_inputs()`)."""
    half = num_eqns // 2

    def program(x: Any, w: Any) -> Any:
        y = chain(x, w, half)
        y = lax.cumsum(y)
        y = sow(y, tag=SOW_TAG, name="top", mode="strict")
        return chain(y, w, num_eqns - half - 2)

    return program
