"""`default_dispatcher`: a handler for every control-flow primitive of JAX.

The handlers register themselves in `_registry.DEFAULT_HANDLERS` as they are
defined; `kups.effects` imports every one of them before anything can call
`default_dispatcher`.
"""

from __future__ import annotations

from typing import Any

from ._dispatcher import Dispatcher
from ._matching import contains_subjaxprs
from ._registry import DEFAULT_HANDLERS


def default_dispatcher() -> Dispatcher:
    """A fresh dispatcher with the default handler of every control-flow primitive.

    `Interpreter(default_dispatcher())` with no other handler is an identity:
    `reinterpret(f, interpreter)(ctx, *args)` returns `(f(*args), ctx)`. Its
    matching rule is `contains_subjaxprs`, so a control-flow primitive it does not
    know is unhandled and the interpreter's policy decides (by default: raise).

    **Returns:**

    A new `Dispatcher`; changing it changes no other.
    """
    global _TEMPLATE
    if _TEMPLATE is None or _TEMPLATE[0] != DEFAULT_HANDLERS:
        # Registering checks each name against JAX's primitives: do it once, and
        # again only when a handler module registers more.
        dispatcher = Dispatcher(DEFAULT_HANDLERS)
        dispatcher.register_custom_matching_rule(contains_subjaxprs)
        _TEMPLATE = (dict(DEFAULT_HANDLERS), dispatcher)
    return _TEMPLATE[1].copy()


# The registry as it was when the template dispatcher was built, and the template.
_TEMPLATE: tuple[dict[str, Any], Dispatcher] | None = None
