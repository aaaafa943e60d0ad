"""Tagging intermediate values of a program, and reading (`reap`) or replacing
(`plant`) them from outside.

`sow(value, tag=..., name=...)` marks a value inside a program; it returns the
value unchanged and costs nothing when no interpreter looks at it. `reap(fn,
tag=...)` runs `fn` and also returns every value sown under `tag`, by name;
`plant(fn, tag=...)` runs `fn` with sown values replaced by given ones, and
`harvest(fn, tag=...)` does both in one call; `sow_cond(value, pred, ...)` sows
only where a predicate holds (in a loop: the last value where it held). A tag
is any hashable value (a string, a number, a tuple, an `Enum` member).
`nest(fn, scope=...)` puts the names `fn` sows under a scope: they come out as
`reaped[scope][name]`. All are
interpreters built on the public surface of `kups.effects`, so they see through
`jit`, `scan`, `fori_loop`, `while_loop`, `cond`/`switch`, `jax.checkpoint`,
`custom_jvp`/`custom_vjp` and `shard_map`.

Rules, by control-flow primitive (`reap` checks them and names the user's
source lines when one is broken):

- A name has one mode for the whole call: `"strict"` (sown at most once),
  `"clobber"` (the last sow wins) or `"append"` (one value per `scan`
  iteration).
- `scan` (and `fori_loop` with static bounds, `lax.map`): an `"append"` name
  comes out stacked along the iterations, entry `i` belonging to `xs[i]`
  (also with `reverse=True`); nested scans stack once per scan, outermost
  first. A `"clobber"` name first sown inside the scan comes out as the value
  of the last iteration that ran; after a scan of length 0 it has the value of
  the sow's `init` if it has one, else no value and it is left out of the
  result. A `"strict"` name cannot be sown inside a scan. Outside any scan, an
  `"append"` name is sown at most once, like a strict one.
- `while_loop` (and `fori_loop` with traced bounds): only `"clobber"` names may
  be sown inside it. A loop may run zero times, and a name first sown inside it
  would then have no value; kups does not invent one. Either sow an initial
  value before the loop, or say what a zero-trip loop yields with
  `sow(..., mode="clobber", init=value)`.
- `cond`/`switch`: the taken branch's values are reaped. A name that did not
  exist before the `cond` must be sown by every branch, with the same shape
  and dtype in each.
- `shard_map`: a name sown inside the body comes out with a new leading axis
  with one entry per shard of the body's manual mesh axes, in mesh order
  (row-major over those axes). Values sown only outside keep their shape.

Which sows a call acts on: those of its `tag` whose names pass `allowlist` and
`blocklist`. `reap` consumes them (an enclosing `reap` of the same tag sees
none of them); `plant` keeps them, with the planted values; `harvest` consumes
them. Sows a call does not act on stay in the program for an enclosing call,
except that with `exclusive=True` the sows of other tags are removed.
"""

from ._grads import reap_grads as reap_grads
from ._harvest import harvest as harvest
from ._nest import nest as nest
from ._plant import plant as plant
from ._reap import reap as reap
from ._sow import MODES as MODES
from ._sow import sow as sow
from ._sow import sow_cond as sow_cond

__all__ = ["MODES", "harvest", "nest", "plant", "reap", "reap_grads", "sow", "sow_cond"]


def __dir__() -> list[str]:
    """The public names only (not the private submodules Python sets here)."""
    return sorted(__all__)
