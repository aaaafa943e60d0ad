"""The table of default handlers, filled by each handler under its definition.

`DEFAULT_HANDLERS` maps a primitive's name to the default handler of
`kups.effects.handlers` that takes it. It sits below the dispatcher, the
interpreter and the handlers, so that each can read it without importing the
handlers: the dispatcher knows the names (`"call"` is not a live primitive in
every supported JAX release), `_untouched` knows which handlers only thread
the context, and a handler can build an interpreter of the defaults. Every
handler module registers its handler as it is defined (as checkify's tables are
filled), and importing `kups.effects` imports them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from . import _compat

# Names, not Primitive objects: `jax.extend` does not export every one of them
# (`shard_map` in JAX 0.10), and a name and its primitive are the same key.
DEFAULT_HANDLERS: dict[str, Any] = {}

_H = TypeVar("_H", bound=Callable[..., Any])


def default_handler_for(*names: str) -> Callable[[_H], _H]:
    """Registers the decorated function as the default handler of the primitives
    named `names` (the current name first, then the names of older supported
    releases), leaving out a name the running JAX gave another primitive's name
    (`closed_call`, from JAX 0.11), under which no equation comes."""
    former = _compat.former_primitive_names()

    def register(handler: _H) -> _H:
        for name in names:
            if name not in former:
                DEFAULT_HANDLERS[name] = handler
        return handler

    return register
