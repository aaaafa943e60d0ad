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
