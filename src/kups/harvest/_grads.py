"""`reap_grads`: the gradient of a scalar function with respect to each value it
sows under a tag, computed as the gradient with respect to a zero perturbation
added at every sow (`plant`, adding instead of replacing)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from kups.effects import (
    InterpreterPolicy,
    check_policy,
    reinterpret,
    stage_eagerly,
    wraps_with_leading,
)

from ._names import Tag
from ._plant import Planter
from ._planted import Planted
from ._reap import reap
from ._selection import Selection


def reap_grads(
    fn: Callable[..., Any],
    *,
    tag: Tag,
    allowlist: Iterable[str | tuple[str, ...]] | None = None,
    blocklist: Iterable[str | tuple[str, ...]] | None = None,
    has_aux: bool = False,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps `fn` so that it also returns the gradient of its output with respect
    to each value it sows under `tag`.

    The gradient of a name is what `jax.grad` gives with respect to a zero
    perturbation added to the value at its sow: for an `"append"` name in a
    scan, one entry per iteration; inside a `shard_map`, one entry per shard;
    for a name sown several times (`"clobber"`), the sum over its sows. It has
    the structure `reap` gives the values, so `grads[name]` lines up with
    `reap(fn, tag=tag)(*args)[1][name]`.

    **Arguments:**

    - `fn`: a function returning a scalar (or `(scalar, aux)` with `has_aux`).
      Its arguments that are not arrays are static.
    - `tag`, `allowlist`, `blocklist`, `policy`: which sows, as for `reap`.
    - `has_aux`: whether `fn` returns `(scalar, aux)`.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, grads)`, where `out` is `fn`'s output and
    `grads` a `dict` as `reap` returns it, holding d out / d (sown value). The
    sows it acts on are consumed, as by `reap`. `wrapped` can be jitted and
    vmapped.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import reap_grads, sow


        def loss(w, x):
            h = sow(jnp.tanh(w * x), tag="act", name="h")
            return jnp.sum(h**2)


        out, grads = reap_grads(loss, tag="act")(0.5, jnp.arange(3.0))
        h = jnp.tanh(0.5 * jnp.arange(3.0))
        assert jnp.allclose(grads["h"], 2 * h)
        ```
    """
    selection = Selection.of("reap_grads", tag, allowlist, blocklist, False)
    if not callable(fn):
        raise TypeError(f"reap_grads(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "reap_grads(fn, policy=...)")
    if not isinstance(has_aux, bool):
        raise TypeError(f"reap_grads(fn, has_aux=...) takes True or False, got {has_aux!r}.")
    reaping = reap(fn, tag=tag, allowlist=allowlist, blocklist=blocklist, policy=policy)

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        _, shapes = eqx.filter_eval_shape(reaping, *args, **kwargs)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def perturbed(perturbation: dict[str, Any]) -> tuple[Any, Any]:
            planter = Planter(selection, consume=True, add=True)
            interpreter = planter.interpreter("reap_grads", policy)
            ctx = Planted(selection.tag, perturbation, {}, (), ())
            out, _ = reinterpret(fn, interpreter)(ctx, *args, **kwargs)
            return (out[0], out) if has_aux else (out, out)

        grads, out = jax.grad(perturbed, has_aux=True, allow_int=True)(zeros)
        return out, grads

    return stage_eagerly(wrapped)
