"""JAX-version adapters for effect primitives (to be merged into `_compat.py`).

Everything here touches `jax._src`; `_effect.py` reaches JAX's private effect
machinery only through these helpers.
"""

from jax._src import effects as _jax_effects
from jax.extend.core import Effect


def register_effect_type(effect_type: type[Effect]) -> None:
    """Declares an effect type to JAX as unordered, lowerable, and allowed (and
    kept) everywhere a transformation might otherwise reject or drop it.

    Serves JAX 0.10.2. The effect type is *not* added to
    `effects.ordered_effects`: unordered effects need no runtime tokens, so the
    compiled program is the same as without the effect.

    - `lowerable_effects`: `jit` refuses to lower jaxprs with other effects.
    - `control_flow_allowed_effects`: `scan`, `while_loop`, `cond` reject
      bodies with other effects.
    - `remat_allowed_effects`: `jax.checkpoint` rejects bodies with other
      effects.
    - `custom_derivatives_allowed_effects`: `custom_jvp`/`custom_vjp` reject
      bodies with other effects.
    - `partial_eval_kept_effects`: on JAX 0.10.2, partial evaluation under
      `jax.grad` drops an effect whose outputs are unused inside a `scan` (and
      `jit`, `compute_on`) body unless its type is in this table.

    **Arguments:**

    - `effect_type`: a subclass of `jax.extend.core.Effect`.

    **Returns:**

    Nothing; JAX's global effect tables are updated in place.
    """
    for table in (
        _jax_effects.lowerable_effects,
        _jax_effects.control_flow_allowed_effects,
        _jax_effects.remat_allowed_effects,
        _jax_effects.custom_derivatives_allowed_effects,
        _jax_effects.partial_eval_kept_effects,
    ):
        table.add_type(effect_type)
