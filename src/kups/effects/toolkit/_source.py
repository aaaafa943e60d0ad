"""The user's source line of an equation, as an effect reports it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from jax.extend.core import JaxprEqn

from .._source import user_frames

_F = TypeVar("_F", bound=Callable[..., Any])

# (file, function name) of the functions whose frames are an effect's own code.
_HIDDEN: set[tuple[str, str]] = set()


def hide_frames(fn: _F) -> _F:
    """Marks `fn` as an effect's own code: `source_of` skips its frames.

    An effect's user-facing function (a `check`, a `note`) binds its primitive
    from its own body, so the innermost frame of the equation is that body. With
    `fn` hidden, `source_of` names the line that called `fn` instead. kups' own
    files are always skipped.

    **Arguments:**

    - `fn`: a Python function (it is returned unchanged, so this works as a
      decorator).

    **Returns:**

    `fn`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.effects import define_effect
    from kups.effects.toolkit import hide_frames, source_of

    mark_p = define_effect("doc_mark")


    @hide_frames
    def mark(x):
        return mark_p.bind(x)[0]


    jaxpr = jax.make_jaxpr(lambda x: mark(x) + 1)(jnp.ones(2))
    marked, added = jaxpr.eqns
    assert source_of(marked) == source_of(added)  # the caller's line, not mark's body
    ```
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(
            f"hide_frames(fn) needs a Python function (with a __code__), got "
            f"{type(fn).__name__}: {fn!r}."
        )
    _HIDDEN.add((code.co_filename, code.co_name))
    return fn


def source_of(eqn: JaxprEqn, enclosing: str | None = None) -> str | None:
    """`"file.py:LINE"` of the user's code behind `eqn`, or `enclosing`.

    The innermost frame of the equation's traceback that is neither kups' nor a
    function marked with `hide_frames`. JAX keeps no user frame for some
    equations (those inside the jitted body of a `jnp` function such as
    `floor_divide`); for those the line of the control flow around them,
    `enclosing`, is returned (`Position.enclosing` tracks it).

    **Arguments:**

    - `eqn`: the equation.
    - `enclosing`: the fallback, usually `position.enclosing`.

    **Returns:**

    The file's base name and the line, or `enclosing` (which may be `None`).

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.effects.toolkit import source_of

    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x))(1.0)
    assert source_of(jaxpr.eqns[0]).split(":")[1].isdigit()
    ```
    """
    for frame in user_frames(eqn):
        if (frame.file_name, frame.function_name) not in _HIDDEN:
            return f"{os.path.basename(frame.file_name)}:{frame.start_line}"
    return enclosing
