"""`stage_eagerly`: an effect called without `jit` runs as one compiled program."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax

from .. import _compat
from .._reinterpret import described_by, user_signature

F = TypeVar("F", bound=Callable[..., Any])


def stage_eagerly(wrapper: F, *, finish: Callable[[Any], Any] | None = None) -> F:
    """`wrapper`, compiled as a whole when it is called eagerly.

    An effect's wrapper called without `jax.jit` would run its interpreted
    program op by op, as eager JAX runs a function: every check, counter and
    shard reduction the effect adds is one more dispatch, and an eager
    `shard_map` body runs each of them on every device. This runs the wrapper
    under `equinox.filter_jit` instead when no transformation is tracing (array
    leaves of the arguments are traced, the others are static), compiled on the
    first call and reused by the next ones with the same shapes, dtypes and
    static arguments. Under `jit`, `vmap`, `grad` or inside a `shard_map` body it
    calls `wrapper` as it is, and so it does when a static argument cannot be
    hashed (as eager JAX would run it), or when tracing the compiled call fails
    (a program that runs eagerly but not under `jit`, such as one whose arrays
    are sharded over a mesh of Explicit axes that `jax.set_mesh` did not set).
    An error the compiled program raises while it runs (a `RuntimeError`: an
    `equinox.error_if`, a callback that raised) is raised as it is: the program
    is not run a second time.

    The results are those of `jax.jit`: a compiled program may round the last
    bits differently from the same operations run one by one.

    **Arguments:**

    - `wrapper`: the function an effect returns (`*args, **kwargs -> out`).
    - `finish`: applied to the results of a compiled call, outside the compiled
      program: to give them the form an eager call gives (Python `int`s for
      concrete counts, say).

    **Returns:**

    A callable with `wrapper`'s name, signature and results, which JAX's messages
    describe by the source `wrapper` is described by.

    **Example:**

    ```python
    import jax.numpy as jnp
    from kups.effects import Interpreter, default_dispatcher, reinterpret
    from kups.effects.toolkit import stage_eagerly


    def identity_effect(fn):
        def wrapped(*args):
            return reinterpret(fn, Interpreter(default_dispatcher()))(None, *args)[0]

        return stage_eagerly(wrapped)


    run = identity_effect(jnp.sin)
    assert run(jnp.zeros(3)).tolist() == [0.0, 0.0, 0.0]  # compiled once, here
    ```
    """
    staged: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not _compat.is_eager() or not _hashable_statics((args, kwargs)):
            return wrapper(*args, **kwargs)
        if not staged:
            staged.append(eqx.filter_jit(wrapper))
        try:
            result = staged[0](*args, **kwargs)
        except RuntimeError:
            # The compiled program ran and failed (an `equinox.error_if`, a callback
            # that raised): running it again op by op would repeat what it did.
            raise
        except Exception:  # noqa: BLE001  (rerun op by op: it raises what eager raises)
            return wrapper(*args, **kwargs)
        return result if finish is None else finish(result)

    for name in ("__name__", "__qualname__", "__doc__", "__module__"):
        if hasattr(wrapper, name):
            setattr(call, name, getattr(wrapper, name))
    bounded = _compat.api_boundary(call)
    if "__wrapped__" in bounded.__dict__:
        del bounded.__wrapped__  # the wrapper is not `wrapper`'s callee
    # JAX describes it by the source `wrapper` is described by (the effect's `fn`).
    signature = functools.partial(user_signature, wrapper)
    return described_by(bounded, wrapper, signature)  # pyright: ignore[reportReturnType]


def _hashable_statics(tree: Any) -> bool:
    """Whether every leaf that is not an array can be hashed (filter_jit needs it)."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array, inverse=True))
    try:
        hash(tuple(leaves))
    except TypeError:
        return False
    return True
