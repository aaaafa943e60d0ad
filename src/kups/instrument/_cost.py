"""`Cost`, the report of `count_flops`: how many times each kind of equation
ran, with the cost of one execution, summed into FLOPs, transcendentals and
bytes accessed, in total and by primitive."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._cost_model import NO_RULE
from ._counts import rows_by_count
from ._table import Section, as_int, format_number, html_table, is_traced, text_table

# (primitive name, FLOPs, transcendentals, bytes accessed) of one execution.
CostKey = tuple[str, int, int, int]
_FIELDS = ("flops", "transcendentals", "bytes_accessed")


def _weighted_sum(counts: Iterable[tuple[Any, int]]) -> Any:
    """`sum(count * weight)`: an exact Python `int` from concrete counts (an `int64`
    array, one total per element, from vmapped ones); a `float32` array from traced
    counts, whose `int32` products could overflow."""
    pairs = list(counts)
    if any(isinstance(count, jax.ShapeDtypeStruct) for count, _ in pairs):
        # A `jax.eval_shape` result: the shape and dtype the total would have.
        weights = [weight for _, weight in pairs]
        return jax.eval_shape(
            lambda counts: _weighted_sum(zip(counts, weights, strict=True)),
            [count for count, _ in pairs],
        )
    if is_traced([count for count, _ in pairs]):
        return sum(
            (jnp.asarray(count, jnp.float32) * weight for count, weight in pairs),
            jnp.zeros((), jnp.float32),
        )
    total = sum((np.asarray(count, np.int64) * weight for count, weight in pairs), np.int64(0))
    return int(total) if np.ndim(total) == 0 else total


class Cost:
    """What a program cost as it ran: FLOPs, transcendentals and bytes accessed,
    in total and by primitive.

    It holds how many times each kind of equation ran (`executions`: by primitive
    name and cost of one execution) and sums them. It is a pytree (return it from
    `jax.jit`), registered with `jax.export`, and prints as a table, sorted by
    FLOPs, in a terminal and in a notebook.

    The totals are exact Python `int`s when the executions are concrete: when
    `count_flops` ran eagerly, or once a jitted function returned the `Cost` (one
    total per element after `jax.vmap`). Read inside a traced function they are
    `float32` arrays.

    **Arguments:**

    - `executions`: a mapping from `(name, flops, transcendentals, bytes)` of one
      execution to how many times an equation of that kind ran.
    - `opaque`: calls that kups could not see inside, by primitive name (as
      `PrimitiveCounts.opaque`).

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.instrument import count_flops

    a, b = jnp.ones((4, 8)), jnp.ones((8, 16))
    _, cost = jax.jit(count_flops(lambda a, b: jnp.tanh(a @ b)))(a, b)
    assert cost.flops == 2 * 4 * 8 * 16  # the matrix product
    assert cost.transcendentals == 4 * 16  # one tanh per element
    assert cost.by_primitive["dot_general"] == (1024, 0, (32 + 128 + 64) * 4)
    ```
    """

    def __init__(
        self, executions: Mapping[CostKey, Any], /, *, opaque: Mapping[str, Any] | None = None
    ):
        self.executions = dict(sorted(executions.items()))
        self.opaque = dict(sorted((opaque or {}).items()))

    def _total(self, field: int, name: str | None = None) -> Any:
        return _weighted_sum(
            (count, int(key[field]))
            for key, count in self.executions.items()
            if name is None or key[0] == name
        )

    @property
    def flops(self) -> Any:
        """The floating-point (and integer) operations that ran, transcendentals apart."""
        return self._total(1)

    @property
    def transcendentals(self) -> Any:
        """The transcendental functions computed (`exp`, `log`, `tanh`, `sin`, ...),
        one per element."""
        return self._total(2)

    @property
    def bytes_accessed(self) -> Any:
        """The bytes read and written, each operation's operands and outputs as if
        nothing were fused."""
        return self._total(3)

    @property
    def unpriced(self) -> dict[str, Any]:
        """How many times each primitive ran that kups has no cost rule for (a
        library's or a new JAX primitive that computes): its FLOPs and
        transcendentals are not in the totals, only its bytes. Empty when every
        operation that ran is priced."""
        names = sorted({key[0] for key in self.executions} & NO_RULE)
        return {
            name: _weighted_sum(
                (count, 1) for key, count in self.executions.items() if key[0] == name
            )
            for name in names
        }

    @property
    def by_primitive(self) -> dict[str, tuple[Any, Any, Any]]:
        """`(flops, transcendentals, bytes_accessed)` by primitive name."""
        names = sorted({key[0] for key in self.executions})
        return {name: tuple(self._total(field, name) for field in (1, 2, 3)) for name in names}

    def _sections(self) -> list[Section]:
        by_primitive = self.by_primitive

        def key(item: tuple[str, tuple[Any, ...]]) -> tuple[int, str]:
            flops = as_int(item[1][0])
            return (-flops if flops is not None else 0, item[0])

        rows = [
            (name, *map(format_number, totals))
            for name, totals in sorted(by_primitive.items(), key=key)
        ]
        sections: list[Section] = [(None, rows)]
        sections.append((None, [("total", *(format_number(getattr(self, f)) for f in _FIELDS))]))
        if self.opaque:
            calls = [(name, count, "", "") for name, count in rows_by_count(self.opaque)]
            sections.append(("not counted inside (calls):", calls))
        unpriced = self.unpriced
        if unpriced:
            runs = [(name, format_number(count), "", "") for name, count in unpriced.items()]
            sections.append(("no cost rule, FLOPs not counted (runs):", runs))
        return sections

    def __repr__(self) -> str:
        return text_table(
            "Cost", ("primitive", "flops", "transcendentals", "bytes"), self._sections()
        )

    def _repr_html_(self) -> str:
        return html_table(("primitive", "flops", "transcendentals", "bytes"), self._sections())


def _flatten(cost: Cost) -> tuple[list[tuple[Any, Any]], tuple[CostKey, ...]]:
    keys = tuple(cost.executions)
    children: list[tuple[Any, Any]] = [
        (jax.tree_util.DictKey(key), cost.executions[key]) for key in keys
    ]
    children.append((jax.tree_util.GetAttrKey("opaque"), cost.opaque))
    return children, keys


def _unflatten(keys: tuple[CostKey, ...], values: Iterable[Any]) -> Cost:
    *counts, opaque = values
    return Cost(dict(zip(keys, counts, strict=True)), opaque=opaque)


jax.tree_util.register_pytree_with_keys(
    Cost,
    _flatten,
    _unflatten,
    lambda cost: (tuple(child for _, child in _flatten(cost)[0]), tuple(cost.executions)),
)
jax.export.register_pytree_node_serialization(
    Cost,
    serialized_name="kups.instrument.Cost",
    serialize_auxdata=lambda keys: json.dumps([list(key) for key in keys]).encode(),
    deserialize_auxdata=lambda data: tuple(tuple(key) for key in json.loads(data)),
)
