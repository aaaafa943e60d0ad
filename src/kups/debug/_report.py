"""`NanReport`: where the NaN or Inf that `find_nans` reports was made."""

from __future__ import annotations

import dataclasses
import html
import json
import os
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from kups.effects import Event, Report, first_index

from ._position import _shard_coordinates
from ._sites import _Site


class NanReport(Report):
    """Where a program made the NaN or Inf that `find_nans` reports: with
    `report="reaching"` the first one that reaches an output, with
    `report="first"` the first one made anywhere.

    `find_nans` returns one. It is a pytree, so a `find_nans` function can be
    jitted and its report returned; read its properties on concrete values,
    outside the jit. It prints as one line in a terminal and as a table in a
    notebook.

    **Properties:**

    - `found`: whether an equation made a NaN or an Inf (that reaches an output,
      for `"reaching"`); a traced boolean inside `jax.jit`, the only property
      that can be read there.
    - `message`: what it was (`"sqrt made a NaN"`), or `None`.
    - `primitive`: the name of that equation's primitive, or `None`.
    - `source`: `"file.py:LINE"` of the user's code that produced it, or `None`.
      When JAX kept no user frame for the equation (a `jnp` function passed as
      it is, as in `lax.cond(p, jnp.log, ...)`), the line of the innermost
      control-flow call around it.
    - `path`: the full path of the file of `source`, or `None`.
    - `kind`: `"nan"` or `"inf"`: what that equation made (`"nan"` if its
      outputs hold both), even if it became a NaN later (`inf - inf`); or `None`.
    - `iteration`: the iteration (0-based) of each `scan`, `fori_loop` or
      `while_loop` around it, outermost first: `()` outside loops, `None` if
      nothing was found. For a `scan` with `reverse=True` it is the index into
      `xs` (entry `i` belongs to `xs[i]`, as the scan's own outputs), not the
      count of steps run. An equation of a `while_loop`'s condition reports the
      iteration that it follows (its first evaluation, before any iteration,
      reports 0 too). The same convention as `kups.checks.Error.iteration`.
    - `shard`: `{axis: coordinate}` over the manual mesh axes of the
      `shard_map`s around it: the shard that made it; `None` outside
      `shard_map`. A NaN that a collective spreads is reported on the shard
      that made it.

    When several events qualify, the first is the one of the earliest loop
    iterations (compared outermost first), then the earliest in program order,
    then the first shard in mesh order.

    Values computed from constants alone (literals, closed-over arrays, and what
    is computed from them, such as the NaN `jnp.var` builds for an empty reduction
    and selects away) are not checked: such a NaN belongs to the program, and the
    first equation that combines it with data is reported instead.

    Under `jax.vmap` the report's arrays have a batch axis; it reads as its
    first event (the lowest batch index that found one). Read element `i`
    with `jax.tree.map(lambda leaf: leaf[i], report)`.

    A `NanReport` can cross `jax.export`: it is registered for serialization.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.debug import find_nans


    def f(xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sqrt(x), None), 0.0, xs)[0]


    _, report = jax.jit(find_nans(f))(jnp.array([4.0, 1.0, -1.0, 9.0]))
    assert (report.primitive, report.kind, report.iteration) == ("sqrt", "nan", (2,))
    print(report)  # NanReport(found=True, kind=nan, primitive=sqrt, source=..., iteration=2)
    ```
    """

    def __init__(
        self, site: Any, nan: Any, shard: Any, iterations: Any, sites: tuple[_Site, ...]
    ) -> None:
        self._site = site
        self._nan = nan
        self._shard = shard
        self._iterations = iterations
        self._sites = sites

    def _one(self) -> tuple[NanReport, _Site | None]:
        """This report (for a batched one, as `jax.vmap` returns it, its first
        event: the lowest batch index that found one) and its site, if any."""
        one = self
        if np.ndim(self._site) > 0:
            index = first_index(np.asarray(self._site) >= 0) or (0,) * np.ndim(self._site)
            one = jax.tree.map(lambda leaf: np.asarray(leaf)[index], self)
        index = int(one._site)
        return one, (self._sites[index] if index >= 0 else None)

    def first_event(self) -> Event | None:
        one, site = self._one()
        if site is None:
            return None
        source = None if site.file is None else f"{os.path.basename(site.file)}:{site.line}"
        iteration = tuple(int(i) for i in np.asarray(one._iterations)[: site.loop_depth])
        shard = None
        if site.manual_axes:
            shard = _shard_coordinates(int(one._shard), site.manual_axes, site.mesh_axes)
        made = "a NaN" if bool(one._nan) else "an Inf"
        return Event(f"{site.primitive} made {made}", site.primitive, source, iteration, shard)

    @property
    def found(self) -> Any:
        if isinstance(self._site, Tracer):
            return self._site >= 0
        return bool((np.asarray(self._site) >= 0).any())

    @property
    def path(self) -> str | None:
        """The full path of the file of `source`, or `None`."""
        if self._event("path") is None:
            return None
        site = self._one()[1]
        return None if site is None else site.file

    @property
    def kind(self) -> str | None:
        if self._event("kind") is None:
            return None
        return "nan" if bool(self._one()[0]._nan) else "inf"

    def _fields(self) -> list[tuple[str, str]]:
        if not self.found:
            return [("found", "False")]
        fields = [
            ("found", "True"),
            ("kind", str(self.kind)),
            ("primitive", str(self.primitive)),
            ("source", str(self.source)),
        ]
        iteration = self.iteration
        if iteration:
            # One loop reads as its index; nested loops as the tuple.
            fields.append(("iteration", str(iteration[0] if len(iteration) == 1 else iteration)))
        shard = self.shard
        if shard is not None:
            fields.append(("shard", ", ".join(f"{name}={i}" for name, i in shard.items())))
        return fields

    def __repr__(self) -> str:
        if self._is_traced():
            return "NanReport(<traced>)"
        return "NanReport(" + ", ".join(f"{k}={v}" for k, v in self._fields()) + ")"

    def _repr_html_(self) -> str:
        if self._is_traced():
            return "<code>NanReport(&lt;traced&gt;)</code>"
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
            for k, v in self._fields()
        )
        return f"<table><caption>NanReport</caption>{rows}</table>"


def _flatten_report(report: NanReport) -> tuple[tuple[Any, ...], tuple[_Site, ...]]:
    return (report._site, report._nan, report._shard, report._iterations), report._sites


def _unflatten_report(sites: tuple[_Site, ...], children: Any) -> NanReport:
    site, nan, shard, iterations = children
    return NanReport(site, nan, shard, iterations, sites)


jax.tree_util.register_pytree_node(NanReport, _flatten_report, _unflatten_report)


def _serialize_sites(sites: tuple[_Site, ...]) -> bytes:
    return json.dumps([dataclasses.astuple(site) for site in sites]).encode()


def _deserialize_sites(data: bytes) -> tuple[_Site, ...]:
    def axes(pairs: list[list[Any]]) -> tuple[tuple[Any, int], ...]:
        return tuple((name, size) for name, size in pairs)

    return tuple(
        _Site(primitive, file, line, depth, axes(manual), axes(mesh))
        for primitive, file, line, depth, manual, mesh in json.loads(data)
    )


jax.export.register_pytree_node_serialization(
    NanReport,
    serialized_name="kups.debug.NanReport",
    serialize_auxdata=_serialize_sites,
    deserialize_auxdata=_deserialize_sites,
)
