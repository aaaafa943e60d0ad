"""Which sows a `reap`, `plant` or `harvest` call acts on, found statically in a
program and while running it, and the interpreter that acts on them."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn
from jax.sharding import PartitionSpec

from kups.effects import (
    Dispatcher,
    Handler,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    default_dispatcher,
    default_primitive_handler,
    equations_in,
    skip_when_untouched,
)

from ._names import SowPath, Tag, check_tag, path_of, show_path
from ._sow import sow_p


def _entries(caller: str, what: str, entries: Any) -> frozenset[SowPath] | None:
    """`allowlist`/`blocklist` as a set of paths (a name is a path of length 1)."""
    if entries is None:
        return None
    if isinstance(entries, str | bytes):
        raise TypeError(
            f"{caller}({what}={entries!r}) takes an iterable of names, not a single string "
            f"(which would be read as its characters). Write {what}=[{entries!r}]."
        )
    if not isinstance(entries, Iterable):
        raise TypeError(
            f"{caller}({what}=...) takes an iterable of names, such as a list of strings; got "
            f"{type(entries).__name__}: {entries!r}."
        )
    paths = set()
    for entry in entries:
        if isinstance(entry, str) and entry:
            paths.add((entry,))
        elif (
            isinstance(entry, tuple)
            and entry
            and all(isinstance(part, str) and part for part in entry)
        ):
            paths.add(entry)
        else:
            raise TypeError(
                f"{caller}({what}=...) got the entry {entry!r}; an entry is a name (a non-empty "
                f"string) or, for names inside nest scopes, a tuple of scopes and name such "
                f"as ('scope', 'name')."
            )
    return frozenset(paths)


@dataclass(frozen=True)
class Selection:
    """Which sows a `reap`, `plant` or `harvest` call acts on."""

    tag: Tag
    allowlist: frozenset[SowPath] | None
    blocklist: frozenset[SowPath]
    exclusive: bool

    @classmethod
    def of(cls, caller: str, tag: Tag, allowlist: Any, blocklist: Any, exclusive: Any) -> Selection:
        check_tag(caller, tag)
        allowed = _entries(caller, "allowlist", allowlist)
        blocked = _entries(caller, "blocklist", blocklist) or frozenset()
        both = sorted(blocked & allowed) if allowed is not None else []
        if both:
            raise ValueError(
                f"{caller}(tag={tag!r}) has {[show_path(path) for path in both]} in both allowlist "
                f"and blocklist; say once whether a name is taken. Remove it from one of them."
            )
        if not isinstance(exclusive, bool):
            raise TypeError(
                f"{caller}(tag={tag!r}) got exclusive={exclusive!r}; it is True or False."
            )
        return cls(tag, allowed, blocked, exclusive)

    def takes(self, path: SowPath) -> bool:
        """Whether a sow of this tag at `path` passes the allowlist and blocklist.
        An entry covers the names it is a prefix of (a scope covers its names)."""

        def listed(entries: frozenset[SowPath]) -> bool:
            return any(path[: len(entry)] == entry for entry in entries)

        if self.allowlist is not None and not listed(self.allowlist):
            return False
        return not listed(self.blocklist)

    def selects(self, eqn: JaxprEqn) -> bool:
        return eqn.params["tag"] == self.tag and self.takes(path_of(eqn))

    def __str__(self) -> str:
        parts = [f"tag={self.tag!r}"]
        if self.allowlist is not None:
            parts.append(f"allowlist={sorted(map(show_path, self.allowlist))}")
        if self.blocklist:
            parts.append(f"blocklist={sorted(map(show_path, self.blocklist))}")
        if self.exclusive:
            parts.append("exclusive=True")
        return ", ".join(parts)


def pass_through(
    selection: Selection, interpreter: Interpreter, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult | None:
    """What becomes of a sow the call does not act on, or `None` if it acts on it."""
    if eqn.params["tag"] != selection.tag:
        if selection.exclusive:
            # Removed: no enclosing reap or plant sees it.
            return HandlerResult(ctx, list(invals))
        return default_primitive_handler(interpreter, ctx, eqn, invals)
    if not selection.takes(path_of(eqn)):
        # Left in the program as it is, for an enclosing call of this tag.
        return default_primitive_handler(interpreter, ctx, eqn, invals)
    return None


# ---------------------------------------------------------------- the program, statically

_SOWS: weakref.WeakKeyDictionary[Jaxpr, tuple[JaxprEqn, ...]] = weakref.WeakKeyDictionary()


@functools.cache
def _interpreted() -> frozenset[str]:
    """The control-flow primitives whose sub-programs the interpreters walk: those
    of JAX. Any other (a library's own) runs unchanged under `policy=IGNORE` or
    `WARN`, so the sows inside it are not seen."""
    return frozenset(default_dispatcher().handlers)


def sows_in(jaxpr: Jaxpr | ClosedJaxpr) -> tuple[JaxprEqn, ...]:
    """Every `sow` equation of `jaxpr` and its sub-programs (any tag) that the
    interpreters see, cached."""
    open_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    found = _SOWS.get(open_jaxpr)
    if found is None:
        equations = equations_in(open_jaxpr, enter=_entered)
        found = _SOWS[open_jaxpr] = tuple(eqn for eqn, _ in equations if eqn.primitive is sow_p)
    return found


def sows_around(jaxpr: Jaxpr | ClosedJaxpr) -> dict[int, list[tuple[JaxprEqn, ...]]]:
    """The control-flow equations around each `sow` of `jaxpr`, outermost first,
    keyed by the sow equation's `id`: one entry per place the sow runs (a
    sub-program can be shared); a sow directly in `jaxpr` has `()`."""
    open_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    found: dict[int, list[tuple[JaxprEqn, ...]]] = {}
    for eqn, around in equations_in(open_jaxpr, enter=_entered):
        if eqn.primitive is sow_p:
            found.setdefault(id(eqn), []).append(around)
    return found


def _entered(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in _interpreted()


def specs_like(value: Any, spec: tuple[Any, ...]) -> Any:
    """`PartitionSpec(*spec)` for every leaf of `value`."""
    return jax.tree.map(lambda _: PartitionSpec(*spec), value)


def selective_interpreter(
    selection: Selection,
    caller: str,
    policy: InterpreterPolicy,
    sow: Handler,
    loops: Mapping[str, Handler],
    always: Mapping[str, Handler] | None = None,
    *,
    base: Dispatcher | None = None,
    kind: type[Interpreter] = Interpreter,
) -> Interpreter:
    """The interpreter (of `kind`) of a reap or plant: `sow` for the sow primitive,
    and the `loops` handlers, which act only when a sow is inside (so control flow
    with none is re-bound whole); the other handlers are `base`'s, by default the
    default ones."""
    dispatcher = default_dispatcher() if base is None else base
    dispatcher.register_handler(sow_p, sow)
    for name, handler in loops.items():
        dispatcher.register_handler(name, skip_when_untouched(handler))
    for name, handler in (always or {}).items():
        dispatcher.register_handler(name, handler)

    def acts_on(effect: Any, params: Mapping[str, Any]) -> bool:
        # Whether a sow bound with `params` is one this call takes.
        # A sow in a custom_jvp rule, which JAX runs out of the interpreter's sight,
        # is reaped by `Reaper.custom_jvp` instead.
        return effect is not sow_p or (
            not params["in_rule"]
            and params["tag"] == selection.tag
            and selection.takes((*params["scope"], params["name"]))
        )

    return kind(
        dispatcher,
        policy=policy,
        label=f"kups.harvest.{caller}({selection})",
        policy_hint=f"{caller}(fn, policy=...)",
        acts_on=acts_on,
    )
