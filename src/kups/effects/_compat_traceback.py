"""Adapters for JAX's traceback filtering and trace state (JAX 0.10 to 0.12).

JAX removes its own frames from the traceback of an error that crosses one of its
API boundaries (`jax.jit`, `jax.grad`, ...), unless `JAX_TRACEBACK_FILTERING=off`.
kups joins that mechanism: its frames are registered as JAX's are, and its entry
points are API boundaries, so an error in a user's function or handler shows the
user's frames only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from jax._src import core as _core
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import partial_eval as _pe

F = TypeVar("F", bound=Callable[..., Any])


def register_traceback_exclusion(path: str) -> None:
    """Hides frames of files under `path` (a file or a directory ending in the path
    separator) from filtered tracebacks, as JAX hides its own."""
    _traceback_util.register_exclusion(path)


def api_boundary(fn: F) -> F:
    """`fn`, below which tracebacks are filtered (JAX's `api_boundary`)."""
    return _traceback_util.api_boundary(fn)


def is_staging() -> bool:
    """Whether the current trace stages a jaxpr (`jax.jit`, `make_jaxpr`, a control
    flow body) rather than evaluating eagerly or differentiating concrete values."""
    return isinstance(_core.trace_ctx.trace, _pe.DynamicJaxprTrace)


def adopt_debug_info(fn: Callable[..., Any], debug_info: Any) -> None:
    """Makes JAX describe `fn` (in jaxprs and error messages) by `debug_info`, the
    `DebugInfo` of the user's function `fn` stands in for, without its argument
    names and result paths (which belong to the user's signature, not `fn`'s).

    `jax._src.api_util.debug_info` reads the `__fun_debug_info__` attribute first
    (JAX 0.10 to 0.12); elsewhere `fn` keeps only the user's name.
    """
    replace = getattr(debug_info, "_replace", None)
    fields = getattr(debug_info, "_fields", ())
    if replace is not None and {"arg_names", "result_paths"} <= set(fields):
        fn.__fun_debug_info__ = replace(arg_names=None, result_paths=None)  # pyright: ignore[reportFunctionMemberAccess]
