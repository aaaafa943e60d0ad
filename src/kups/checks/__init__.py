"""`check` and `checked`: runtime assertions inside jitted programs.

`check(pred, msg, *fmt_args, **fmt_kwargs)` records a condition where it runs:
inside `jit`, `scan`, `while_loop`, `cond`/`switch`, `jax.checkpoint`, custom
derivatives and `shard_map`. `checked(fn, errors=...)` runs `fn` under an
interpreter that turns every check into a few array operations on an error
value, which comes back beside `fn`'s output. With `errors=` it also checks the
program's own operations: out-of-bounds indices (`index_checks`), division by
zero (`div_checks`) and NaNs made from NaN-free inputs (`nan_checks`). Nothing
is raised inside the compiled program; the first failure is reported afterwards,
with where it happened.

Read as an example of an effect built on `kups.effects` and its toolkit:
`_check` (the primitive), `_automatic` (the automatic rules), `_error` (the
record and `Error`), `_sites` (where the checks are, found ahead), `_handlers`
(recording), `_checked` (the entry point).
"""

from ._automatic import all_checks as all_checks
from ._automatic import automatic_checks as automatic_checks
from ._automatic import div_checks as div_checks
from ._automatic import float_checks as float_checks
from ._automatic import index_checks as index_checks
from ._automatic import nan_checks as nan_checks
from ._automatic import user_checks as user_checks
from ._check import check as check
from ._checked import checked as checked
from ._error import CheckFailed as CheckFailed
from ._error import Error as Error

__all__ = [
    "CheckFailed",
    "Error",
    "all_checks",
    "automatic_checks",
    "check",
    "checked",
    "div_checks",
    "float_checks",
    "index_checks",
    "nan_checks",
    "user_checks",
]


def __dir__() -> list[str]:
    """The public names only (not the private submodules Python sets here)."""
    return sorted(__all__)
