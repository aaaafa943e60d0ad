"""The error record: one slot per check site, and the `Error` that `checked` returns."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Hashable

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
    """A check together with the loops and shard_map axes around it where it runs.
    One slot of the error record belongs to each site."""

    info: _Info
    num_loops: int
    shard_axes: tuple[Hashable, ...]
    batch_ndim: int


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["failed", "values", "iterations", "shard", "batch"],
    meta_fields=["site"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class _Slot:
    """What one check site recorded: zeros until it fails, then the values of the
    format arguments, the loop iterations (outermost first) and the shard
    coordinates (one per manual mesh axis) of the first failure. Where there is
    no loop, shard_map or vmap around the site, that field is `None`: a program
    with many sites carries no empty arrays."""

    site: _Site
    failed: jax.Array
    values: tuple[jax.Array, ...]
    iterations: jax.Array | None
    shard: jax.Array | None
    batch: jax.Array | None

    @staticmethod
    def empty(site: _Site) -> _Slot:
        return _Slot(
            site=site,
            failed=jnp.zeros((), jnp.bool_),
            values=tuple(jnp.zeros(aval.shape, aval.dtype) for aval in site.info.avals),
            iterations=_zeros(site.num_loops),
            shard=_zeros(len(site.shard_axes)),
            batch=_zeros(site.batch_ndim),
        )


def _zeros(size: int) -> jax.Array | None:
    return jnp.zeros((size,), jnp.int32) if size else None


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["failed", "slots"], meta_fields=[]
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
    slots: tuple[_Slot, ...]
    noun = "error"

    def _first(self) -> tuple[_Slot, Event, tuple[int, ...]] | None:
        index = first_index(np.asarray(self.failed))
        if index is None:
            return None
        for slot in self.slots:
            element = jax.tree.map(lambda leaf: np.asarray(leaf)[index], slot)
            if not element.failed:
                continue
            site = slot.site
            info = site.info
            if isinstance(info, _AutoCheck):
                message = info.format(list(element.values), sharded=bool(site.shard_axes))
            else:
                message = info.format(list(element.values))
            event = Event(
                message=message,
                primitive=info.primitive if isinstance(info, _AutoCheck) else "check",
                source=info.location,
                iteration=() if element.iterations is None else tuple(element.iterations.tolist()),
                shard=None
                if element.shard is None
                else dict(zip(site.shard_axes, element.shard.tolist(), strict=True)),
            )
            batch = () if element.batch is None else tuple(element.batch.tolist())
            return slot, event, (*index, *batch)
        raise AssertionError("kups.checks: the error is failed but no check site failed.")

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
        return None if first is None else first[0].site.info.kind

    def throw(self) -> None:
        """Raises `CheckFailed` with the message of `get()` if a check failed."""
        message = self.get()
        if message is not None:
            raise CheckFailed(message)

    def __repr__(self) -> str:
        if self._is_traced():
            return f"Error(<traced>, {len(self.slots)} check sites)"
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


_register_for_export(_Slot, "kups.checks.Slot")
_register_for_export(Error, "kups.checks.Error")
