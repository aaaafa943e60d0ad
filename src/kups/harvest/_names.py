"""How sown values are named: a path of scopes and a name, and how messages show it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from jax.extend.core import JaxprEqn

# Where a sown value goes in the result: its scopes, then its name.
SowPath = tuple[str, ...]

# A tag is any hashable value, as in Oryx: a string, a number, a tuple, an Enum.
Tag = Hashable


def check_name(what: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"The {what} of a sown value must be a non-empty string, got {value!r}.")


def check_tag(caller: str, tag: Any) -> None:
    """A tag is hashable (it is a static parameter of the sow primitive), and
    neither `None` nor `""`, which are most likely a tag left out."""
    try:
        hash(tag)
    except TypeError:
        raise TypeError(
            f"{caller} got tag={tag!r}, which is not hashable. A tag is any hashable value "
            f"(a string, a number, a tuple, an Enum member): it is a static parameter of the "
            f"program, compared with ==."
        ) from None
    if tag is None or tag == "":
        raise TypeError(
            f"{caller} got tag={tag!r}; a tag is a non-empty string or another hashable value "
            f"(a number, a tuple, an Enum member) that names a group of sows."
        )


def path_of(eqn: JaxprEqn) -> SowPath:
    return (*eqn.params["scope"], eqn.params["name"])


def show_path(path: SowPath) -> str:
    """A path as users write it in messages: `"scope/name"`."""
    return "/".join(path)


def named(path: SowPath) -> str:
    """`name 'x'`, or `name 'x' in scope 'a'` inside `nest`."""
    name, scope = path[-1], path[:-1]
    return f"name {name!r} in scope {show_path(scope)!r}" if scope else f"name {name!r}"


def describe(tag: Tag, path: SowPath) -> str:
    return f"kups.harvest: {named(path)} of tag {tag!r}"


@dataclass(frozen=True)
class NameKey:
    """The key of a sown name in a context's key paths; framework error messages
    print it as `ctx['name' (tag 'tag')]` (`'scope/name'` inside `nest`)."""

    tag: Tag
    path: SowPath

    def __str__(self) -> str:
        return f"[{show_path(self.path)!r} (tag {self.tag!r})]"


class LazyLine:
    """The source line of an equation, read when first shown: `str(line)` and
    f-strings give `source_line(eqn)`. Reading it walks the equation's traceback,
    and most lines kept for messages are never shown."""

    __slots__ = ("_eqn", "_text")

    def __init__(self, eqn: JaxprEqn) -> None:
        self._eqn = eqn
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            from kups.effects import source_line

            self._text = source_line(self._eqn)
        return self._text
