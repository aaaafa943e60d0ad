"""The `sow` primitive and the function that binds it."""

from __future__ import annotations

import numbers
from typing import Any

import equinox as eqx
import jax

from kups.effects import define_effect

from ._names import check_name

MODES = ("strict", "append", "clobber")
"""The modes `sow` accepts."""

# The primitive every `sow` binds. Its name is unique: dispatchers key by name.
# Params: `tag`, `name`, `mode`, `tree` (of the value), `scope` (the scopes of
# the enclosing `nest` calls, outermost first) and `init` (a number or None).
sow_p = define_effect("kups_sow")

# Where a sown value goes in the result: its scopes, then its name.
SowPath = tuple[str, ...]


# ---------------------------------------------------------------- sow


def sow(
    value: Any,
    *,
    tag: str,
    name: str,
    mode: str = "strict",
    init: bool | int | float | complex | None = None,
) -> Any:
    """Marks `value` as an intermediate that `reap` can read and `plant` replace.

    Outside `reap`/`plant` (or under another tag) it is the identity, also
    under `jit`, `vmap`, `grad` and every control-flow primitive; JAX keeps it
    in the program even when its result is unused.

    **Arguments:**

    - `value`: a pytree of arrays.
    - `tag`: the group this value belongs to; `reap` and `plant` act on one tag.
    - `name`: the value's name within the tag.
    - `mode`: `"strict"` (the name is sown at most once per call), `"clobber"`
      (the last sow wins) or `"append"` (inside `scan`: one value per
      iteration, stacked along the iterations like the scan's outputs).
    - `init`: only with `mode="clobber"`, for a sow inside a loop. A number:
      what `reap` returns for the name when the `while_loop` (or `scan`) in
      which it is first sown runs zero times, filled into the shape and dtype
      of the sown value (every leaf). Without it, a name first sown inside a
      `while_loop` is an error, and one first sown in a zero-length `scan` is
      left out. A value sown before the loop takes precedence.

    **Returns:**

    `value`, or under `plant` the planted value.

    !!! Example

        ```python
        import jax.numpy as jnp
        from jax import lax
        from kups.harvest import reap, sow


        def f(x):
            y = sow(jnp.sin(x), tag="intermediates", name="y")
            return 2.0 * y


        out, sown = reap(f, tag="intermediates")(1.0)
        assert jnp.allclose(sown["y"], jnp.sin(1.0))
        assert jnp.allclose(out, 2.0 * jnp.sin(1.0))


        def halve_until_small(x):
            def body(x):
                return sow(x / 2, tag="intermediates", name="last", mode="clobber", init=-1.0)

            return lax.while_loop(lambda x: x > 1.0, body, x)


        # The loop runs zero times: "last" is the init.
        assert reap(halve_until_small, tag="intermediates")(0.5)[1]["last"] == -1.0
        assert reap(halve_until_small, tag="intermediates")(3.0)[1]["last"] == 0.75
        ```
    """
    check_name("tag", tag)
    check_name("name", name)
    if mode not in MODES:
        raise ValueError(
            f"sow(tag={tag!r}, name={name!r}) got mode={mode!r}; the modes are "
            f"{', '.join(map(repr, MODES))}."
        )
    if init is not None:
        if mode != "clobber":
            raise ValueError(
                f"sow(tag={tag!r}, name={name!r}, mode={mode!r}) got init={init!r}; init is "
                f"what a loop that runs zero times yields for a mode='clobber' name. Use "
                f"mode='clobber', or leave init out."
            )
        if not isinstance(init, numbers.Number):
            raise TypeError(
                f"sow(tag={tag!r}, name={name!r}) got init of type {type(init).__name__}; "
                f"init is a number (such as 0.0 or float('nan')), filled into the shape and "
                f"dtype of the sown value."
            )
    leaves, treedef = jax.tree.flatten(value)
    for leaf in leaves:
        if not eqx.is_array_like(leaf):
            raise TypeError(
                f"sow(tag={tag!r}, name={name!r}) needs a pytree of arrays, but a leaf of "
                f"the value is a {type(leaf).__name__}: {leaf!r}."
            )
    out = sow_p.bind(*leaves, tag=tag, name=name, mode=mode, tree=treedef, scope=(), init=init)
    return jax.tree.unflatten(treedef, out)
