"""`nan_sites`: every equation that made a NaN or an Inf, in one run."""

from __future__ import annotations

import dataclasses
import html
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from kups.effects import InterpreterPolicy, check_policy, stage_eagerly, wraps_with_leading

from ._all_sites import _AllSitesRecorder
from ._position import _shard_coordinates
from ._report import _deserialize_sites, _serialize_sites
from ._sites import _Site
from ._walk import _check_kinds, _walk


@dataclasses.dataclass(frozen=True)
class NanSite:
    """One equation that made a NaN or an Inf (of one kind), as `NanSites` lists it.

    **Fields:**

    - `primitive`: the equation's primitive, e.g. `"log"`.
    - `source`: `"file.py:LINE"` of the user's code that wrote it (the line of the
      innermost control-flow call around it when JAX kept none), or `None`.
    - `path`: the full path of that file, or `None`.
    - `kind`: `"nan"` or `"inf"`.
    - `count`: how many executions of the equation made one: over loop
      iterations, shards and vmapped elements (not the elements of one array).
    - `first_iteration`: the iteration of each loop around it at the first of
      them, outermost first (`()` outside loops; the index into `xs` in a
      reversed scan).
    - `first_shard`: `{axis: coordinate}` of the shard of the first of them, or
      `None` outside `shard_map`.
    """

    primitive: str
    source: str | None
    path: str | None
    kind: str
    count: int
    first_iteration: tuple[int, ...]
    first_shard: dict[Any, int] | None


class NanSites:
    """Every equation that made a NaN or an Inf, as `nan_sites` returns it.

    A pytree (return it from a jitted function); read outside the jit, it is a
    sequence of `NanSite` records, those with a count above zero in program
    order (the NaN before the Inf for an equation that made both). Under
    `jax.vmap` the counts add up over the batch, and the first event is the one
    of the earliest iterations, then the lowest batch index. It prints as a
    table in a notebook.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.debug import nan_sites

    _, sites = jax.jit(nan_sites(lambda x: jnp.log(x) + 1.0 / x))(jnp.array([-1.0, 0.0]))
    assert [(s.primitive, s.kind) for s in sites] == [
        ("log", "nan"),
        ("log", "inf"),
        ("div", "inf"),
    ]
    ```
    """

    def __init__(self, table: Any, sites: tuple[_Site, ...], kinds: tuple[str, ...]) -> None:
        self._table = table
        self._sites = sites
        self._kinds = kinds

    def _records(self) -> list[NanSite]:
        if isinstance(self._table, Tracer):
            raise TypeError(
                "NanSites needs concrete values, but these are traced (read inside "
                "jax.jit or another transformation). Return them from the jitted "
                "function and read them outside."
            )
        full: np.ndarray = np.asarray(self._table)
        if full.size == 0:
            return []  # no equation was checked (the program only moves its inputs)
        capacity, kinds, columns = full.shape[-3:]
        table = full.reshape((-1, capacity, kinds, columns))  # the vmapped elements first
        records = []
        for index, site in enumerate(self._sites[:capacity]):
            for k, kind in enumerate(self._kinds):
                rows = table[:, index, k]
                counts = rows[:, 0]
                if counts.sum() == 0:
                    continue
                made = np.flatnonzero(counts > 0)
                depth = site.loop_depth
                first = min(made, key=lambda b: (tuple(rows[b, 2 : 2 + depth]), b))
                shard = None
                if site.manual_axes:
                    shard = _shard_coordinates(
                        int(rows[first, 1]), site.manual_axes, site.mesh_axes
                    )
                records.append(
                    NanSite(
                        primitive=site.primitive,
                        source=None
                        if site.file is None
                        else f"{os.path.basename(site.file)}:{site.line}",
                        path=site.file,
                        kind=kind,
                        count=int(counts.sum()),
                        first_iteration=tuple(int(i) for i in rows[first, 2 : 2 + depth]),
                        first_shard=shard,
                    )
                )
        return records

    def __iter__(self) -> Iterator[NanSite]:
        return iter(self._records())

    def __len__(self) -> int:
        return len(self._records())

    def __getitem__(self, index: int) -> NanSite:
        return self._records()[index]

    def __repr__(self) -> str:
        if isinstance(self._table, Tracer):
            return "NanSites(<traced>)"
        return "NanSites(" + ", ".join(_one_line(r) for r in self._records()) + ")"

    def _repr_html_(self) -> str:
        if isinstance(self._table, Tracer):
            return "<code>NanSites(&lt;traced&gt;)</code>"
        head = "".join(
            f"<th>{name}</th>"
            for name in ("primitive", "source", "kind", "count", "first iteration", "first shard")
        )
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(v))}</td>"
                for v in (r.primitive, r.source, r.kind, r.count, r.first_iteration, r.first_shard)
            )
            + "</tr>"
            for r in self._records()
        )
        return f"<table><caption>NanSites</caption><tr>{head}</tr>{rows}</table>"


def _one_line(site: NanSite) -> str:
    where = f"{site.primitive}@{site.source} {site.kind} x{site.count}"
    if site.first_iteration:
        where += f" from iteration {site.first_iteration}"
    if site.first_shard is not None:
        where += " on " + ", ".join(f"{name}={i}" for name, i in site.first_shard.items())
    return where


jax.tree_util.register_pytree_node(
    NanSites,
    lambda s: ((s._table,), (s._sites, s._kinds)),
    lambda aux, children: NanSites(children[0], *aux),
)
jax.export.register_pytree_node_serialization(
    NanSites,
    serialized_name="kups.debug.NanSites",
    serialize_auxdata=lambda aux: (
        b"%d:" % len(aux[1]) + ",".join(aux[1]).encode() + b":" + _serialize_sites(aux[0])
    ),
    deserialize_auxdata=lambda data: _split_aux(data),
)


def _split_aux(data: bytes) -> tuple[tuple[_Site, ...], tuple[str, ...]]:
    _, kinds, sites = data.split(b":", 2)
    return _deserialize_sites(sites), tuple(kinds.decode().split(","))


def nan_sites(
    fn: Callable[..., Any],
    *,
    kinds: tuple[str, ...] = ("nan", "inf"),
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, NanSites]]:
    """Wraps `fn` so that it also returns every equation that made a NaN or an Inf,
    how many times, and where first: in one run, without stopping.

    It checks what `find_nans(fn, report="first")` checks (every floating output
    of every equation, through `jit`, `scan`, `while_loop`, `cond`, `checkpoint`,
    custom derivatives and `shard_map`; values computed from constants alone are
    not checked, nor equations that only move elements, such as `reshape` or
    `concatenate`, which cannot make one) and costs about as much: it keeps a
    count per equation instead of the first event only, and writes the first
    events' iterations and shards once per loop step.

    **Arguments:**

    - `fn`: the function to check. Its arguments are pytrees; leaves that are not
      arrays are static.
    - `kinds`: `("nan", "inf")` (the default), `("nan",)` or `("inf",)`.
    - `policy`: what to do with a control-flow primitive kups has no handler for,
      as for `find_nans`.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, sites)`, where `out` is `fn(*args,
    **kwargs)` and `sites` a `NanSites`: iterate it (outside a jit) for the
    `NanSite` records.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.debug import nan_sites


    def f(xs):
        def step(total, x):
            return total + jnp.where(x > 0, jnp.log(x), 0.0), None

        return jax.lax.scan(step, 0.0, xs)[0]


    out, sites = jax.jit(nan_sites(f))(jnp.array([1.0, -1.0, 0.0, -2.0]))
    (nan, inf) = sites  # log made a NaN twice (from x[1]) and an Inf once (x[2])
    assert (nan.kind, nan.count, nan.first_iteration) == ("nan", 2, (1,))
    assert (inf.kind, inf.count, inf.first_iteration) == ("inf", 1, (2,))
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"nan_sites(fn) needs a callable fn, got {type(fn).__name__}. Pass the "
            f"function itself, not its result: nan_sites(f)(x)."
        )
    kinds = _check_kinds(kinds, "nan_sites")
    check_policy(policy, "nan_sites(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, NanSites]:
        recorder = _AllSitesRecorder(kinds)
        out, table, sites = _walk(fn, recorder, kinds, policy, "nan_sites")(*args, **kwargs)
        if len(sites.sites) > table.shape[0]:
            # More sites than the program shows (a library primitive entered by
            # tracing its implementation): walk again with room for all.
            recorder = _AllSitesRecorder(kinds, minimum=len(sites.sites))
            out, table, sites = _walk(fn, recorder, kinds, policy, "nan_sites")(*args, **kwargs)
        return out, NanSites(table, tuple(sites.sites), kinds)

    return stage_eagerly(wrapped)
