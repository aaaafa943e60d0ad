"""Which equations no handler would touch, so that they are re-bound whole.

Most interpreters handle a few primitives (a `sow`, a `check`, one swapped
operation) in programs of thousands of equations. A control-flow equation whose
sub-programs contain, recursively, no primitive that goes to a handler of its
own (nor to a fallback or a custom matching rule) leaves the context as it is,
so the interpreter re-binds it as one equation instead of walking it: the
program stays exactly the user's, and tracing costs what re-binding costs.

A control-flow primitive of a library (one kups has no handler for, such as
lineax's `linear_solve`) whose sub-programs no handler touches is re-bound the
same way: nothing inside it would be lost. A control-flow primitive of JAX's
whose handler the user removed is left to the interpreter's policy. When effects
go to handlers, a library primitive that holds Python functions (which may bind
an effect when it runs or compiles) counts as touched, so that the interpreter
reaches it and can tell when an effect would be lost there.

The decision is made once per jaxpr and set of handled primitive names (cached
weakly on the jaxpr), not at every equation.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax.extend.core import Jaxpr

from . import _compat
from ._effect import EFFECT_NAMES
from ._matching import contains_subjaxprs, holds_functions, is_control_flow, subjaxprs
from ._registry import DEFAULT_HANDLERS

# Options of the default handlers that only matter when a body changes the
# context: with an untouched body they do nothing. (`updater`, `reduce_ctx` and
# the shard_map spec declarations act on an unchanged context too.)
_INERT_OPTIONS = frozenset({"initializer", "threading", "thread_condition"})


class _SkipWhenUntouched:
    """A handler marked by `skip_when_untouched`; calls the one it wraps."""

    def __init__(self, handler: Any):
        self.handler = handler
        functools.update_wrapper(self, handler)

    def __call__(self, interpreter: Any, ctx: Any, eqn: Any, invals: list[Any]) -> Any:
        return self.handler(interpreter, ctx, eqn, invals)

    def __repr__(self) -> str:
        return f"skip_when_untouched({self.handler!r})"


def skip_when_untouched(handler: Any) -> Any:
    """Marks a control-flow handler that, when no equation inside the equation's
    sub-programs goes to a handler (recursively), does what the default handler
    does: threads the context through unchanged.

    The interpreter then re-binds such an equation whole, without calling the
    handler or walking its body, as it does for the default control-flow
    handlers; tracing costs what re-binding costs. Mark a handler only when that
    holds: for instance a `scan` handler that stacks the values a `sow` adds to
    the context, and leaves a context without new values as it is.

    **Arguments:**

    - `handler`: `handler(interpreter, ctx, eqn, invals) -> HandlerResult`.

    **Returns:**

    A handler that calls `handler`, to register in its place.
    """
    if not callable(handler):
        raise TypeError(
            f"skip_when_untouched needs a handler, callable as "
            f"handler(interpreter, ctx, eqn, invals); got {type(handler).__name__}."
        )
    return handler if isinstance(handler, _SkipWhenUntouched) else _SkipWhenUntouched(handler)


def _is_structural(handler: Any, defaults: frozenset[Any]) -> bool:
    """Whether `handler` is a default control-flow handler, which threads the
    context through a body and does nothing else, or one marked to act like it
    when its body is untouched."""
    if handler in defaults or isinstance(handler, _SkipWhenUntouched):
        return True
    return (
        isinstance(handler, functools.partial)
        and handler.func in defaults
        and not handler.args
        and set(handler.keywords) <= _INERT_OPTIONS
    )


class Handled(NamedTuple):
    """What a dispatcher does with primitives, by name: `touching` go to a handler
    of the user's (or of an effect); `structural` to a default control-flow
    handler, which only threads the context through its body."""

    touching: frozenset[str]
    structural: frozenset[str]
    # Whether effects go to handlers (see `holds_functions`).
    effects: bool = False


def handled_names(dispatcher: Any) -> Handled | None:
    """Which primitives a dispatcher's handlers take, or `None` when any equation
    might go to one (a fallback handler, or a custom matching rule, which decides
    per equation)."""
    if dispatcher._fallback is not None or any(
        rule is not contains_subjaxprs for rule in dispatcher._rules
    ):
        return None
    defaults = frozenset(DEFAULT_HANDLERS.values())
    structural = {
        name for name, handler in dispatcher._handlers.items() if _is_structural(handler, defaults)
    }
    touching = frozenset(dispatcher._handlers) - structural
    return Handled(touching, frozenset(structural), not EFFECT_NAMES.isdisjoint(touching))


_UNTOUCHED: weakref.WeakKeyDictionary[Jaxpr, dict[Handled, bool]] = weakref.WeakKeyDictionary()
_SKIPS: weakref.WeakKeyDictionary[Jaxpr, dict[Handled, list[bool]]] = weakref.WeakKeyDictionary()


def _eqn_untouched(eqn: Any, handled: Handled) -> bool:
    name = eqn.primitive.name
    if name in handled.touching:
        return False
    if not is_control_flow(eqn):
        return not (handled.effects and holds_functions(eqn, _compat.KNOWN_PARAMS))
    if name not in handled.structural and name in _compat.KNOWN_PARAMS:
        # A control-flow primitive of JAX's with no handler: the user took its
        # handler away (or never registered one), and the interpreter's policy
        # decides, whatever its body holds.
        return False
    # A default handler's, or a library's own primitive (lineax's `linear_solve`,
    # an equinox filter primitive): re-binding it loses nothing when no handler
    # would see anything inside.
    return all(untouched(sub, handled) for sub in subjaxprs(eqn.params))


def untouched(jaxpr: Any, handled: Handled) -> bool:
    """Whether re-binding `jaxpr`'s equations as they are (recursively) is what the
    interpreter would do with them."""
    jaxpr, _ = _compat.open_jaxpr(jaxpr)
    per_jaxpr = _UNTOUCHED.setdefault(jaxpr, {})
    found = per_jaxpr.get(handled)
    if found is None:
        found = per_jaxpr[handled] = all(_eqn_untouched(eqn, handled) for eqn in jaxpr.eqns)
    return found


def skipped_equations(
    jaxpr: Jaxpr, handled: Handled | None, plan: Sequence[tuple[Any, bool, Any]]
) -> list[bool] | None:
    """For each equation of `jaxpr`, whether it is control flow that no handler
    touches (to be re-bound whole); `None` when nothing may be skipped. `plan` is
    the interpreter's `(eqn, is_control_flow, ...)` per equation, so that
    `is_control_flow` is not asked twice of every equation."""
    if handled is None:
        return None
    per_jaxpr = _SKIPS.setdefault(jaxpr, {})
    skips = per_jaxpr.get(handled)
    if skips is None:
        skips = per_jaxpr[handled] = [
            control_flow and _eqn_untouched(eqn, handled) for eqn, control_flow, _ in plan
        ]
    return skips


def touched_inside(eqn: Any, touching: frozenset[str]) -> set[str]:
    """The names of the primitives in `touching` found in `eqn`'s sub-programs,
    recursively (for error messages)."""
    found: set[str] = set()
    for sub in subjaxprs(eqn.params):
        jaxpr, _ = _compat.open_jaxpr(sub)
        for inner in jaxpr.eqns:
            if inner.primitive.name in touching:
                found.add(inner.primitive.name)
            if is_control_flow(inner):
                found |= touched_inside(inner, touching)
    return found


# Runs of untouched equations shorter than this are re-bound one by one: a run
# bound as one call costs about as much as re-binding a few equations.
MIN_RUN = 16
RUN_NAME = "kups_untouched"


class Run(NamedTuple):
    """A run of equations of a jaxpr that no handler touches (from the index it is
    filed under in `untouched_runs` to `end`, excluded), as one const-free jaxpr:
    `jaxpr.invars` are defined before the run and read in it, `jaxpr.outvars`
    defined in it and read after it; `free` are the variables whose last use is
    in the run."""

    end: int
    jaxpr: Jaxpr
    free: list[Any]


_RUNS: weakref.WeakKeyDictionary[Jaxpr, dict[Handled, dict[int, Run] | None]] = (
    weakref.WeakKeyDictionary()
)


def untouched_runs(
    jaxpr: Jaxpr,
    handled: Handled | None,
    plan: Sequence[tuple[Any, bool, list[Any]]],
    skips: Sequence[bool] | None,
) -> dict[int, Run] | None:
    """The runs of at least `MIN_RUN` consecutive equations of `jaxpr` that no
    handler touches, by first index: equations without effects, re-bound as they
    are, under the same equation context (mesh, compute type). When staged, the
    interpreter binds each run as one `jit` call instead of re-binding its
    equations one by one (the compiled program is the same: XLA inlines the call).

    `None` when nothing may be skipped (a fallback or a matching rule decides per
    equation), and when no equation of `jaxpr` is touched: then the interpreter's
    walk re-binds it as it is, which keeps an identity interpretation exactly the
    user's jaxpr."""
    if handled is None or skips is None or len(plan) < MIN_RUN:
        # Too few equations for a run: nothing to look for.
        return None
    per_jaxpr = _RUNS.setdefault(jaxpr, {})
    if handled in per_jaxpr:
        return per_jaxpr[handled]
    # Not a "hijax" equation: a run holding one would have to be marked for JAX
    # to lower it to other equations (`is_high`).
    plain = [
        not eqn.effects
        and (skips[i] if control_flow else _eqn_untouched(eqn, handled))
        and not _compat.is_high_equation(eqn)
        for i, (eqn, control_flow, _) in enumerate(plan)
    ]
    runs: dict[int, Run] | None = None
    if not all(plain):
        runs = {}
        start = 0
        while start < len(plan):
            end = start
            if plain[start]:
                context = plan[start][0].ctx
                while end < len(plan) and plain[end]:
                    ctx = plan[end][0].ctx
                    if ctx is not context and ctx != context:
                        break
                    end += 1
            if end - start >= MIN_RUN:
                runs[start] = _run(plan[start:end], end)
            start = max(end, start + 1)
    per_jaxpr[handled] = runs
    return runs


def _run(plan: Sequence[tuple[Any, bool, list[Any]]], end: int) -> Run:
    """The run of `plan`'s equations (a slice of the interpreter's plan, whose
    last entry is equation `end - 1`): its outputs are the variables it defines
    whose last use is not in it."""
    eqns = [eqn for eqn, _, _ in plan]
    free = [v for _, _, frees in plan for v in frees]
    last_used_here = set(free)
    defined: set[Any] = set()
    invars: dict[Any, None] = {}
    outvars: list[Any] = []
    is_var = _compat.is_var
    for eqn in eqns:
        for v in eqn.invars:
            if is_var(v) and v not in defined:
                invars[v] = None
        defined.update(eqn.outvars)
        outvars += [v for v in eqn.outvars if v not in last_used_here]
    return Run(end, _compat.new_jaxpr(list(invars), outvars, eqns, RUN_NAME), free)


def bind_run(run: Run, env: dict[Any, Any], eqn: Any, name_stack: Any) -> bool:
    """Binds `run` (whose first equation is `eqn`) as one call on the values of
    `env`, and puts its outputs there: `False`, binding nothing, when the values
    are not of the types the run was cut for."""
    invals = [env[v] for v in run.jaxpr.invars]
    if not all(_compat.aval_of(x) == v.aval for x, v in zip(invals, run.jaxpr.invars)):
        return False
    with _compat.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        outvals = _compat.call_jaxpr(run.jaxpr, invals, RUN_NAME)
    env.update(zip(run.jaxpr.outvars, outvals, strict=True))
    del outvals
    for v in run.free:
        env.pop(v, None)
    return True
