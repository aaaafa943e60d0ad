"""The dispatcher: which handler takes which equation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from jax.extend.core import JaxprEqn, Primitive

if TYPE_CHECKING:
    from ._interpreter import Interpreter
    from ._types import HandlerResult


class Handler(Protocol):
    """`handler(interpreter, ctx, eqn, invals) -> HandlerResult(ctx, outvals)`."""

    def __call__(
        self, interpreter: Interpreter, ctx: Any, eqn: JaxprEqn, invals: list[Any], /
    ) -> HandlerResult: ...


MatchingRule = Callable[[Any, JaxprEqn, list[Any]], bool]


def _key(prim: Primitive | str) -> str:
    if isinstance(prim, str):
        return prim
    name = getattr(prim, "name", None)
    if not isinstance(name, str):
        raise TypeError(
            f"A handler is registered for a primitive or a primitive's name, got "
            f"{type(prim).__name__}: {prim!r}."
        )
    return name


class Dispatcher:
    """Maps primitives to handlers.

    A primitive and its name are the same key. Registration mutates the dispatcher
    and returns it, so calls chain.

    **Arguments:**

    - `handlers`: an optional mapping from primitives (or their names) to handlers.

    **Example:**

    ```python
    import jax.numpy as jnp
    from kups.effects import HandlerResult, Interpreter, default_dispatcher, reinterpret


    def count_sin(interpreter, ctx, eqn, invals):
        return HandlerResult(ctx + 1, [jnp.sin(invals[0])])


    dispatcher = default_dispatcher().register_handler("sin", count_sin)
    out, count = reinterpret(lambda x: jnp.sin(jnp.sin(x)), Interpreter(dispatcher))(0, 1.0)
    assert count == 2
    ```
    """

    def __init__(self, handlers: Mapping[Primitive, Handler] | Mapping[str, Handler] | None = None):
        self._handlers: dict[str, Handler] = {}
        self._rules: list[MatchingRule] = []
        self._fallback: Handler | None = None
        for prim, handler in (handlers or {}).items():
            self.register_handler(prim, handler)  # pyright: ignore[reportArgumentType]

    def register_handler(self, prim: Primitive | str, handler: Handler) -> Dispatcher:
        """Sends equations of `prim` to `handler`, replacing any handler it had."""
        if not callable(handler):
            raise TypeError(
                f"The handler for {_key(prim)!r} must be callable as "
                f"handler(interpreter, ctx, eqn, invals), got {type(handler).__name__}."
            )
        self._handlers[_key(prim)] = handler
        return self

    def unregister_handler(self, prim: Primitive | str) -> Dispatcher:
        """Removes the handler of `prim`; `KeyError` if it has none."""
        key = _key(prim)
        if key not in self._handlers:
            raise KeyError(
                f"No handler is registered for primitive {key!r}; registered: "
                f"{sorted(self._handlers)}."
            )
        del self._handlers[key]
        return self

    def is_registered(self, prim: Primitive | str) -> bool:
        """Whether `prim` has a handler."""
        return _key(prim) in self._handlers

    def register_custom_matching_rule(self, rule: MatchingRule) -> Dispatcher:
        """Adds `rule(ctx, eqn, invals) -> bool`.

        An equation that a rule accepts and whose primitive has no handler counts as
        unhandled: the interpreter's policy decides what happens to it.
        """
        if not callable(rule):
            raise TypeError(f"A matching rule must be callable, got {type(rule).__name__}.")
        self._rules.append(rule)
        return self

    def register_fallback_handler(self, handler: Handler | None) -> Dispatcher:
        """Sends every equation with no handler and no control-flow sub-program to
        `handler` instead of re-binding it (`None` restores re-binding).

        This is how an effect sees every primitive (counting them, checking every
        output) without knowing the primitives in advance.
        """
        if handler is not None and not callable(handler):
            raise TypeError(f"A fallback handler must be callable, got {type(handler).__name__}.")
        self._fallback = handler
        return self

    def handler_for(self, prim: Primitive | str) -> Handler | None:
        """The handler registered for `prim`, or `None`."""
        return self._handlers.get(_key(prim))

    @property
    def handlers(self) -> Mapping[str, Handler]:
        """The registered handlers by primitive name (a read-only view)."""
        return dict(self._handlers)

    @property
    def matching_rules(self) -> tuple[MatchingRule, ...]:
        return tuple(self._rules)

    @property
    def fallback_handler(self) -> Handler | None:
        return self._fallback

    def copy(self) -> Dispatcher:
        """A new dispatcher with the same handlers, rules and fallback."""
        new = Dispatcher(self._handlers)
        new._rules = list(self._rules)
        new._fallback = self._fallback
        return new

    def __repr__(self) -> str:
        return f"Dispatcher(handlers={sorted(self._handlers)}, rules={len(self._rules)})"
