"""The error record (the first failure, in buffers every check site shares) and
the `Error` that `checked` returns."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kups.effects import Event, Report, first_index

from ._automatic import _AutoCheck
from ._check import _CheckInfo

_Info = _CheckInfo | _AutoCheck


class CheckFailed(Exception):
    """Raised by `Error.throw()` when a check failed; its message says which and where."""


@dataclasses.dataclass(frozen=True)
class _Site:
    """A check together with the loops and shard_map axes around it where it runs:
    what the error record's `code` names."""

    info: _Info
    num_loops: int
    shard_axes: tuple[Hashable, ...]
    batch_ndim: int


_Aval = tuple[tuple[int, ...], str]  # (shape, dtype name) of a format argument


class _Layout:
    """The static part of the error record: the check sites met so far (in program
    order; the record's `code` is an index into them) and the shape of the buffers
    they share. Only the first failure is ever recorded, so every site writes the
    same buffers: its format arguments go to the payload buffers of their shape
    and dtype (the `k`-th argument of one aval to the `k`-th buffer of that aval),
    its loop iterations, shard coordinates and vmap index to the front of
    `iterations`, `shard` and `batch`. A loop carries a few arrays, however many
    checks its body has."""

    __slots__ = ("_codes", "_hash", "axes", "batch_ndim", "buffers", "depth", "sites")

    def __init__(
        self,
        sites: tuple[_Site, ...] = (),
        buffers: tuple[_Aval, ...] = (),
        depth: int = 0,
        axes: int = 0,
        batch_ndim: int = 0,
    ) -> None:
        self.sites = sites
        self.buffers = buffers
        self.depth, self.axes, self.batch_ndim = depth, axes, batch_ndim
        self._codes = {site: code for code, site in enumerate(sites)}  # sites are unique
        self._hash = hash((sites, buffers, depth, axes, batch_ndim))

    def _key(self) -> tuple[Any, ...]:
        return (self.sites, self.buffers, self.depth, self.axes, self.batch_ndim)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Layout) and self._key() == other._key())

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> tuple[Any, ...]:
        return self._key()

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__init__(*state)

    def __repr__(self) -> str:
        return f"_Layout({len(self.sites)} sites, {len(self.buffers)} payload buffers)"

    def code(self, site: _Site) -> int:
        return self._codes[site]

    def places(self, site: _Site) -> tuple[int, ...]:
        """The payload buffer of each of `site`'s format arguments."""
        return _places(_avals(site), self.buffers)

    def with_sites(self, sites: Iterable[_Site]) -> _Layout:
        """This layout with the sites it does not have yet appended, and its buffers
        grown to hold them."""
        new = [site for site in dict.fromkeys(sites) if site not in self._codes]
        if not new:
            return self
        buffers = list(self.buffers)
        for site in new:
            avals = _avals(site)
            for aval in dict.fromkeys(avals):
                missing = avals.count(aval) - buffers.count(aval)
                buffers.extend([aval] * missing)
        return _Layout(
            self.sites + tuple(new),
            tuple(buffers),
            max([self.depth, *(site.num_loops for site in new)]),
            max([self.axes, *(len(site.shard_axes) for site in new)]),
            max([self.batch_ndim, *(site.batch_ndim for site in new)]),
        )


def _avals(site: _Site) -> tuple[_Aval, ...]:
    return tuple((tuple(aval.shape), np.dtype(aval.dtype).name) for aval in site.info.avals)


@functools.lru_cache(maxsize=4096)
def _places(avals: tuple[_Aval, ...], buffers: tuple[_Aval, ...]) -> tuple[int, ...]:
    seen: dict[_Aval, int] = {}
    places = []
    for aval in avals:
        k = seen[aval] = seen.get(aval, -1) + 1
        places.append([i for i, buffer in enumerate(buffers) if buffer == aval][k])
    return tuple(places)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["code", "values", "iterations", "shard", "batch"],
    meta_fields=["layout"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class _Record:
    """What the first failing check recorded (zeros until one fails): its site
    (`code`, an index into `layout.sites`), its format arguments in the payload
    buffers, and the loop iterations (outermost first, `-1` past the site's
    loops), shard coordinates and vmap index of the failure. A field that no site
    needs is `None`: a program without loops carries no empty arrays."""

    layout: _Layout
    code: jax.Array
    values: tuple[jax.Array, ...]
    iterations: jax.Array | None
    shard: jax.Array | None
    batch: jax.Array | None

    @staticmethod
    def empty() -> _Record:
        return _Record(_Layout(), jnp.zeros((), jnp.int32), (), None, None, None)

    def with_sites(self, sites: Iterable[_Site]) -> _Record:
        """This record with room for `sites` (new buffers are zeros)."""
        layout = self.layout.with_sites(sites)
        if layout is self.layout:
            return self
        values = self.values + tuple(
            jnp.zeros(shape, dtype) for shape, dtype in layout.buffers[len(self.values) :]
        )
        return _Record(
            layout,
            self.code,
            values,
            _padded(self.iterations, layout.depth, -1),
            _padded(self.shard, layout.axes, 0),
            _padded(self.batch, layout.batch_ndim, 0),
        )

    def read(
        self, site: _Site
    ) -> tuple[list[Any], tuple[int, ...], tuple[int, ...] | None, tuple[int, ...]]:
        """`(values, iterations, shard, batch)` of a concrete record, for `site`."""
        values = [np.asarray(self.values[place]) for place in self.layout.places(site)]
        iterations = () if self.iterations is None else np.asarray(self.iterations).tolist()
        shard = () if self.shard is None else np.asarray(self.shard).tolist()
        batch = () if self.batch is None else np.asarray(self.batch).tolist()
        return (
            values,
            tuple(iterations[: site.num_loops]),
            tuple(shard[: len(site.shard_axes)]) if site.shard_axes else None,
            tuple(batch[: site.batch_ndim]),
        )


def _padded(array: jax.Array | None, size: int, fill: int) -> jax.Array | None:
    """An int32 vector (`None` for an empty one) padded with `fill` to `size`."""
    have = 0 if array is None else array.shape[0]
    if have == size:
        return array
    padding = jnp.full((size - have,), fill, jnp.int32)
    return padding if array is None else jnp.concatenate([array, padding])


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["failed", "record"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Error(Report):
    """What `checked` returns beside the output: the first failed check, if any.

    It is a pytree, so it can be returned from `jax.jit` (and passed through
    `vmap`, `lax.cond`, ...), and it is registered for `jax.export`
    serialization. Read it (`get`, `throw`, or the fields below) once it is
    concrete, outside the jitted function; reading a traced error is a
    `TypeError` that says so.

    The first failure is the one of the earliest loop iterations (outermost
    first), then in program order, then on the first shard in mesh order; an
    error that comes out of `jax.vmap` reads as its first failing element.

    **Fields:**

    - `failed`: a `bool[]` array, `True` when a check failed.
    - `message`: the formatted message of the first failure (without where it
      happened), or `None`.
    - `primitive`: `"check"` for a `check`, else the failing operation's
      primitive (`"div"`, `"gather"`, ...), or `None`.
    - `iteration`: the iteration of each loop (`scan`, `fori_loop`,
      `while_loop`) around the failure, outermost first (`()` outside loops), or
      `None` when nothing failed.
    - `shard`: the failing shard's coordinates on the manual mesh axes of the
      `shard_map`s around it (`{"x": 2, "y": 1}`), or `None`.
    - `source`: `"file.py:LINE"` of the failing `check` or operation, or `None`.
    - `kind`: `"user"`, `"index"`, `"div"` or `"nan"`, or `None`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.checks import check, checked


    def f(xs):
        def step(carry, x):
            check(x < 3, "x={x}", x=x)
            return carry, None

        return jax.lax.scan(step, 0, xs)[0]


    _, error = jax.jit(checked(f))(jnp.arange(5))
    assert (error.message, error.iteration, error.shard) == ("x=3", (3,), None)
    ```
    """

    failed: jax.Array
    record: _Record
    noun = "error"

    def _first(self) -> tuple[_Site, Event, tuple[int, ...]] | None:
        index = first_index(np.asarray(self.failed))
        if index is None:
            return None
        record = jax.tree.map(lambda leaf: np.asarray(leaf)[index], self.record)
        site = record.layout.sites[int(record.code)]
        info = site.info
        values, iterations, shard, batch = record.read(site)
        if isinstance(info, _AutoCheck):
            message = info.format(values, sharded=bool(site.shard_axes))
        else:
            message = info.format(values)
        event = Event(
            message=message,
            primitive=info.primitive if isinstance(info, _AutoCheck) else "check",
            source=info.location,
            iteration=iterations,
            shard=None if shard is None else dict(zip(site.shard_axes, shard, strict=True)),
        )
        return site, event, (*index, *batch)

    def first_event(self) -> Event | None:
        first = self._first()
        return None if first is None else first[1]

    def get(self) -> str | None:
        """The message of the first failed check, or `None` when every check passed.

        The message is the check's `msg` formatted with the values at the failing
        point (`message`), then where it failed: `at iteration 3` (0-based; for
        nested loops each level, outermost first), `on shard x=2, y=1` (inside
        `shard_map`) and the source line, e.g.
        `"x must be positive, got -1.0 at iteration 3 (model.py:12)"`.

        Under `jax.vmap` (inside the checked function, or of it), the first
        failing element (in row-major order) is reported with `at vmap index i`.

        **Raises:**

        `TypeError` under a JAX trace (inside `jit`): return the error from the
        jitted function and call `get` on the result.
        """
        self._event("get()")
        first = self._first()
        if first is None:
            return None
        _, event, vmap_index = first
        if vmap_index:
            index = vmap_index[0] if len(vmap_index) == 1 else vmap_index
            event = dataclasses.replace(event, message=f"{event.message} at vmap index {index}")
        return event.describe()

    @property
    def kind(self) -> str | None:
        """Which kind of check failed (`"user"`, `"index"`, `"div"`, `"nan"`), or `None`."""
        self._event("kind")
        first = self._first()
        return None if first is None else first[0].info.kind

    def throw(self) -> None:
        """Raises `CheckFailed` with the message of `get()` if a check failed."""
        message = self.get()
        if message is not None:
            raise CheckFailed(message)

    def __repr__(self) -> str:
        if self._is_traced():
            return f"Error(<traced>, {len(self.record.layout.sites)} check sites)"
        return f"Error({self.get()!r})"


def _register_for_export(cls: type, name: str) -> None:
    """Lets `jax.export` serialize `cls` in a pytree: its static fields (the check
    sites: messages, source lines, format trees) are pickled."""
    jax.export.register_pytree_node_serialization(
        cls,
        serialized_name=name,
        serialize_auxdata=pickle.dumps,
        deserialize_auxdata=pickle.loads,
    )


_register_for_export(_Record, "kups.checks.Record")
_register_for_export(Error, "kups.checks.Error")
