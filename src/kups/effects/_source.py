"""Where in the user's program an equation comes from, and kups' frames hidden
from the tracebacks of errors.

kups' library is its public packages and modules (`kups.effects`, the effects):
their frames are not the user's, so a line inside them is never reported as where
an equation comes from, and they are hidden from tracebacks as JAX hides its own.
A top-level module of kups whose name starts with `_` (the demo run by
`python -m kups`, `__main__`) is a program that ships with kups and uses it as a
user would: its lines are the user's.

A typical error raised in a user's function under `reinterpret` would otherwise
show two dozen frames of the interpreter and its handlers around the user's few.
JAX's filtering rules apply: `JAX_TRACEBACK_FILTERING=off` (or
`jax.config.update("jax_traceback_filtering", "off")`) shows every frame, kups'
and JAX's. `KUPS_TRACEBACK_FILTERING=off`, set before kups is imported, keeps
kups' frames while JAX still hides its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from typing import Any

from jax.extend.core import JaxprEqn

from . import _compat

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def library_paths() -> tuple[str, ...]:
    """The files and directories of kups' library: its `__init__.py` and its public
    packages and modules (a directory ends in the path separator)."""
    paths = [os.path.join(_PACKAGE_DIR, "__init__.py")]
    for entry in sorted(os.listdir(_PACKAGE_DIR)):
        if entry.startswith("_"):
            continue
        full = os.path.join(_PACKAGE_DIR, entry)
        if os.path.isfile(os.path.join(full, "__init__.py")):
            paths.append(full + os.sep)
        elif entry.endswith(".py"):
            paths.append(full)
    return tuple(paths)


_LIBRARY = library_paths()


def is_library_file(file_name: str) -> bool:
    """Whether `file_name` is a file of kups' library (not a user's)."""
    return file_name.startswith(_LIBRARY)


_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def is_installed_library(file_name: str) -> bool:
    return any(part in file_name for part in _INSTALLED)


def user_frames(eqn: JaxprEqn) -> list[Any]:
    return [
        frame
        for frame in _compat.user_frames(eqn.source_info.traceback)
        if not is_library_file(frame.file_name)
    ]


def _show_frame(frame: Any) -> str:
    column = f":{frame.start_column}" if frame.start_column else ""
    return f"{frame.file_name}:{frame.start_line}{column} ({frame.function_name})"


def source_line(eqn: JaxprEqn) -> str:
    """`file.py:LINE (function)` of the user's code that produced `eqn`. When that
    line is in an installed library (an equinox primitive, a diffrax solver), the
    line of the user's own code that called into it follows: `lib.py:LINE (fn),
    called from user.py:LINE (fn)`.

    JAX cuts an equation's traceback at the `jit` it was traced in, so the
    equations inside a library's jitted function (lineax's `linear_solve`, under
    `equinox.filter_jit`) have the library's lines only. While an interpreter
    runs a sub-program, the caller is then read from the control-flow equations
    around it (`enclosing`)."""
    frames = user_frames(eqn)
    if not frames:
        return "unknown"
    shown = _show_frame(frames[0])
    caller = _library_caller(frames)
    if caller is not None:
        shown += f", called from {_show_frame(caller)}"
    return shown


def _library_caller(frames: list[Any]) -> Any:
    """When the innermost of `frames` is an installed library's, the frame of the
    user's code that called into it (from `frames`, else from the equations
    around, see `enclosing`), or `None`."""
    if not is_installed_library(frames[0].file_name):
        return None
    caller = next((f for f in frames if not is_installed_library(f.file_name)), None)
    return caller if caller is not None else _enclosing_caller()


# The control-flow equations whose sub-programs an interpreter is running,
# outermost first (see `enclosing`).
_ENCLOSING: contextvars.ContextVar[tuple[JaxprEqn, ...]] = contextvars.ContextVar(
    "kups_enclosing", default=()
)


class enclosing:
    """Within it, `eqn` is around the equations being interpreted: `source_line`
    reads the user's line from it for an equation whose own traceback has only
    installed libraries' lines. (A class, not a generator: it is entered for every
    control-flow equation a handler takes.)"""

    __slots__ = ("_outer", "_reset")

    def __init__(self, eqn: JaxprEqn) -> None:
        self._outer = eqn

    def __enter__(self) -> None:
        self._reset = _ENCLOSING.set((*_ENCLOSING.get(), self._outer))

    def __exit__(self, *exc: object) -> None:
        _ENCLOSING.reset(self._reset)


def _enclosing_caller() -> Any:
    """The innermost frame outside installed libraries of the equations around
    the one being interpreted, or `None`."""
    for outer in reversed(_ENCLOSING.get()):
        for frame in user_frames(outer):
            if not is_installed_library(frame.file_name):
                return frame
    return None


def user_frame(eqn: JaxprEqn) -> tuple[str, int] | None:
    """`(file, line)` of the user's code that produced `eqn`, if known."""
    frames = user_frames(eqn)
    return (frames[0].file_name, frames[0].start_line) if frames else None


# The Python frame of the call of the function being interpreted (set by
# `reinterpret`): the user's line for the equations that function itself makes
# when it is a `jax.jit` or `jax.shard_map` of the user's, whose frames are JAX's.
# A frame rather than JAX's traceback: under `jax.jit` that stops at the jit.
_CALL_SITE: contextvars.ContextVar[Any] = contextvars.ContextVar("kups_call_site", default=None)


@contextlib.contextmanager
def call_site() -> Iterator[None]:
    """Within it, `where` names the line that called the function being
    interpreted for an equation that has no line of the user's."""
    token = _CALL_SITE.set(sys._getframe(2))  # the caller of the `with`'s function
    try:
        yield
    finally:
        _CALL_SITE.reset(token)


def _call_site_line() -> str | None:
    frame = _CALL_SITE.get()
    while frame is not None:
        file_name = frame.f_code.co_filename
        if not (
            is_library_file(file_name)
            or is_installed_library(file_name)
            or file_name.startswith("<frozen")
        ):
            return f"{file_name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def where(eqn: JaxprEqn) -> str:
    """`primitive 'name' at file.py:LINE (function)` for error messages.

    An equation with no line of the user's is placed at the user's line of the
    control flow an interpreter is running it in (the jitted body of a `jnp`
    function), or else at the user's call of the function being interpreted (the
    `jit` equation of a jitted function given to `reinterpret`). One with lines of
    installed libraries only (the `jit` of `equinox.filter_jit`) is said to be
    called from the user's line that called the library (see `source_line`), or
    else from the user's call of the function.
    """
    line = source_line(eqn)
    frames = user_frames(eqn)
    only_libraries = (
        bool(frames)
        and all(is_installed_library(f.file_name) for f in frames)
        and _library_caller(frames) is None
    )
    if line == "unknown":
        caller = _enclosing_caller()
        if caller is not None:
            return f"primitive '{eqn.primitive.name}' inside the call at {_show_frame(caller)}"
    if line == "unknown" or only_libraries:
        called = _call_site_line()
        if called is not None and only_libraries:
            line = f"{line}, called from {called}"
        elif called is not None:
            line = f"{called}, in the function called there"
    return f"primitive '{eqn.primitive.name}' at {line}"


def filtering_enabled() -> bool:
    """Whether kups' frames are hidden (unless `KUPS_TRACEBACK_FILTERING=off`)."""
    return os.environ.get("KUPS_TRACEBACK_FILTERING", "").strip().lower() not in {
        "off",
        "0",
        "false",
        "no",
    }


api_boundary = _compat.api_boundary

if filtering_enabled():
    for _path in _LIBRARY:
        _compat.register_traceback_exclusion(_path)
