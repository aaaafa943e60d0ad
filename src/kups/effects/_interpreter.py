"""The interpreter: walks a jaxpr, threading a context through the handlers."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive

from . import _compat
from ._context import leaked_static_paths
from ._dispatcher import Dispatcher
from ._effect import EFFECT_NAMES, UNSEEN, LostEffectError, seen
from ._matching import contains_subjaxprs, holds_functions, is_control_flow
from ._traceback import api_boundary
from ._types import InterpreterPolicy
from ._untouched import (
    RUN_NAME,
    Handled,
    handled_names,
    skipped_equations,
    touched_inside,
    untouched_runs,
)

# Per jaxpr, its walking plan: for each equation, whether it is control flow and
# the variables whose last use it is (freed after it runs).
_PLANS: weakref.WeakKeyDictionary[Jaxpr, list[tuple[JaxprEqn, bool, list[Any]]]] = (
    weakref.WeakKeyDictionary()
)


def _plan(jaxpr: Jaxpr) -> list[tuple[JaxprEqn, bool, list[Any]]]:
    cached = _PLANS.get(jaxpr)
    if cached is not None:
        return cached
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not _compat.is_literal(v):
                last[v] = i
        for v in eqn.outvars:
            last.setdefault(v, i)  # defined and never read: freed at once
    for v in jaxpr.outvars:
        if not _compat.is_literal(v):
            last[v] = len(jaxpr.eqns)
    for v in (*jaxpr.constvars, *jaxpr.invars):
        last.setdefault(v, -1)
    frees: list[list[Any]] = [[] for _ in jaxpr.eqns]
    for v, i in last.items():
        if 0 <= i < len(jaxpr.eqns):
            frees[i].append(v)
    plan = [(eqn, is_control_flow(eqn), free) for eqn, free in zip(jaxpr.eqns, frees, strict=True)]
    _PLANS[jaxpr] = plan
    return plan


# Per jaxpr, for each equation, whether it is a library primitive holding Python
# functions (see `holds_functions`); computed for interpreters that handle effects.
_HOLDERS: weakref.WeakKeyDictionary[Jaxpr, list[bool]] = weakref.WeakKeyDictionary()


def _function_holders(jaxpr: Jaxpr) -> list[bool]:
    holders = _HOLDERS.get(jaxpr)
    if holders is None:
        holders = _HOLDERS[jaxpr] = [
            holds_functions(eqn, _compat.KNOWN_PARAMS) for eqn in jaxpr.eqns
        ]
    return holders


def where(eqn: JaxprEqn) -> str:
    """`primitive 'name' at file.py:LINE (function)` for error messages."""
    return f"primitive '{eqn.primitive.name}' at {_compat.source_line(eqn)}"


class Interpreter:
    """Walks a jaxpr with a context, sending equations to a dispatcher's handlers.

    An equation whose primitive has a handler goes to it. Any other equation without
    control-flow sub-programs is re-bound unchanged under its source info and name
    stack. A control-flow equation that no handler takes is governed by `policy`.
    Values are freed as soon as their last use has run.

    Control flow whose sub-programs no handler touches is re-bound whole, without
    walking it. While staging, a run of at least 16 equations no handler touches
    is bound as one `jit` call named `kups_untouched` holding those equations
    (XLA inlines it; see "Runs no handler touches" in the control-flow docs).

    **Arguments:**

    - `dispatcher`: which handler takes which primitive.
    - `policy`: what to do with an unhandled control-flow equation.
    - `label`: a name for this interpreter, shown in error messages and reprs.
    - `policy_hint`: how the user of an effect built on this interpreter chooses
      its policy (for example `"count_primitives(fn, policy=...)"`); error
      messages about unhandled equations name it as the way out.
    - `acts_on`: `acts_on(effect, params) -> bool`, which bindings of an effect
      primitive this interpreter handles would matter to it (a sow of its own
      tag, say). When such a binding happens where kups cannot see it (inside a
      library primitive run unchanged), the policy decides; bindings it returns
      `False` for are let go. `None`: every binding of a handled effect matters.

    **Subclassing:** to act around every jaxpr the interpreter runs (the program
    and each sub-program a handler interprets with `interpreter(body, ctx, *args)`),
    override `interpret_jaxpr` and call `super().interpret_jaxpr(...)` inside.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.effects import Interpreter, default_dispatcher

    x = jnp.arange(3.0)
    interpreter = Interpreter(default_dispatcher())
    closed = jax.make_jaxpr(jnp.sin)(x)
    outs, ctx = interpreter(closed, {"any": "pytree"}, x)
    assert (outs[0] == jnp.sin(x)).all() and ctx == {"any": "pytree"}
    ```
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        policy: InterpreterPolicy = InterpreterPolicy.RAISE,
        label: str = "",
        *,
        policy_hint: str | None = None,
        acts_on: Callable[[Primitive, Mapping[str, Any]], bool] | None = None,
    ):
        if not isinstance(dispatcher, Dispatcher):
            raise TypeError(
                f"Interpreter(dispatcher) takes a kups.effects.Dispatcher, got "
                f"{type(dispatcher).__name__}. Build one with default_dispatcher() or "
                f"Dispatcher({{primitive: handler}})."
            )
        if not isinstance(policy, InterpreterPolicy):
            raise TypeError(
                f"policy must be an InterpreterPolicy (RAISE, WARN or IGNORE), got {policy!r}."
            )
        self.dispatcher = dispatcher
        self.policy = policy
        self.label = label
        self._depth = 0
        self.policy_hint = policy_hint
        self.acts_on = acts_on
        self._body_cache: dict[Any, Any] = {}
        # The primitives that go to handlers of their own (None: any may), read
        # from the dispatcher at the start of each top-level call.
        self._handled: Handled | None = None

    def __repr__(self) -> str:
        label = f", label={self.label!r}" if self.label else ""
        return f"Interpreter({self.dispatcher!r}, policy={self.policy.name}{label})"

    @api_boundary
    def __call__(
        self, closed_jaxpr: ClosedJaxpr | Jaxpr, ctx: Any, *args: Any
    ) -> tuple[list[Any], Any]:
        """Interprets `closed_jaxpr` on `args` with `ctx`.

        **Arguments:**

        - `closed_jaxpr`: the program, as `jax.make_jaxpr(fn)(*args)` gives it (a
          `ClosedJaxpr`, or a `Jaxpr` without constvars). To interpret a Python
          function, use `reinterpret(fn, interpreter)`.
        - `ctx`: the context, any pytree.
        - `args`: one value per input of the jaxpr.

        **Returns:**

        `(outs, ctx)`: the list of the jaxpr's outputs and the final context.
        """
        if not isinstance(closed_jaxpr, (ClosedJaxpr, Jaxpr)):
            raise TypeError(_not_a_jaxpr(self, closed_jaxpr))
        jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
        if len(args) != len(jaxpr.invars):
            raise TypeError(
                f"{self.label or 'Interpreter'}: the jaxpr takes {len(jaxpr.invars)} "
                f"inputs, got {len(args)} arguments."
            )
        staging_starts = False
        if self._depth == 0:
            self._body_cache = {}
            self._handled = handled_names(self.dispatcher)
            staging_starts = not self.dispatcher._staged and _compat.is_staging()
        self._depth += 1
        try:
            with seen():
                return self.interpret_jaxpr(jaxpr, consts, ctx, args)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._body_cache = {}
            # Marked once the trace is done: an `interpret_jaxpr` override may still
            # register handlers for what it finds in the program it runs.
            if staging_starts:
                self.dispatcher._staged = True

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Sequence[Any], ctx: Any, args: Sequence[Any]
    ) -> tuple[list[Any], Any]:
        """Runs the equations of `jaxpr` with `ctx`: the hook a subclass overrides
        to act around every jaxpr this interpreter runs.

        `__call__` checks its arguments and calls this for the program and for
        every sub-program a handler interprets. An override calls
        `super().interpret_jaxpr(jaxpr, consts, ctx, args)` and may change the
        context before and after (push a frame, read the jaxpr's outputs).

        **Arguments:**

        - `jaxpr`: the open jaxpr to run.
        - `consts`: one value per `jaxpr.constvars`.
        - `ctx`: the context.
        - `args`: one value per `jaxpr.invars`.

        **Returns:**

        `(outs, ctx)`, as `__call__`.
        """
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        handlers = self.dispatcher._handlers
        # The stock rule only says what `is_control_flow` says; skip calling it.
        rules = [r for r in self.dispatcher._rules if r is not contains_subjaxprs]
        fallback = self.dispatcher._fallback
        is_literal = _compat.is_literal
        user_context = _compat.user_context
        outer_name_stack = _compat.current_name_stack()
        bind = _compat.bind_equation
        aval_of = _compat.aval_of
        # Control flow that no handler touches is re-bound whole (see _untouched).
        plan = _plan(jaxpr)
        skips = skipped_equations(jaxpr, self._handled, plan)
        # Staged, a long run of equations no handler touches is bound as one call.
        runs = untouched_runs(jaxpr, self._handled, plan, skips) if _compat.is_staging() else None
        resume = 0
        # When this interpreter handles effects, an equation bound unchanged may run
        # Python code that binds one unseen (a library primitive holding a function).
        watch_effects = not EFFECT_NAMES.isdisjoint(handlers)
        holders = _function_holders(jaxpr) if watch_effects else None
        # The abstract mesh in effect for the context's arrays (see _retyped), and
        # the one they were typed for before the first region changed it.
        start_mesh = ctx_mesh = _compat.current_mesh()
        home_mesh = None
        for index, (eqn, control_flow, free) in enumerate(plan):
            if index < resume:
                continue
            eqn_mesh = _compat.equation_mesh(eqn)
            # Staged under the enclosing mesh inside a shard_map body: the
            # equation runs, and its handler sees the context, under the body's.
            keep_mesh = eqn_mesh is not ctx_mesh and _compat.drops_manual_axes(eqn_mesh, ctx_mesh)
            if keep_mesh:
                eqn_mesh = ctx_mesh
            if eqn_mesh is not ctx_mesh and eqn_mesh != ctx_mesh:
                if home_mesh is None:
                    home_mesh = ctx_mesh if not ctx_mesh.empty else _typed_mesh(ctx)
                target = eqn_mesh
                if eqn_mesh.empty:  # type the context like the values it meets here
                    target = _compat.values_mesh(eqn) or home_mesh
                ctx = _retyped(ctx, target)
                ctx_mesh = eqn_mesh
            # A run's equations share one equation context, hence one mesh: the
            # context was retyped above as it would be for each of them.
            if runs is not None and index in runs:
                run = runs[index]
                invals = [env[v] for v in run.jaxpr.invars]
                if all(aval_of(x) == v.aval for x, v in zip(invals, run.jaxpr.invars)):
                    with (
                        user_context(eqn.source_info.traceback, name_stack=outer_name_stack),
                        eqn.ctx.manager,
                    ):
                        outvals = _compat.call_jaxpr(run.jaxpr, invals, RUN_NAME)
                    env.update(zip(run.jaxpr.outvars, outvals, strict=True))
                    del outvals
                    for v in run.free:
                        env.pop(v, None)
                    resume = run.end
                    continue
            invals = [v.val if is_literal(v) else env[v] for v in eqn.invars]  # pyright: ignore[reportAttributeAccessIssue]
            handler = handlers.get(eqn.primitive.name)
            source_info = eqn.source_info
            with (
                user_context(
                    source_info.traceback, name_stack=outer_name_stack + source_info.name_stack
                ),
                eqn.ctx.manager,
                _compat.abstract_mesh(ctx_mesh) if keep_mesh else contextlib.nullcontext(),
            ):
                if skips is not None and skips[index]:
                    outvals = self._bind_unchanged(eqn, invals, watch_effects)
                elif handler is not None:
                    ctx_before = ctx
                    ctx, outvals = self._dispatch(handler, ctx, eqn, invals)
                    if control_flow:
                        _check_static_leaves(handler, eqn, ctx_before, ctx)
                elif control_flow or (rules and any(rule(ctx, eqn, invals) for rule in rules)):
                    outvals = self._unhandled(eqn, invals)
                elif fallback is not None:
                    ctx, outvals = self._dispatch(fallback, ctx, eqn, invals)
                elif watch_effects:
                    outvals = self._bind_unchanged(eqn, invals, watch_effects)
                    if holders is not None and holders[index] and _compat.is_staging():
                        self._probe(eqn)
                else:
                    outvals = bind(eqn.primitive, eqn.params, invals)
            env.update(zip(eqn.outvars, outvals, strict=True))
            # Drop this frame's reference too, or an output nobody reads would live
            # until the next equation has run.
            del outvals
            for v in free:
                env.pop(v, None)
        outs = [v.val if is_literal(v) else env[v] for v in jaxpr.outvars]  # pyright: ignore[reportAttributeAccessIssue]
        if ctx_mesh is not start_mesh and ctx_mesh != start_mesh:
            ctx = _retyped(ctx, start_mesh if not start_mesh.empty else home_mesh)
        return outs, ctx

    def _bind_unchanged(self, eqn: JaxprEqn, invals: list[Any], watch_effects: bool) -> list[Any]:
        if not watch_effects:
            return _compat.bind_equation(eqn.primitive, eqn.params, invals)
        previous, UNSEEN.top = UNSEEN.top, (self, eqn)
        try:
            return _compat.bind_equation(eqn.primitive, eqn.params, invals)
        finally:
            UNSEEN.top = previous

    def _probe(self, eqn: JaxprEqn) -> None:
        """Staged, a library primitive may run the Python functions it holds only
        when compiled, long after this interpretation: lowers it once now, with
        `lost_effect` watching for an effect this interpreter handles. A primitive
        that cannot be lowered on its own here (a collective needing its
        shard_map) is left as it is."""
        avals: list[Any] = [v.aval for v in eqn.invars]
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

        def bind(*values: Any) -> list[Any]:
            return _compat.bind_equation(eqn.primitive, eqn.params, values)

        previous, UNSEEN.top = UNSEEN.top, (self, eqn)
        try:
            jax.jit(bind).lower(*args)
        except LostEffectError:
            raise
        except Exception:  # noqa: BLE001 - the probe is best effort; the program ran
            pass
        finally:
            UNSEEN.top = previous

    def lost_effect(self, effect: Any, eqn: JaxprEqn, params: dict[str, Any]) -> None:
        """Called when the effect primitive `effect`, which this interpreter
        handles, is bound with `params` while `eqn` is bound unchanged (by Python
        code that the equation's primitive runs, out of the interpreter's sight):
        by the policy, raises, warns or lets it go."""
        if self.policy is InterpreterPolicy.IGNORE:
            return
        if self.acts_on is not None and not self.acts_on(effect, params):
            return
        name = effect.name.removeprefix("kups_")
        caller = self.policy_hint
        if caller is not None:
            way_out = (
                f"Pass policy=InterpreterPolicy.IGNORE to {caller} to run it anyway, "
                f"without that {name} (InterpreterPolicy.WARN: warned each time)"
            )
        else:
            way_out = (
                "Build the Interpreter with policy=InterpreterPolicy.IGNORE to run it "
                f"anyway, without that {name} (WARN: warned each time)"
            )
        message = (
            f"{self.label or 'kups'}: the effect {name!r} was bound by code that "
            f"the {where(eqn)} runs, and kups runs that primitive unchanged: it holds "
            f"Python functions rather than jaxprs, so kups cannot see into it, and the "
            f"{name} would be lost. {way_out}; or move the {name} out of "
            f"the function that {eqn.primitive.name!r} calls."
        )
        if self.policy is InterpreterPolicy.RAISE:
            raise LostEffectError(message)
        warnings.warn(message, stacklevel=3)

    def _dispatch(
        self, handler: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
    ) -> tuple[Any, list[Any]]:
        result = handler(self, ctx, eqn, invals)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                f"The handler {_name(handler)} for {where(eqn)} returned "
                f"{type(result).__name__}; a handler returns HandlerResult(ctx, outvals)."
            )
        new_ctx, outvals = result
        _check_outvals(handler, eqn, outvals)
        return new_ctx, outvals

    def _unhandled(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
        if self.policy is InterpreterPolicy.IGNORE:
            return _compat.bind_equation(eqn.primitive, eqn.params, invals)
        name = eqn.primitive.name
        caller = self.policy_hint
        if caller is not None and is_control_flow(eqn):
            message = (
                f"{self.label or 'kups'}: no handler for the control-flow {where(eqn)}. "
                f"Its sub-program would run without the interpreter, and "
                f"{_what_would_be_lost(eqn, self._handled)} Pass "
                f"policy=InterpreterPolicy.IGNORE to {caller} to run it unchanged (what "
                f"happens inside it is then not seen), or InterpreterPolicy.WARN to be "
                f"warned and go on (from kups.effects import InterpreterPolicy)."
            )
        elif is_control_flow(eqn):
            message = (
                f"{self.label or 'kups'}: no handler for the control-flow {where(eqn)}. "
                f"Its sub-program would run without the interpreter, and "
                f"{_what_would_be_lost(eqn, self._handled)} Register a handler with "
                f"dispatcher.register_handler({name!r}, handler) (a handler that interprets "
                f"the body, like kups.effects.handlers.default_closed_call_handler), or "
                f"build the Interpreter with policy=InterpreterPolicy.IGNORE to run it "
                f"unchanged."
            )
        else:  # accepted by a custom matching rule
            message = (
                f"{self.label or 'kups'}: a custom matching rule accepts the {where(eqn)}, "
                f"but no handler is registered for it. Register one with "
                f"dispatcher.register_handler({name!r}, handler), or build the Interpreter "
                f"with policy=InterpreterPolicy.IGNORE to re-bind it unchanged."
            )
        if self.policy is InterpreterPolicy.RAISE:
            raise NotImplementedError(message)
        warnings.warn(message, stacklevel=2)
        return _compat.bind_equation(eqn.primitive, eqn.params, invals)


def _typed_mesh(ctx: Any) -> Any:
    """The mesh the context's first array typed for one is typed for, if any."""
    for leaf in jax.tree.leaves(ctx):
        mesh = _compat.typed_mesh(leaf)
        if mesh is not None:
            return mesh
    return None


def _retyped(ctx: Any, mesh: Any) -> Any:
    """The context with its arrays typed for `mesh`. Inside an `auto_axes` or
    `explicit_axes` region, equations run under a variant of the mesh with other
    axis types, and JAX rejects an operation (a handler's, on the context) whose
    operands are typed for another one; the context's arrays follow the program
    into the region and out of it, as `auto_axes` reshards the user's values.
    Out of a region into code traced with no mesh in effect (the region's mesh
    came from its arguments), they go back to the mesh they had before it."""
    if mesh is None:
        return ctx
    return jax.tree.map(lambda leaf: _compat.retype_for_mesh(leaf, mesh), ctx)


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


def _not_a_jaxpr(interpreter: Interpreter, value: Any) -> str:
    label = interpreter.label or "Interpreter"
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__name__
        return (
            f"{label} interprets a jaxpr, and was given the function {name} "
            f"({type(value).__name__}). To run a Python function (jitted or not) under "
            f"the interpreter, wrap it: reinterpret({name}, interpreter)(ctx, *args); "
            f"or trace it first: interpreter(jax.make_jaxpr({name})(*args), ctx, *args)."
        )
    return (
        f"{label} interprets a jaxpr (a jax.extend.core.ClosedJaxpr, as "
        f"jax.make_jaxpr(fn)(*args) returns), and was given a {type(value).__name__}. "
        f"Call it as interpreter(jax.make_jaxpr(fn)(*args), ctx, *args), or wrap the "
        f"function: reinterpret(fn, interpreter)(ctx, *args)."
    )


def _name(handler: Any) -> str:
    func = getattr(handler, "func", handler)  # functools.partial
    return getattr(func, "__qualname__", None) or type(handler).__name__


def _check_static_leaves(handler: Any, eqn: JaxprEqn, ctx_before: Any, ctx: Any) -> None:
    leaked = leaked_static_paths(ctx_before, ctx)
    if leaked:
        path, type_name = leaked[0]
        raise TypeError(
            f"The handler {_name(handler)} for {where(eqn)} returned a context whose leaf "
            f"ctx{path} is a {type_name} holding a traced array. A context leaf that is "
            f"not an array (nor a pytree of arrays) is static to kups, like a string, so "
            f"it cannot carry an array out of the '{eqn.primitive.name}' body: the array "
            f"would be a leaked tracer. Register {type_name} as a pytree (for example "
            f"with jax.tree_util.register_dataclass or "
            f"jax.tree_util.register_pytree_node_class, or make it an equinox.Module) so "
            f"that its arrays are context leaves."
        )


def _check_outvals(handler: Any, eqn: JaxprEqn, outvals: Any) -> None:
    if not isinstance(outvals, list):
        raise TypeError(
            f"The handler {_name(handler)} for {where(eqn)} returned outvals of type "
            f"{type(outvals).__name__}; outvals must be a list with one value per output "
            f"of the equation (for example HandlerResult(ctx, [y]) or "
            f"HandlerResult(ctx, list(ys)))."
        )
    if len(outvals) != len(eqn.outvars):
        raise ValueError(
            f"The handler {_name(handler)} for {where(eqn)} returned {len(outvals)} "
            f"outvals; the equation has {len(eqn.outvars)} outputs "
            f"({', '.join(v.aval.str_short() for v in eqn.outvars)}). Return a list with "
            f"one value per output, in the order of eqn.outvars."
        )
    for i, (var, val) in enumerate(zip(eqn.outvars, outvals, strict=True)):
        try:
            aval = _compat.aval_of(val)
        except TypeError as err:
            raise TypeError(
                f"The handler {_name(handler)} for {where(eqn)} returned a "
                f"{type(val).__name__} as output {i}, which is not an array. Return an "
                f"array (or a tracer) of type {var.aval.str_short()} for it."
            ) from err
        want: Any = var.aval
        if aval.shape != want.shape or aval.dtype != want.dtype:
            raise ValueError(
                f"The handler {_name(handler)} for {where(eqn)} returned output {i} of "
                f"type {aval.str_short()}; the equation's output {i} is "
                f"{want.str_short()}. A handler must keep every output's shape and dtype."
            )
