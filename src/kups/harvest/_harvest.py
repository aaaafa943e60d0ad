"""`harvest`: plant some sown values and reap the others, in one call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kups.effects import (
    InterpreterPolicy,
    check_policy,
    reinterpret,
    stage_eagerly,
    wraps_with_leading,
)

from ._names import Tag
from ._plant import check_values, planted_call
from ._reap import Reaper
from ._reaped import Reaped
from ._selection import Selection


def harvest(
    fn: Callable[..., Any],
    *,
    tag: Tag,
    allowlist: Iterable[str | tuple[str, ...]] | None = None,
    blocklist: Iterable[str | tuple[str, ...]] | None = None,
    exclusive: bool = False,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps `fn` so that it plants given values and reaps the others, in one call.

    As in Oryx, the sows of `tag` are split in two: those whose names are in
    `values` are planted (the program sees the planted value), all the others
    are reaped. A planted name is therefore not in the reaped `dict`: its value
    is the one you passed (`{**values, **reaped}` holds every name). Every sow
    `harvest` acts on is consumed: an enclosing `reap` or `plant` of the same tag
    sees none of them. `harvest(fn, tag=t)({}, *args)` is `reap(fn, tag=t)(*args)`.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static.
    - `tag`: which sows to act on.
    - `allowlist`, `blocklist`, `exclusive`, `policy`: as for `reap`; they
      apply to planting and reaping alike.

    **Returns:**

    `wrapped(values, *args, **kwargs) -> (out, reaped)`, with `values` as for
    `plant` and `reaped` as `reap` returns it. `fn` is traced once; planting
    and reaping are two interpretation passes over that one trace (the
    planter's per-iteration scan counters need a loop updater, which the
    stacking that reaping uses does not take). `wrapped` can be jitted, vmapped
    and differentiated.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import harvest, sow


        def f(x):
            y = sow(x + 1.0, tag="intermediate", name="y")
            z = sow(y * 2.0, tag="intermediate", name="z")
            return z + 1.0


        out, reaped = harvest(f, tag="intermediate")({"y": 0.0}, 1.0)
        assert out == 1.0 and list(reaped) == ["z"] and reaped["z"] == 0.0
        out, reaped = harvest(f, tag="intermediate")({}, 1.0)
        assert out == 5.0 and reaped["y"] == 2.0 and reaped["z"] == 4.0
        ```
    """
    selection = Selection.of("harvest", tag, allowlist, blocklist, exclusive)
    if not callable(fn):
        raise TypeError(f"harvest(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "harvest(fn, policy=...)")
    planted = functools.partial(planted_call, fn, selection, "harvest", True, policy)

    @wraps_with_leading(fn, "values")
    def wrapped(values: Mapping[str, Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        check_values("harvest", tag, values)
        reaper = Reaper(selection)
        interpreter = reaper.interpreter("harvest", policy)
        out, ctx = reinterpret(planted, interpreter)(Reaped(tag, {}, {}), values, *args, **kwargs)
        return out, reaper.result(ctx)

    return stage_eagerly(wrapped)
