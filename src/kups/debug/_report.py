"""`NanReport`: where the NaN or Inf that `find_nans` reports was made."""

from __future__ import annotations

import html
import os
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ._sites import _Site


class NanReport:
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
    - `primitive`: the name of that equation's primitive, or `None`.
    - `source`: `"file.py:LINE"` of the user's code that produced it, or `None`.
      When JAX kept no user frame for the equation (a `jnp` function passed as
      it is, as in `lax.cond(p, jnp.log, ...)`), the line of the innermost
      control-flow call around it.
    - `path`: the full path of the file of `source`, or `None`.
    - `kind`: `"nan"` or `"inf"`: what that equation made (`"nan"` if its
      outputs hold both), even if it became a NaN later (`inf - inf`); or `None`.
    - `iterations`: the iteration (0-based, in execution order, also for
      `reverse=True`) of each `scan`, `fori_loop` or `while_loop` around it,
      outermost first; `()` outside loops. An equation of a `while_loop`'s
      condition reports the iteration that it follows (its first evaluation,
      before any iteration, reports 0 too).
    - `iteration`: the innermost of `iterations`, or `None`.
    - `shard`: `{axis: coordinate}` over the manual mesh axes of the
      `shard_map`s around it: the shard that made it (among shards that made
      theirs at the same point, counted in equations run, the first in mesh
      order; a NaN that a collective spreads is reported on the shard that made
      it); `None` outside `shard_map`.

    Values computed from constants alone (literals, closed-over arrays, and what
    is computed from them, such as the NaN `jnp.var` builds for an empty reduction
    and selects away) are not checked: such a NaN belongs to the program, and the
    first equation that combines it with data is reported instead.

    Under `jax.vmap` every property has a batch axis; read one element with
    `jax.tree.map(lambda leaf: leaf[i], report)`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.debug import find_nans


    def f(xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sqrt(x), None), 0.0, xs)[0]


    _, report = jax.jit(find_nans(f))(jnp.array([4.0, 1.0, -1.0, 9.0]))
    assert (report.primitive, report.kind, report.iteration) == ("sqrt", "nan", 2)
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

    def _concrete_site(self, what: str) -> _Site | None:
        if isinstance(self._site, Tracer):
            raise TypeError(
                f"NanReport.{what} needs concrete values, but this report holds traced "
                f"ones (it is used inside jax.jit or another transformation). Return the "
                f"report from the jitted function and read {what} outside."
            )
        if np.ndim(self._site) != 0:
            raise TypeError(
                f"NanReport.{what} is for one report, but this one is batched (shape "
                f"{np.shape(self._site)}, as jax.vmap returns it). Read element i with "
                f"jax.tree.map(lambda leaf: leaf[i], report).{what}."
            )
        index = int(self._site)
        return self._sites[index] if index >= 0 else None

    @property
    def found(self) -> Any:
        if isinstance(self._site, Tracer) or np.ndim(self._site) != 0:
            return self._site >= 0
        return int(self._site) >= 0

    @property
    def primitive(self) -> str | None:
        site = self._concrete_site("primitive")
        return site.primitive if site is not None else None

    @property
    def source(self) -> str | None:
        site = self._concrete_site("source")
        if site is None or site.file is None:
            return None
        return f"{os.path.basename(site.file)}:{site.line}"

    @property
    def path(self) -> str | None:
        """The full path of the file of `source`, or `None`."""
        site = self._concrete_site("path")
        return site.file if site is not None else None

    @property
    def kind(self) -> str | None:
        site = self._concrete_site("kind")
        if site is None:
            return None
        return "nan" if bool(self._nan) else "inf"

    @property
    def iterations(self) -> tuple[int, ...]:
        site = self._concrete_site("iterations")
        if site is None:
            return ()
        return tuple(int(i) for i in self._iterations[: site.loop_depth])

    @property
    def iteration(self) -> int | None:
        iterations = self.iterations
        return iterations[-1] if iterations else None

    @property
    def shard(self) -> dict[Any, int] | None:
        site = self._concrete_site("shard")
        if site is None or not site.manual_axes:
            return None
        index = int(self._shard)
        coordinates: dict[Any, int] = {}
        for name, size in reversed(site.mesh_axes):
            index, coordinates[name] = divmod(index, size)
        return {name: coordinates[name] for name, _ in site.manual_axes}

    def _fields(self) -> list[tuple[str, str]]:
        if not self.found:
            return [("found", "False")]
        fields = [
            ("found", "True"),
            ("kind", str(self.kind)),
            ("primitive", str(self.primitive)),
            ("source", str(self.source)),
        ]
        if self.iterations:
            iterations = self.iterations
            fields.append(
                ("iteration", str(iterations[0]) if len(iterations) == 1 else str(iterations))
            )
        shard = self.shard
        if shard is not None:
            fields.append(("shard", ", ".join(f"{name}={i}" for name, i in shard.items())))
        return fields

    def _opaque(self) -> str | None:
        """What this report holds when it cannot be read: traced or batched values."""
        if isinstance(self._site, Tracer):
            return "<traced>"
        if np.ndim(self._site) != 0:
            return f"<batched, shape {np.shape(self._site)}>"
        return None

    def __repr__(self) -> str:
        opaque = self._opaque()
        if opaque is not None:
            return f"NanReport({opaque})"
        return "NanReport(" + ", ".join(f"{k}={v}" for k, v in self._fields()) + ")"

    def _repr_html_(self) -> str:
        opaque = self._opaque()
        if opaque is not None:
            return f"<code>NanReport({html.escape(opaque)})</code>"
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
