"""`default_dispatcher`: a handler for every control-flow primitive of JAX."""

from __future__ import annotations

from ._dispatcher import Dispatcher
from ._matching import contains_subjaxprs
from .handlers import (
    default_checkpoint_handler,
    default_closed_call_handler,
    default_cond_handler,
    default_custom_jvp_handler,
    default_custom_linear_solve_handler,
    default_custom_vjp_handler,
    default_custom_vmap_handler,
    default_jit_handler,
    default_library_primitive_handler,
    default_remat_opt_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
)

# Names, not Primitive objects: `jax.extend` does not export every one of them
# (`shard_map` in JAX 0.10), and a name and its primitive are the same key.
DEFAULT_HANDLERS = {
    "jit": default_jit_handler,
    "pjit": default_jit_handler,  # the name of `jit` before JAX 0.7
    "scan": default_scan_handler,
    "while": default_while_handler,
    "cond": default_cond_handler,
    "remat2": default_checkpoint_handler,
    "checkpoint": default_checkpoint_handler,
    "custom_jvp_call": default_custom_jvp_handler,
    "custom_vjp_call": default_custom_vjp_handler,
    "custom_vjp_call_jaxpr": default_custom_vjp_handler,
    "remat_opt": default_remat_opt_handler,
    "custom_vmap_call": default_custom_vmap_handler,
    "closed_call": default_closed_call_handler,
    "eval_jaxpr": default_closed_call_handler,  # a call of a jaxpr, from JAX 0.11
    "core_call": default_closed_call_handler,
    "call": default_closed_call_handler,
    "shard_map": default_shard_map_handler,
    "custom_linear_solve": default_custom_linear_solve_handler,
    # Library primitives kups goes inside (docs/equinox.md): lineax's solve, and
    # equinox's batched form of it (a `vprim`, under `jax.vmap`).
    "linear_solve": default_library_primitive_handler,
    "vprim": default_library_primitive_handler,
}


def default_dispatcher() -> Dispatcher:
    """A fresh dispatcher with the default handler of every control-flow primitive.

    `Interpreter(default_dispatcher())` with no other handler is an identity:
    `reinterpret(f, interpreter)(ctx, *args)` returns `(f(*args), ctx)`. Its
    matching rule is `contains_subjaxprs`, so a control-flow primitive it does not
    know is unhandled and the interpreter's policy decides (by default: raise).

    **Returns:**

    A new `Dispatcher`; changing it changes no other.
    """
    dispatcher = Dispatcher(DEFAULT_HANDLERS)
    dispatcher.register_custom_matching_rule(contains_subjaxprs)
    return dispatcher
