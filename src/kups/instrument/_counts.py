"""`PrimitiveCounts`, the report of `count_primitives`: a `dict` from primitive
name to how many times it ran, that prints as a table and is a pytree (returned
from `jax.jit`, serialized by `jax.export`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from ._table import Section, as_int, format_number, html_table, text_table


class PrimitiveCounts(dict[str, Any]):
    """How many times each primitive ran: a `dict` from primitive name to count.

    It is a plain `dict` (equal to a `dict` of the same items) that prints as a
    table, sorted by count, in a terminal (`repr`) and in a notebook
    (`_repr_html_`). It is also a pytree, so it can be returned from `jax.jit`,
    and registered with `jax.export`, so a function returning it can be exported.

    The counts are Python `int`s when `count_primitives` ran eagerly, and `int32`
    arrays when it ran under a transformation such as `jax.jit`.

    `opaque` holds the calls of control-flow primitives that kups cannot see
    inside (a library's own, such as lineax's `linear_solve`, met by
    `count_primitives(fn, policy=InterpreterPolicy.WARN)` or `IGNORE`): a `dict`
    from primitive name to how many times such a call ran. What runs inside them
    is not in the counts, so a non-empty `opaque` says the counts are incomplete.
    The table lists them under "not counted inside". Equality compares the
    counts only, as for any `dict`: compare `opaque` separately.

    **Arguments:**

    - `counts`: the counts, a mapping or an iterable of `(name, count)` pairs.
    - `opaque`: the opaque calls, a mapping from primitive name to count.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.instrument import count_primitives


    def f(x):
        return jnp.sin(x) * jnp.sin(x) + 1.0


    _, counts = jax.jit(count_primitives(f))(jnp.ones(3))
    print(counts)
    # PrimitiveCounts(
    #   primitive  count
    #   ---------  -----
    #   sin            2
    #   add            1
    #   mul            1
    # )
    assert counts == {"add": 1, "mul": 1, "sin": 2}
    assert counts.opaque == {}  # nothing was hidden from the counts
    ```
    """

    opaque: dict[str, Any]

    def __init__(
        self,
        counts: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        /,
        *,
        opaque: Mapping[str, Any] | None = None,
    ):
        super().__init__(counts)
        self.opaque = dict(opaque or {})

    def total(self) -> Any:
        """The number of primitives that ran, over all names (opaque calls, whose
        insides are not counted, are left out)."""
        return sum(self.values(), start=0)

    def _sections(self) -> list[Section]:
        """The table's sections: the counts, then (if any) the opaque calls under
        their heading."""
        sections: list[Section] = [(None, rows_by_count(self))]
        if self.opaque:
            sections.append(("not counted inside:", rows_by_count(self.opaque)))
        return sections

    def __repr__(self) -> str:
        if not self and not self.opaque:
            return "PrimitiveCounts({})"
        return text_table("PrimitiveCounts", ("primitive", "count"), self._sections())

    def _repr_html_(self) -> str:
        return html_table(("primitive", "count"), self._sections())


def rows_by_count(counts: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """`(name, count)` as text, sorted by count (largest first), then by name."""

    def key(item: tuple[str, Any]) -> tuple[int, str]:
        count = as_int(item[1])
        return (-count if count is not None else 0, item[0])

    return [(name, format_number(count)) for name, count in sorted(counts.items(), key=key)]


def _flatten(counts: PrimitiveCounts) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    names = tuple(sorted(counts))
    children: list[tuple[Any, Any]] = [
        (jax.tree_util.DictKey(name), counts[name]) for name in names
    ]
    # A dict is a pytree node: no opaque call, no leaf.
    children.append((jax.tree_util.GetAttrKey("opaque"), dict(sorted(counts.opaque.items()))))
    return children, names


def _unflatten(names: tuple[str, ...], values: Iterable[Any]) -> PrimitiveCounts:
    *counts, opaque = values
    return PrimitiveCounts(zip(names, counts, strict=True), opaque=opaque)


jax.tree_util.register_pytree_with_keys(
    PrimitiveCounts,
    _flatten,
    _unflatten,
    lambda counts: (tuple(child for _, child in _flatten(counts)[0]), tuple(sorted(counts))),
)
# The names are the whole of the auxiliary data: JSON holds them.
jax.export.register_pytree_node_serialization(
    PrimitiveCounts,
    serialized_name="kups.instrument.PrimitiveCounts",
    serialize_auxdata=lambda names: json.dumps(list(names)).encode(),
    deserialize_auxdata=lambda data: tuple(json.loads(data)),
)
