"""What an interpreter does with what it cannot enter: a control-flow equation no
handler takes, and an effect bound where it cannot see it. By its policy it
raises, warns or lets it go; the messages say what would be lost and the way out."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jax.extend.core import JaxprEqn, Primitive

from . import _compat
from ._effect import UNSEEN, LostEffectError
from ._matching import is_control_flow
from ._source import where
from ._types import InterpreterPolicy
from ._untouched import Handled, touched_inside


def unhandled(
    policy: InterpreterPolicy,
    label: str,
    policy_hint: str | None,
    handled: Handled | None,
    eqn: JaxprEqn,
    invals: list[Any],
) -> list[Any]:
    """Runs `eqn`, which no handler takes, as `policy` says: re-bound unchanged
    (`IGNORE`), the same with a warning (`WARN`), or a `NotImplementedError`."""
    if policy is InterpreterPolicy.IGNORE:
        return _compat.bind_equation(eqn.primitive, eqn.params, invals)
    name = eqn.primitive.name
    if policy_hint is not None and is_control_flow(eqn):
        message = (
            f"{label or 'kups'}: no handler for the control-flow {where(eqn)}. "
            f"Its sub-program would run without the interpreter, and "
            f"{_what_would_be_lost(eqn, handled)} Pass "
            f"policy=InterpreterPolicy.IGNORE to {policy_hint} to run it unchanged (what "
            f"happens inside it is then not seen), or InterpreterPolicy.WARN to be "
            f"warned and go on (from kups.effects import InterpreterPolicy)."
        )
    elif is_control_flow(eqn):
        message = (
            f"{label or 'kups'}: no handler for the control-flow {where(eqn)}. "
            f"Its sub-program would run without the interpreter, and "
            f"{_what_would_be_lost(eqn, handled)} Register a handler with "
            f"dispatcher.register_handler({name!r}, handler) (a handler that interprets "
            f"the body, like kups.effects.handlers.default_closed_call_handler), or "
            f"build the Interpreter with policy=InterpreterPolicy.IGNORE to run it "
            f"unchanged."
        )
    else:  # accepted by a custom matching rule
        message = (
            f"{label or 'kups'}: a custom matching rule accepts the {where(eqn)}, "
            f"but no handler is registered for it. Register one with "
            f"dispatcher.register_handler({name!r}, handler), or build the Interpreter "
            f"with policy=InterpreterPolicy.IGNORE to re-bind it unchanged."
        )
    if policy is InterpreterPolicy.RAISE:
        raise NotImplementedError(message)
    warnings.warn(message, stacklevel=3)
    return _compat.bind_equation(eqn.primitive, eqn.params, invals)


def cannot_enter(
    policy: InterpreterPolicy,
    label: str,
    policy_hint: str | None,
    eqn: JaxprEqn,
    action: str,
    consequence: str,
) -> None:
    """Raises, warns or lets go, by `policy`, a handler's running `eqn` whole
    because it cannot go inside it (see `Interpreter.cannot_enter`)."""
    if policy is InterpreterPolicy.IGNORE:
        return
    kind = "control-flow primitive" if is_control_flow(eqn) else "primitive"
    at = where(eqn).removeprefix("primitive ")
    head = f"{label or 'kups'} cannot {action} inside the {kind} {at}: {consequence}."
    if policy is InterpreterPolicy.RAISE:
        how = (
            f"pass policy=InterpreterPolicy.IGNORE (or WARN, to be warned) to {policy_hint}"
            if policy_hint is not None
            else "build the Interpreter with policy=InterpreterPolicy.IGNORE (or WARN)"
        )
        raise NotImplementedError(
            f"{head} To run it unchanged and go on, {how} "
            f"(from kups.effects import InterpreterPolicy)."
        )
    how = (
        f"Pass policy=InterpreterPolicy.IGNORE to {policy_hint}"
        if policy_hint is not None
        else "Build the Interpreter with policy=InterpreterPolicy.IGNORE"
    )
    warnings.warn(f"{head} It runs unchanged. {how} to silence this.", stacklevel=4)


def lost_effect(
    policy: InterpreterPolicy,
    label: str,
    policy_hint: str | None,
    acts_on: Callable[[Primitive, Mapping[str, Any]], bool] | None,
    effect: Any,
    eqn: JaxprEqn,
    params: dict[str, Any],
) -> None:
    """Raises, warns or lets go, by `policy`, the binding of `effect` with `params`
    by code that `eqn` runs out of the interpreter's sight."""
    if policy is InterpreterPolicy.IGNORE:
        return
    if acts_on is not None and not acts_on(effect, params):
        return
    name = effect.name.removeprefix("kups_")
    if policy_hint is not None:
        way_out = (
            f"Pass policy=InterpreterPolicy.IGNORE to {policy_hint} to run it anyway, "
            f"without that {name} (InterpreterPolicy.WARN: warned each time)"
        )
    else:
        way_out = (
            "Build the Interpreter with policy=InterpreterPolicy.IGNORE to run it "
            f"anyway, without that {name} (WARN: warned each time)"
        )
    message = (
        f"{label or 'kups'}: the effect {name!r} was bound by code that "
        f"the {where(eqn)} runs, and kups runs that primitive unchanged: it holds "
        f"Python functions rather than jaxprs, so kups cannot see into it, and the "
        f"{name} would be lost. {way_out}; or move the {name} out of "
        f"the function that {eqn.primitive.name!r} calls."
    )
    if policy is InterpreterPolicy.RAISE:
        raise LostEffectError(message)
    warnings.warn(message, stacklevel=4)


def _what_would_be_lost(eqn: JaxprEqn, handled: Handled | None) -> str:
    if handled is None:
        return "any equation inside it that a handler would take (a fallback handler is registered) would be lost."
    inside = sorted(touched_inside(eqn, handled.touching))
    if not inside:
        return (
            "nothing inside it goes to a handler now (so policy=InterpreterPolicy.IGNORE "
            "would lose nothing today)."
        )
    shown = ", ".join(repr(name) for name in inside[:5])
    return f"the equations inside it that go to your handlers ({shown}) would be lost."


class BackwardPass:
    """Stands for an interpreter in `UNSEEN` while the backward rule of a
    `custom_vjp` it ran runs (when JAX differentiates, after the interpreter has
    returned): an effect the interpreter handles, bound there, is lost."""

    def __init__(self, interpreter: Any, eqn: JaxprEqn):
        self.interpreter = interpreter
        self.dispatcher = interpreter.dispatcher
        self.eqn = eqn

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        previous, UNSEEN.top = UNSEEN.top, (self, self.eqn)
        try:
            yield
        finally:
            UNSEEN.top = previous

    def lost_effect(self, effect: Any, eqn: JaxprEqn, params: dict[str, Any]) -> None:
        lost_in_backward_pass(self.interpreter, effect, eqn, params)


def lost_in_backward_pass(
    interpreter: Any, effect: Any, eqn: JaxprEqn, params: dict[str, Any]
) -> None:
    """Raises, warns or lets go, by the interpreter's policy, the binding of
    `effect` by the backward rule of the `custom_vjp` equation `eqn`, run when JAX
    differentiates the interpreted function: after the interpreter has returned
    its context, so what the effect would record is lost."""
    if interpreter.policy is InterpreterPolicy.IGNORE:
        return
    if interpreter.acts_on is not None and not interpreter.acts_on(effect, params):
        return
    name = effect.name.removeprefix("kups_")
    hint = interpreter.policy_hint
    policy_way = (
        f"pass policy=InterpreterPolicy.IGNORE to {hint}"
        if hint is not None
        else "build the Interpreter with policy=InterpreterPolicy.IGNORE"
    )
    message = (
        f"{interpreter.label or 'kups'}: the effect {name!r} was bound by the backward "
        f"rule of the custom_vjp ({where(eqn)}). JAX runs that rule when it "
        f"differentiates the interpreted function, after the interpreter has returned "
        f"its context, so the {name} would be lost (jax.grad(reinterpret(f, ...)) "
        f"differentiates outside the interpreter). To see the backward pass, interpret "
        f"the gradient function instead: reinterpret(jax.grad(f), interpreter)(ctx, "
        f"*args) (its handlers then act on grad's program: a handler that changes "
        f"values changes them in the forward and backward equations alike, which gives "
        f"f's gradient taken at the changed values, not the gradient of the changed "
        f"program). To differentiate anyway without the {name}, {policy_way} "
        f"(InterpreterPolicy.WARN: warned each time)."
    )
    if interpreter.policy is InterpreterPolicy.RAISE:
        raise LostEffectError(message)
    warnings.warn(message, stacklevel=4)
