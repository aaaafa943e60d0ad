"""A report base: what an effect hands back about the first event it saw."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Hashable
from typing import Any, ClassVar

import jax
from jax.core import Tracer


@dataclasses.dataclass(frozen=True)
class Event:
    """One event, read out of a concrete report.

    **Fields:**

    - `message`: what happened.
    - `primitive`: the primitive of the equation where it happened.
    - `source`: `"file.py:LINE"` of the user's code, or `None`.
    - `iteration`: one index per enclosing loop, outermost first (`()` outside
      loops).
    - `shard`: the shard's coordinates on the manual mesh axes, or `None`
      outside `shard_map`.

    **Example:**

    ```python
    from kups.effects.toolkit import Event

    event = Event("x < 0", "check", "model.py:12", (3,), {"x": 2})
    assert event.describe() == "x < 0 at iteration 3 on shard x=2 (model.py:12)"
    ```
    """

    message: str
    primitive: str | None
    source: str | None
    iteration: tuple[int, ...]
    shard: dict[Hashable, int] | None

    def describe(self) -> str:
        """One line: the message, then where (`at iteration 3`, `on shard x=2`,
        the source line)."""
        text = self.message
        if len(self.iteration) == 1:
            text += f" at iteration {self.iteration[0]}"
        elif self.iteration:
            text += f" at iterations {', '.join(map(str, self.iteration))} (outermost loop first)"
        if self.shard is not None:
            text += " on shard " + ", ".join(f"{axis}={i}" for axis, i in self.shard.items())
        return text if self.source is None else f"{text} ({self.source})"


class Report:
    """Base of the reports effects return: fields of the first event, read once
    the report is concrete.

    A subclass implements `first_event()` (the first `Event`, or `None` when
    nothing happened) on concrete values; the base gives it the fields
    `message`, `primitive`, `source`, `iteration`, `shard` (each `None` when
    nothing happened), a one-line `repr`, an HTML table in notebooks
    (`_repr_html_`), and a `TypeError` that says what to do when the report is
    read while traced (inside `jit`). Combine it with a pytree base such as
    `equinox.Module` so the report can be returned from `jit`.

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from kups.effects.toolkit import Event, Report


    class Found(Report, eqx.Module):
        happened: jax.Array
        where: jax.Array

        def first_event(self):
            if not self.happened:
                return None
            return Event("found", "sin", "f.py:3", (int(self.where),), None)


    report = Found(jnp.array(True), jnp.array(4))
    assert report.iteration == (4,) and repr(report) == "Found('found at iteration 4 (f.py:3)')"
    assert "<table" in report._repr_html_()
    ```
    """

    # How the report's messages name it: "needs a concrete report".
    noun: ClassVar[str] = "report"

    def first_event(self) -> Event | None:
        raise NotImplementedError(f"{type(self).__name__} must define first_event()")

    def _is_traced(self) -> bool:
        # A `jax.eval_shape` result holds shapes where values would be.
        return any(
            isinstance(leaf, (Tracer, jax.ShapeDtypeStruct)) for leaf in jax.tree.leaves(self)
        )

    def _event(self, reading: str) -> Event | None:
        if self._is_traced():
            raise TypeError(
                f"{type(self).__name__}.{reading} needs a concrete {self.noun}, but this one is "
                f"traced (it is being used inside jax.jit or another transformation). "
                f"Return it from the transformed function and read .{reading} on the "
                f"result, outside jit."
            )
        return self.first_event()

    def _field(self, name: str) -> Any:
        event = self._event(name)
        return None if event is None else getattr(event, name)

    @property
    def message(self) -> str | None:
        """What happened first, without where; `None` when nothing happened."""
        return self._field("message")

    @property
    def primitive(self) -> str | None:
        """The primitive where the first event happened, or `None`."""
        return self._field("primitive")

    @property
    def source(self) -> str | None:
        """`"file.py:LINE"` of the user's code where it happened, or `None`."""
        return self._field("source")

    @property
    def iteration(self) -> tuple[int, ...] | None:
        """One index per enclosing loop, outermost first (`()` outside loops);
        `None` when nothing happened."""
        return self._field("iteration")

    @property
    def shard(self) -> dict[Hashable, int] | None:
        """The shard's coordinates on the manual mesh axes (`{"x": 2}`); `None`
        outside `shard_map` or when nothing happened."""
        return self._field("shard")

    def __repr__(self) -> str:
        name = type(self).__name__
        if self._is_traced():
            return f"{name}(<traced>)"
        event = self.first_event()
        return f"{name}({None if event is None else event.describe()!r})"

    def _repr_html_(self) -> str:
        name = html.escape(type(self).__name__)
        if self._is_traced():
            return f"<p>{name}: traced</p>"
        event = self.first_event()
        if event is None:
            return f"<p>{name}: nothing happened</p>"
        rows = "".join(
            f"<tr><th>{field.name}</th><td>{html.escape(str(getattr(event, field.name)))}</td></tr>"
            for field in dataclasses.fields(event)
        )
        return f"<table><caption>{name}</caption>{rows}</table>"
