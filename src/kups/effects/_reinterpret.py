"""`reinterpret`: trace a Python function and interpret it with a context."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from ._interpreter import Interpreter

Ctx = TypeVar("Ctx")


def reinterpret(fn: Callable[..., Any], interpreter: Interpreter) -> Callable[..., tuple[Any, Any]]:
    """Wraps `fn` so that it runs under `interpreter`, threading a context.

    `fn` is traced on the given pytree arguments; leaves that are not arrays
    (functions, strings, `None`, Python numbers) are static, as in equinox's filter
    transformations, so an `equinox.Module` can be passed as it is. The result
    works eagerly and under `jax.jit`, `vmap`, `grad`, `jvp`, `vjp`, `shard_map`,
    and can itself be interpreted again.

    **Arguments:**

    - `fn`: the function to interpret.
    - `interpreter`: the `Interpreter` to run it with.

    **Returns:**

    `wrapped(ctx, *args, **kwargs) -> (out, ctx)`.

    **Example:**

    ```python
    import jax.numpy as jnp
    from kups.effects import Interpreter, default_dispatcher, reinterpret


    def f(x, scale=2.0):
        return jnp.tanh(x) * scale


    identity = Interpreter(default_dispatcher())
    out, ctx = reinterpret(f, identity)(0, jnp.ones(3), scale=3.0)
    assert (out == f(jnp.ones(3), scale=3.0)).all() and ctx == 0
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"reinterpret(fn, interpreter) needs a callable fn, got {type(fn).__name__}: "
            f"{fn!r}. Did you swap the arguments?"
        )
    if not isinstance(interpreter, Interpreter):
        raise TypeError(
            f"reinterpret(fn, interpreter) needs a kups.effects.Interpreter, got "
            f"{type(interpreter).__name__}. Build one with Interpreter(default_dispatcher())."
        )

    @functools.wraps(fn)
    def wrapped(ctx: Ctx, *args: Any, **kwargs: Any) -> tuple[Any, Ctx]:
        dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
        dyn_leaves, dyn_tree = jax.tree.flatten(dynamic)
        out_static: list[Any] = []

        def flat_fn(*leaves: Any) -> list[Any]:
            call_args, call_kwargs = eqx.combine(jax.tree.unflatten(dyn_tree, leaves), static)
            out = fn(*call_args, **call_kwargs)
            out_dynamic, out_static_part = eqx.partition(out, eqx.is_array)
            out_leaves, out_tree = jax.tree.flatten(out_dynamic)
            out_static.append((out_tree, out_static_part))
            return out_leaves

        closed = jax.make_jaxpr(flat_fn)(*dyn_leaves)
        outs, ctx = interpreter(closed, ctx, *dyn_leaves)
        outs = [_as_array(out) for out in outs]
        out_tree, out_static_part = out_static[0]
        return eqx.combine(jax.tree.unflatten(out_tree, outs), out_static_part), ctx

    return wrapped


def _as_array(value: Any) -> Any:
    """An output that the jaxpr holds as a literal (a `TypedFloat`, a NumPy scalar)
    as the `jax.Array` that calling the function returns."""
    if isinstance(value, jax.Array):
        return value
    aval = jax.typeof(value)
    return jnp.asarray(value) if aval.weak_type else jnp.asarray(value, dtype=aval.dtype)
