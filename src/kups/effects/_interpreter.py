"""The interpreter: walks a jaxpr, threading a context through the handlers.

The loop is `jax.core.eval_jaxpr`'s, with a dispatcher in the middle. What it
checks and says lives beside it: `_validation` (arguments, handler results),
`_policy` (what it cannot enter), `_meshes` (the context's mesh), `_source`
(the user's lines), `_plan` (what each jaxpr's walk can skip) and `_untouched`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive

from . import _compat, _policy
from ._dispatcher import Dispatcher
from ._effect import LostEffectError, seen, watched
from ._meshes import ContextMesh
from ._plan import Walk, walk_plan
from ._policy import BackwardPass
from ._source import api_boundary, enclosing
from ._types import InterpreterPolicy
from ._untouched import Handled, bind_run, handled_names, untouched
from ._validation import check_arguments, check_static_leaves, checked_result, in_handler

_CUSTOM_VJP_CALLS = ("custom_vjp_call",)

is_literal = _compat.is_literal
user_context = _compat.user_context


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
        jaxpr, consts = check_arguments(self.label, closed_jaxpr, args)
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

    def _only_rebinds(self, jaxpr: Jaxpr) -> bool:
        """Whether interpreting `jaxpr` would only re-bind its equations as they
        are: no handler, policy or fallback acts on anything in it, and no
        `interpret_jaxpr` override watches the jaxprs this interpreter runs."""
        handled = self._handled
        return (
            type(self).interpret_jaxpr is Interpreter.interpret_jaxpr
            and handled is not None
            and untouched(jaxpr, handled)
        )

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
        walk = walk_plan(jaxpr, self.dispatcher, self._handled)
        mesh = ContextMesh()
        name_stack = _compat.current_name_stack()
        resume = 0
        for index, (eqn, control_flow, free) in enumerate(walk.plan):
            if index < resume:
                continue
            ctx, mesh_scope = mesh.enter(eqn, ctx)
            run = walk.runs.get(index) if walk.runs is not None else None
            if run is not None and bind_run(run, env, eqn, name_stack):
                resume = run.end
                continue
            invals = [v.val if is_literal(v) else env[v] for v in eqn.invars]  # pyright: ignore[reportAttributeAccessIssue]
            info = eqn.source_info
            with (
                user_context(info.traceback, name_stack=name_stack + info.name_stack),
                eqn.ctx.manager,
                mesh_scope,
            ):
                ctx, outvals = self._eval(walk, index, control_flow, ctx, eqn, invals)
            env.update(zip(eqn.outvars, outvals, strict=True))
            # Drop this frame's reference too, or an output nobody reads would live
            # until the next equation has run.
            del outvals
            for v in free:
                env.pop(v, None)
        outs = [v.val if is_literal(v) else env[v] for v in jaxpr.outvars]  # pyright: ignore[reportAttributeAccessIssue]
        return outs, mesh.leave(ctx)

    def _eval(
        self,
        walk: Walk,
        index: int,
        control_flow: bool,
        ctx: Any,
        eqn: JaxprEqn,
        invals: list[Any],
    ) -> tuple[Any, list[Any]]:
        """`(ctx, outvals)` of one equation: by its handler, the policy, the
        fallback handler, or re-bound unchanged."""
        handler = walk.handlers.get(eqn.primitive.name)
        if walk.skips is not None and walk.skips[index]:
            return ctx, self._bind_unchanged(eqn, invals, walk.watch_effects)
        if handler is not None:
            if not control_flow:
                return self._call(handler, ctx, eqn, invals)
            with enclosing(eqn):
                new_ctx, outvals = self._call(handler, ctx, eqn, invals)
            check_static_leaves(handler, eqn, ctx, new_ctx)
            return new_ctx, outvals
        if control_flow or (walk.rules and any(rule(ctx, eqn, invals) for rule in walk.rules)):
            outvals = _policy.unhandled(
                self.policy, self.label, self.policy_hint, self._handled, eqn, invals
            )
            return ctx, outvals
        if walk.fallback is not None:
            return self._call(walk.fallback, ctx, eqn, invals)
        if walk.holders is not None and walk.holders[index]:
            outvals = self._bind_unchanged(eqn, invals, watch_effects=True, stage=False)
            if _compat.is_staging():
                self._probe(eqn)
            return ctx, outvals
        return ctx, self._bind_unchanged(eqn, invals, walk.watch_effects)

    def _call(
        self, handler: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]
    ) -> tuple[Any, list[Any]]:
        """`(ctx, outvals)` from `handler`, checked; an error raised by the user's
        code in it gets kups' context (see `in_handler`)."""
        try:
            result = handler(self, ctx, eqn, invals)
        except Exception as err:
            wrapped = in_handler(err, handler, eqn, ctx)
            if wrapped is None:
                raise
            # The user's frames stay the traceback's innermost.
            raise wrapped.with_traceback(err.__traceback__) from err
        return checked_result(handler, eqn, result)

    def _bind_unchanged(
        self, eqn: JaxprEqn, invals: list[Any], watch_effects: bool, *, stage: bool = True
    ) -> list[Any]:
        """`eqn`'s outputs, run unchanged: emitted as it is while staging (so a
        `shard_map` or custom rule's body is not traced again), else bound.
        `stage=False` binds always (a library primitive, whose binding may run its
        Python functions). With `watch_effects`, what the binding runs, and a
        `custom_vjp`'s backward rule kept for later, is watched for effects this
        interpreter would not see."""
        name = eqn.primitive.name
        watch_bwd = watch_effects and "bwd" in eqn.params and name in _CUSTOM_VJP_CALLS
        if stage and not watch_bwd:
            staged = _compat.stage_unchanged(eqn, invals)
            if staged is not None:
                return staged
        if not watch_effects:
            return _compat.bind_equation(eqn.primitive, eqn.params, invals)
        params = eqn.params
        if watch_bwd:
            # Its backward rule runs when JAX differentiates, after this returns.
            params = {
                **params,
                "bwd": _compat.wrapped_in(params["bwd"], BackwardPass(self, eqn).watching),
            }
        with watched(self, eqn):
            return _compat.bind_equation(eqn.primitive, params, invals)

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

        with watched(self, eqn):
            try:
                jax.jit(bind).lower(*args)
            except LostEffectError:
                raise
            except Exception:  # noqa: BLE001 - the probe is best effort; the program ran
                pass

    def cannot_enter(self, eqn: JaxprEqn, action: str, consequence: str) -> None:
        """For a handler that meets an equation it cannot go inside (a library's
        primitive that runs Python functions, say) and would run whole: by the
        policy, raises a `NotImplementedError` (`RAISE`), warns (`WARN`) or
        returns quietly (`IGNORE`). The message says `"{label} cannot {action}
        inside the {primitive} at {line}: {consequence}"`, and how to choose
        another policy (`policy_hint`).

        **Example:**

        ```python
        import jax
        import jax.numpy as jnp
        import pytest
        from kups.effects import HandlerResult, Interpreter, InterpreterPolicy
        from kups.effects import default_dispatcher, default_primitive_handler


        def opaque(interpreter, ctx, eqn, invals):
            interpreter.cannot_enter(eqn, "count", "what it runs is not counted")
            return default_primitive_handler(interpreter, ctx, eqn, invals)


        dispatcher = default_dispatcher().register_handler("sin", opaque)
        closed = jax.make_jaxpr(jnp.sin)(1.0)
        with pytest.raises(NotImplementedError, match="my_count cannot count inside"):
            Interpreter(dispatcher, label="my_count")(closed, None, 1.0)
        quiet = Interpreter(dispatcher, InterpreterPolicy.IGNORE, "my_count")
        assert quiet(closed, None, 1.0)[0][0] == jnp.sin(1.0)
        ```
        """
        _policy.cannot_enter(self.policy, self.label, self.policy_hint, eqn, action, consequence)

    def lost_effect(self, effect: Any, eqn: JaxprEqn, params: dict[str, Any]) -> None:
        """Called when the effect primitive `effect`, which this interpreter
        handles, is bound with `params` while `eqn` is bound unchanged (by Python
        code that the equation's primitive runs, out of the interpreter's sight):
        by the policy, raises, warns or lets it go."""
        _policy.lost_effect(
            self.policy, self.label, self.policy_hint, self.acts_on, effect, eqn, params
        )
