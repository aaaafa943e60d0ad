"""`find_nans`: the entry point."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kups.effects import (
    InterpreterPolicy,
    check_policy,
    reinterpret,
    stage_eagerly,
    wraps_with_leading,
)

from ._first import _FirstRecorder
from ._report import NanReport
from ._sites import _Sites
from ._taint_control import _reaching_report, _taint_dispatcher
from ._taint_interpreter import _TaintInterpreter
from ._taint_origin import _initial_taint
from ._walk import _check_kinds, _walk

_REPORTS = ("reaching", "first")


def find_nans(
    fn: Callable[..., Any],
    *,
    report: str = "reaching",
    kinds: tuple[str, ...] = ("nan", "inf"),
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, NanReport]]:
    """Wraps `fn` so that it also reports where a NaN or an Inf was made, and the
    line of user code that wrote it.

    Every floating value of the program is followed, through `jit`, `scan`,
    `while_loop`, `cond`/`switch`, `checkpoint`, custom derivatives and
    `shard_map`. Integer values are not checked. Inside a loop the report says
    which iteration, inside a `shard_map` on which shard.

    With `report="reaching"` (the default), the report is the equation that made
    the first NaN or Inf that is still there in an output of `fn`. A NaN that the
    program throws away on purpose (the untaken side of a `jnp.where`, a masked
    value, an Inf-filled buffer that is overwritten later, a comparison's
    operand) is forgotten where it is thrown away: libraries such as jax-md
    (`safe_mask`) and diffrax make those on purpose. A NaN is forgotten only
    where it really disappears: `NaN * 0` is NaN. Each value carries the origin
    of its NaN/Inf, so a NaN made at step 37 of a scan and carried to the output
    is reported at step 37, even if the same line made discarded Infs in every
    step before; a NaN that a collective spreads to other shards is reported on
    the shard that made it. A NaN already in the arguments (or a constant of the
    program) is reported at the first equation that computes with it.

    With `report="first"`, the report is the first equation, in execution order,
    whose output holds a NaN or an Inf, discarded later or not (what
    `jax.experimental.checkify`'s `nan_checks` reports, and Infs too).

    **Arguments:**

    - `fn`: the function to check. Its arguments are pytrees; leaves that are not
      arrays are static.
    - `report`: `"reaching"` or `"first"`, as above.
    - `kinds`: what to watch: `("nan", "inf")` (the default), `("nan",)` for NaNs
      only (an Inf is then followed until it becomes a NaN, as in `inf - inf`),
      or `("inf",)`.
    - `policy`: what to do with a control-flow primitive kups has no handler for
      (a library's own, holding a jaxpr): `InterpreterPolicy.RAISE` (the
      default) raises, `WARN` warns and runs it unwatched, `IGNORE` runs it
      unwatched.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, report)`, where `out` is `fn(*args,
    **kwargs)` and `report` a `NanReport`. `wrapped` can be jitted; read the
    report's properties outside the jit.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.debug import find_nans


    def f(x):
        safe = jnp.where(x > 0, jnp.log(x), 0.0)  # log(-1) is NaN, dropped
        return safe + jnp.sqrt(x + 0.5)  # sqrt(-0.5) is NaN, returned


    out, report = find_nans(f)(jnp.array([2.0, -1.0]))
    assert report.primitive == "sqrt"
    print(report.source)  # the file and line of `jnp.sqrt(x + 0.5)`
    _, first = find_nans(f, report="first")(jnp.array([2.0, -1.0]))
    assert first.primitive == "log"

    # The naive where is quiet, its gradient is not: 0 / 0 in log's derivative.
    grad = jax.grad(lambda x: jnp.where(x > 0, jnp.log(x), 0.0).sum())
    _, report = find_nans(grad)(jnp.array([1.0, 0.0]))
    assert report.primitive == "div"
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"find_nans(fn) needs a callable fn, got {type(fn).__name__}. Pass the "
            f"function itself, not its result: find_nans(f)(x)."
        )

    if report not in _REPORTS:
        raise ValueError(
            f"find_nans(fn, report={report!r}): report must be one of "
            f"{', '.join(repr(r) for r in _REPORTS)}. 'reaching' reports where the first "
            f"NaN/Inf that reaches an output of fn was made; 'first' reports the first "
            f"equation whose output holds one, even if it is discarded later."
        )

    kinds = _check_kinds(kinds, "find_nans")
    check_policy(policy, "find_nans(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, NanReport]:
        if report == "first":
            walked = _walk(fn, _FirstRecorder(), kinds, policy, "find_nans")
            out, record, sites = walked(*args, **kwargs)
            return out, NanReport(
                record.site, record.nan, record.shard, record.iterations, tuple(sites.sites)
            )
        sites = _Sites(kinds)
        taint = _TaintInterpreter(_taint_dispatcher(sites), sites, policy)
        out, final = reinterpret(fn, taint)(_initial_taint(), *args, **kwargs)
        return out, _reaching_report(final, sites)

    return stage_eagerly(wrapped)
