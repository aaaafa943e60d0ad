"""The dispatcher: which handler takes which equation."""

from __future__ import annotations

import difflib
import gc
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import jax.extend.core.primitives
import jax.lax
from jax.extend.core import JaxprEqn, Primitive

from . import _compat
from ._registry import DEFAULT_HANDLERS

if TYPE_CHECKING:
    from ._interpreter import Interpreter
    from ._types import HandlerResult


class Handler(Protocol):
    """`handler(interpreter, ctx, eqn, invals) -> HandlerResult(ctx, outvals)`."""

    def __call__(
        self, interpreter: Interpreter, ctx: Any, eqn: JaxprEqn, invals: list[Any], /
    ) -> HandlerResult: ...


MatchingRule = Callable[[Any, JaxprEqn, list[Any]], bool]


class StaleTraceWarning(UserWarning):
    """A dispatcher changed after it was used to trace a function: what was traced
    (and cached by `jax.jit`) before the change keeps the handlers of before."""


# Names of every primitive kups has seen exist. It only grows: a name that was a
# primitive's stays a valid key even when the primitive is garbage collected.
_PRIMITIVE_NAMES: set[str] = set()

# What users write for a primitive, by the name of the JAX function that binds it.
_ALIASES: dict[str, str | tuple[str, ...]] = {
    "dot": "dot_general",
    "matmul": "dot_general",
    "einsum": "dot_general",
    "tensordot": "dot_general",
    "while_loop": "while",
    "fori_loop": ("scan", "while"),  # scan when the trip count is static
    "switch": "cond",
    "select": "select_n",
    "where": "select_n",
    "remat": "remat2",
    "custom_jvp": "custom_jvp_call",
    "custom_vjp": "custom_vjp_call",
    "map": "scan",
    "pmap": "shard_map",
    "shmap": "shard_map",
    "sum": "reduce_sum",
    "subtract": "sub",
    "multiply": "mul",
    "divide": "div",
    "negative": "neg",
    "power": "pow",
    "maximum": "max",
    "minimum": "min",
}


def _known_primitive_names() -> set[str]:
    """The names of the default handlers and of the primitives that `jax.lax` and
    `jax.extend.core.primitives` export: the common names, found in a millisecond."""
    if not _PRIMITIVE_NAMES:
        _PRIMITIVE_NAMES.update(DEFAULT_HANDLERS)
        for module in (jax.extend.core.primitives, jax.lax):
            for value in vars(module).values():
                if isinstance(value, Primitive):
                    _PRIMITIVE_NAMES.add(value.name)
    return _PRIMITIVE_NAMES


def _add_live_primitive_names() -> None:
    """Adds the names of every live `Primitive`.

    JAX has no public list of its primitives, and primitives of libraries, of
    `define_effect` and of users are created at any time: the live objects are
    the complete list. Scanning them takes tens of milliseconds, so it is done
    only when a name is not known yet.
    """
    _PRIMITIVE_NAMES.update(
        obj.name
        for obj in gc.get_objects()
        if isinstance(obj, Primitive) and isinstance(getattr(obj, "name", None), str)
    )


def _suggestions(name: str) -> list[str]:
    alias = _ALIASES.get(name, ())
    found = [alias] if isinstance(alias, str) else list(alias)
    # "cosine" is more likely "cos" than the closer-spelled "sin".
    found += sorted(
        (known for known in _PRIMITIVE_NAMES if len(known) >= 3 and name.startswith(known)),
        key=len,
        reverse=True,
    )
    found += difflib.get_close_matches(name, sorted(_PRIMITIVE_NAMES), n=3, cutoff=0.6)
    found += sorted((known for known in _PRIMITIVE_NAMES if known.startswith(name + "_")), key=len)[
        :2
    ]
    return list(dict.fromkeys(found))[:4]


def _check_primitive_name(name: str) -> None:
    """Raises a `ValueError` if no primitive is named `name`."""
    if name == "checkpoint":
        raise ValueError(
            "No primitive is named 'checkpoint': jaxprs print jax.checkpoint's equations "
            "as `checkpoint`, but its primitive is named 'remat2', so a handler registered "
            "under 'checkpoint' would never run. Register it under 'remat2'."
        )
    current = _compat.former_primitive_names().get(name)
    if current is not None:
        raise ValueError(
            f"No primitive is named {name!r} in JAX {jax.__version__}: the primitive "
            f"older releases named so is named {current!r} here, so a handler registered "
            f"under {name!r} would never run. Register it under {current!r} (print "
            f"jax.make_jaxpr(f)(*args) to see the names equations have)."
        )
    if name in _known_primitive_names():
        return
    _add_live_primitive_names()
    if name in _PRIMITIVE_NAMES:
        return
    suggestions = _suggestions(name)
    hint = f" Did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise ValueError(
        f"No JAX primitive is named {name!r}, so a handler registered under it would "
        f"never run.{hint} Handlers are keyed by the primitive names that jaxprs show "
        f"(print jax.make_jaxpr(f)(*args) to see them: 'sin', 'dot_general', 'while', "
        f"...), which are not always the names of the jax.numpy or jax.lax functions. "
        f"For a primitive of your own (or of a library not imported yet), register "
        f"the Primitive object itself (dispatcher.register_handler(my_primitive, "
        f"handler)), or create it (import its module) before registering its name."
    )


def _key(prim: Primitive | str) -> str:
    if isinstance(prim, str):
        return prim
    name = getattr(prim, "name", None)
    if not isinstance(name, str):
        raise TypeError(
            f"A handler is registered for a primitive or a primitive's name, got "
            f"{type(prim).__name__}: {prim!r}.{_function_hint(prim)}"
        )
    return name


def _function_hint(value: Any) -> str:
    """For a function given where a primitive belongs (`jnp.sin`, or a handler
    passed first): the primitive names it binds, and the question of a swap."""
    if not callable(value):
        return ""
    function_name = getattr(value, "__name__", None)
    hint = ""
    if isinstance(function_name, str):
        _known_primitive_names()
        if function_name not in _PRIMITIVE_NAMES:
            _add_live_primitive_names()
        exact = function_name in _PRIMITIVE_NAMES
        names = [function_name] if exact else _suggestions(function_name)
        if names:
            shown = " or ".join(repr(n) for n in names[:3])
            hint += (
                f" {function_name} is a function, not a primitive: handlers are keyed by "
                f"the primitive it binds, did you mean {shown} "
                f"(register_handler({names[0]!r}, handler))?"
            )
    return hint + (
        " Or were the arguments swapped? The primitive comes first: "
        "register_handler(primitive, handler)."
    )


def _check_not_swapped(prim: Any, handler: Any) -> None:
    """A `TypeError` giving the call in the right order when a handler comes first
    and a primitive (or its name) second."""
    name = handler if isinstance(handler, str) else getattr(handler, "name", None)
    if not isinstance(name, str) or not callable(prim) or isinstance(prim, Primitive):
        return
    handler_name = getattr(prim, "__name__", "handler")
    raise TypeError(
        f"register_handler got the function {handler_name} first and the primitive "
        f"{name!r} second: the arguments swapped places. The primitive comes first: "
        f"register_handler({name!r}, {handler_name})."
    )


class Dispatcher:
    """Maps primitives to handlers.

    A primitive and its name are the same key. Registration mutates the dispatcher
    and returns it, so calls chain. A name that no primitive has (`"sine"`,
    `"dot"`, `"while_loop"`) is a `ValueError` that suggests the right one; a
    `Primitive` object is always accepted.

    A function traced with this dispatcher under `jax.jit` is cached by JAX with
    the handlers it was traced with: changing the dispatcher afterwards does not
    change it. So a change to a dispatcher that has already been used while
    staging (under `jax.jit`, `make_jaxpr` or inside a control-flow body) warns
    with a `StaleTraceWarning`; use `dispatcher.copy()` (or a new dispatcher) and
    a new `Interpreter` for the changed handlers.

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
        self._staged = False
        for prim, handler in (handlers or {}).items():
            self.register_handler(prim, handler)  # pyright: ignore[reportArgumentType]

    def _changing(self, change: str) -> None:
        if self._staged:
            warnings.warn(
                f"{change} on a Dispatcher that was already used to trace a function "
                f"(under jax.jit, make_jaxpr or a control-flow body). What was traced "
                f"before keeps the handlers it was traced with: a function jitted with "
                f"this dispatcher does not see the change until it is traced again, and "
                f"jax.jit caches its trace. To use the new handlers, build a new "
                f"dispatcher (dispatcher.copy(), then change the copy) with a new "
                f"Interpreter and wrap the function again; or call jax.clear_caches().",
                StaleTraceWarning,
                stacklevel=3,
            )

    def register_handler(self, prim: Primitive | str, handler: Handler) -> Dispatcher:
        """Sends equations of `prim` to `handler`, replacing any handler it had.

        `prim` is a `Primitive` or the name of one; a name that no primitive has is
        a `ValueError` that names the closest ones.
        """
        _check_not_swapped(prim, handler)
        key = _key(prim)
        if not callable(handler):
            raise TypeError(
                f"The handler for {key!r} must be callable as "
                f"handler(interpreter, ctx, eqn, invals), got {type(handler).__name__}."
            )
        if isinstance(prim, str):
            _check_primitive_name(prim)
        if self._handlers.get(key) is not handler:
            self._changing(f"register_handler({key!r}, ...)")
        self._handlers[key] = handler
        return self

    def unregister_handler(self, prim: Primitive | str) -> Dispatcher:
        """Removes the handler of `prim`; `KeyError` if it has none."""
        key = _key(prim)
        if key not in self._handlers:
            raise KeyError(
                f"No handler is registered for primitive {key!r}; registered: "
                f"{sorted(self._handlers)}."
            )
        self._changing(f"unregister_handler({key!r})")
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
        self._changing("register_custom_matching_rule(...)")
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
        self._changing("register_fallback_handler(...)")
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
        """A new dispatcher with the same handlers, rules and fallback, not yet used
        to trace anything."""
        new = Dispatcher()
        new._handlers = dict(self._handlers)
        new._rules = list(self._rules)
        new._fallback = self._fallback
        return new

    def __repr__(self) -> str:
        return f"Dispatcher(handlers={sorted(self._handlers)}, rules={len(self._rules)})"
