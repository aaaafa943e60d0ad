"""`reap`: the values a program sows under a tag, through its control flow."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from kups.effects import (
    Dispatcher,
    Handler,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    ScanSemantics,
    check_policy,
    default_cond_handler,
    default_dispatcher,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reinterpret,
    shard_map_axes,
    skip_when_untouched,
    source_line,
    stage_eagerly,
    wraps_with_leading,
)

from ._batched import with_batched
from ._custom_jvp import reap_custom_jvp
from ._names import LazyLine, SowPath, Tag, describe, path_of, show_path
from ._reaped import Reaped, filled_with_init, init_of, nested
from ._rules import check_cond, check_scan, check_while
from ._seeding import Seeding
from ._selection import (
    Selection,
    pass_through,
    selective_interpreter,
    sows_around,
    sows_in,
    specs_like,
)
from ._sow import split_operands


def _transposed(eqn: JaxprEqn) -> bool:
    """Whether JAX made `eqn` by transposing (in the backward pass of a `grad`)."""
    return "transpose(" in str(eqn.source_info.name_stack)


class _Backward:
    """While a handler runs: counts, in `reaper.backward`, whether its equation is
    one JAX made by transposing. (A `with` block, not a wrapper: a frame more per
    nesting level slows the tracing of nested programs.)"""

    def __init__(self, reaper: Any, eqn: JaxprEqn) -> None:
        self.reaper, self.count = reaper, int(_transposed(eqn))

    def __enter__(self) -> None:
        self.reaper.backward += self.count

    def __exit__(self, *exc: object) -> None:
        self.reaper.backward -= self.count


class _Reaping(Interpreter):
    """The interpreter of one `reap` call, which its `reaper`'s handlers drive."""

    reaper: Reaper


def _counted(handler: Handler) -> Handler:
    """A default control-flow handler that counts, in `reaper.backward`, the
    equations of a backward pass it is inside while it runs."""

    def counted(interpreter: Any, ctx: Any, eqn: JaxprEqn, invals: list[Any]) -> Any:
        with _Backward(interpreter.reaper, eqn):
            return handler(interpreter, ctx, eqn, invals)

    return counted


# The default handlers at the time, and the dispatcher of them all `_counted`.
_COUNTING: tuple[Mapping[str, Handler], Dispatcher] | None = None


def _counting_dispatcher() -> Dispatcher:
    """A fresh dispatcher of the default handlers, each `_counted` (built once, and
    again when a handler module registers more)."""
    global _COUNTING
    plain = default_dispatcher()
    handlers = plain.handlers
    if _COUNTING is None or _COUNTING[0] != handlers:
        for name, handler in handlers.items():
            plain.register_handler(name, skip_when_untouched(_counted(handler)))
        _COUNTING = (handlers, plain)
    return _COUNTING[1].copy()


class Reaper(Seeding):
    """The handlers of one `reap` call (one tag), and what they remember for
    error messages: where each name was first sown."""

    def __init__(self, selection: Selection):
        self.selection = selection
        self.tag = selection.tag
        self.first_sown: dict[SowPath, str | LazyLine] = {}
        # The names sown in the forward pass, and how many equations around the
        # one being interpreted JAX made by transposing (a backward pass).
        self.forward: set[SowPath] = set()
        self.backward = 0

    def sows(self, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        return [eqn for eqn in sows_in(jaxpr) if self.selection.selects(eqn)]

    def sown_inside(self, body: Jaxpr | ClosedJaxpr) -> set[SowPath]:
        """The names the sows of `body` give a value: not those of a backward pass
        that runs the forward one again (a checkpointed function's), which `sow`
        leaves with the forward pass's value."""
        sows = self.sows(body)
        around = sows_around(body) if sows else {}
        inside = set()
        for sow_eqn in sows:
            path = path_of(sow_eqn)
            again = path in self.forward and (
                self.backward > 0
                or _transposed(sow_eqn)
                or any(_transposed(o) for place in around[id(sow_eqn)] for o in place)
            )
            if not again:
                inside.add(path)
        return inside

    def label(self, path: SowPath) -> str:
        return describe(self.tag, path)

    def interpreter(self, caller: str, policy: InterpreterPolicy) -> Interpreter:
        loops = {
            "scan": self.scan,
            "while": self.while_loop,
            "cond": self.cond,
            "shard_map": self.shard_map,
        }
        always = {"custom_jvp_call": functools.partial(reap_custom_jvp, self)}
        interpreter = selective_interpreter(
            self.selection,
            caller,
            policy,
            self.sow,
            loops,
            always,
            base=_counting_dispatcher(),
            kind=_Reaping,
        )
        assert isinstance(interpreter, _Reaping)
        interpreter.reaper = self
        return interpreter

    def result(self, ctx: Reaped) -> dict[str, Any]:
        """The reaped values as nested dicts (a scope is a dict of its names)."""
        scopes = {path[:depth]: path for path in self.first_sown for depth in range(1, len(path))}
        for path in sorted(set(scopes) & set(self.first_sown)):
            inner = scopes[path]
            raise ValueError(
                f"{self.label(path)} is sown at {self.first_sown[path]}, and "
                f"{show_path(path)!r} is also the scope of {show_path(inner)!r}, sown at "
                f"{self.first_sown[inner]}: the result cannot hold both a value and a dict of "
                f"names under one key. Rename the name or the nest scope."
            )
        # A sown constant reaches the handler as a Python scalar: return arrays.
        return nested(jax.tree.map(jnp.asarray, ctx.values))

    def sow(
        self, interpreter: Interpreter, ctx: Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        untaken = pass_through(self.selection, interpreter, ctx, eqn, invals)
        if untaken is not None:
            return untaken
        path = (*eqn.params["scope"], eqn.params["name"])
        if self.backward or _transposed(eqn):
            if path in self.forward:
                # A backward pass that runs the forward one again (the `custom_vjp`
                # of a checkpointed loop, such as diffrax's default adjoint) sows
                # again: the forward pass's values stay, in every mode.
                return HandlerResult(ctx, list(invals))
        else:
            self.forward.add(path)
        return HandlerResult(self.add(ctx, eqn.params, invals, LazyLine(eqn)), list(invals))

    def add(
        self, ctx: Reaped, params: dict[str, Any], operands: list[Any], where: str | LazyLine
    ) -> Reaped:
        """`ctx` with the sow of `params` on `operands` (bound at `where`) added."""
        path, mode = (*params["scope"], params["name"]), params["mode"]
        pred, leaves = split_operands(params, operands)
        value = jax.tree.unflatten(params["tree"], leaves)
        if path in ctx.modes:
            self.check_again(ctx, path, mode, where)
        else:
            self.first_sown.setdefault(path, where)
        if pred is not None:
            value = self.where(ctx, path, params, pred, value, where)
        return ctx.sown(path, value, mode)

    def check_again(self, ctx: Reaped, path: SowPath, mode: str, where: str | LazyLine) -> None:
        """A name already sown is sown again at `where`: only "clobber" allows it."""
        before = ctx.modes[path]
        first = self.first_sown.get(path, "unknown")
        if before != mode:
            raise ValueError(
                f"{self.label(path)} is sown with mode={before!r} at {first} and with "
                f"mode={mode!r} at {where}; a name has one mode. Use the same "
                f"mode for every sow of a name."
            )
        if mode == "strict":
            raise ValueError(
                f"{self.label(path)} is sown twice with mode='strict': at {first} and "
                f"again at {where}. A strict name is sown at most once per call. If a "
                f"function that sows it is called twice, wrap each call in "
                f"kups.harvest.nest(fn, scope=...) so each gets its own scope; otherwise use "
                f"mode='clobber' to keep the last value, or another name."
            )
        if mode == "append":
            raise ValueError(
                f"{self.label(path)} is sown twice with mode='append', at {first} and "
                f"again at {where}. 'append' stacks the values of one sow "
                f"along the iterations of the scans around it; a second sow of the name "
                f"(outside a scan, or in another scan) has nowhere to go. Use another "
                f"name, wrap each call in kups.harvest.nest(fn, scope=...), or "
                f"mode='clobber' to keep the last value."
            )

    def where(
        self,
        ctx: Reaped,
        path: SowPath,
        params: dict[str, Any],
        pred: Any,
        value: Any,
        at: str | LazyLine,
    ) -> Any:
        """The value of a `sow_cond`: `value` where `pred` holds, the name's value so
        far (or its `init`) elsewhere."""
        if path in ctx.values:
            before = ctx.values[path]
        elif params["init"] is not None:
            before = jax.tree.map(functools.partial(filled_with_init, self.tag, params, at), value)
        else:
            raise ValueError(
                f"{self.label(path)} is sown with sow_cond at {at} and has no value before: "
                f"where pred is false, the name would have no value, and kups does not invent "
                f"one. Give sow_cond(..., init=<number>), or sow an initial value with "
                f"sow(..., mode='clobber') before."
            )
        if jax.tree.structure(before) != jax.tree.structure(value) or any(
            jnp.shape(b) != jnp.shape(v)
            for b, v in zip(jax.tree.leaves(before), jax.tree.leaves(value))
        ):
            raise ValueError(
                f"{self.label(path)} is sown with sow_cond at {at} with the structure and shapes "
                f"{jax.tree.map(jnp.shape, value)}, but its value so far has "
                f"{jax.tree.map(jnp.shape, before)}. Each sow of the name must keep them."
            )
        return jax.tree.map(
            lambda new, old: jnp.where(pred, new, old).astype(jnp.result_type(old)), value, before
        )

    def scan(
        self, interpreter: Interpreter, ctx: Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        with _Backward(self, eqn):
            in_body = self.sows(eqn.params["jaxpr"])
            check_scan(self.tag, in_body, eqn)
            ctx = self.carried_clobbers(self.seeded(ctx, in_body, eqn), in_body, eqn)
            ctx = with_batched(ctx, in_body)
            # Names new in the body come back stacked along the iterations, entry i
            # belonging to xs[i]; names sown before the scan are carried.
            result = default_scan_handler(
                interpreter, ctx, eqn, invals, threading=ScanSemantics.RESULT
            )
            out: Reaped = result.ctx
            length, reverse = eqn.params["length"], eqn.params["reverse"]
            # The last iteration to run is the last entry, or the first one when reversed.
            last = 0 if reverse else -1
            values = {}
            for path, value in out.values.items():
                if path in ctx.values or out.modes[path] != "clobber":
                    values[path] = value
                elif length > 0:
                    values[path] = jax.tree.map(
                        lambda stacked: jax.lax.index_in_dim(stacked, last, keepdims=False), value
                    )
                else:
                    # A clobber name first sown in a scan that never runs has no value,
                    # unless its sow says what a zero-trip loop yields.
                    init = init_of(self.tag, path, in_body)
                    if init is not None:
                        values[path] = jax.tree.map(
                            lambda stacked, init=init: filled_with_init(
                                self.tag,
                                init.params,
                                source_line(init),
                                jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype),
                            ),
                            value,
                        )
            return HandlerResult(out.replace(values), result.outvals)

    def while_loop(
        self, interpreter: Interpreter, ctx: Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        with _Backward(self, eqn):
            params = eqn.params
            in_condition = self.sows(params["cond_jaxpr"])
            in_loop = [*in_condition, *self.sows(params["body_jaxpr"])]
            check_while(self.tag, in_loop, eqn)
            ctx = with_batched(self.seeded(ctx, in_loop, eqn), in_loop)
            inits: dict[SowPath, JaxprEqn] = {}
            for sow_eqn in in_loop:
                path = path_of(sow_eqn)
                if path not in ctx.values:
                    init = init_of(self.tag, path, in_loop)
                    if init is None:
                        raise ValueError(
                            f"{self.label(path)} is first sown at {source_line(sow_eqn)}, inside "
                            f"the while_loop at {source_line(eqn)}. The loop may run zero "
                            f"times, and then the name would have no value; kups does not invent "
                            f"one. Sow an initial value with mode='clobber' before the loop, or "
                            f"say what a zero-trip loop yields with "
                            f"sow(..., mode='clobber', init=<number>)."
                        )
                    inits[path] = init
            ctx = self.preseeded(ctx, inits, in_loop, eqn)

            def initializer(ctx_before: Reaped, sentinel: Reaped) -> Reaped:
                new = [path for path in sentinel.values if path not in ctx_before.values]
                if not new:
                    names = sorted({show_path(path_of(e)) for e in in_loop})
                    raise ValueError(
                        f"kups.harvest: the while_loop at {source_line(eqn)} sows {names} (tag "
                        f"{self.tag!r}) with a shape or dtype other than the value sown before "
                        f"the loop. A while loop carries these values, so each sow must keep the "
                        f"shape and dtype of the first one."
                    )
                values = dict(sentinel.values)
                for path in new:
                    values[path] = jax.tree.map(
                        functools.partial(
                            filled_with_init, self.tag, inits[path].params, source_line(inits[path])
                        ),
                        sentinel.values[path],
                    )
                return sentinel.replace(values)

            return default_while_handler(
                interpreter,
                ctx,
                eqn,
                invals,
                initializer=initializer,
                thread_condition=bool(in_condition),
            )

    def cond(
        self, interpreter: Interpreter, ctx: Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        with _Backward(self, eqn):
            branches = [self.sows(branch) for branch in eqn.params["branches"]]
            in_branches = [e for sows in branches for e in sows]
            ctx = self.seeded_for_cond(self.seeded(ctx, in_branches, eqn), branches)
            ctx = with_batched(ctx, in_branches)
            sown = [{path_of(e): e for e in sows} for sows in branches]
            check_cond(self.tag, sown, eqn, ctx.values)
            return default_cond_handler(interpreter, ctx, eqn, invals)

    def shard_map(
        self, interpreter: Interpreter, ctx: Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        with _Backward(self, eqn):
            _, manual_axes = shard_map_axes(eqn)
            inside = self.sown_inside(eqn.params["jaxpr"])

            def per_shard(ctx: Reaped) -> Reaped:
                # Each shard's value becomes its entry along a new leading axis.
                return ctx.replace(
                    {
                        path: jax.tree.map(lambda leaf: leaf[None], value)
                        if path in inside
                        else value
                        for path, value in ctx.values.items()
                    }
                )

            def out_specs(ctx_tree: Reaped) -> Reaped:
                return ctx_tree.replace(
                    {
                        path: specs_like(value, (manual_axes,) if path in inside else ())
                        for path, value in ctx_tree.values.items()
                    }
                )

            return default_shard_map_handler(
                interpreter, ctx, eqn, invals, declare_ctx_out_specs=out_specs, reduce_ctx=per_shard
            )


def reap(
    fn: Callable[..., Any],
    *,
    tag: Tag,
    allowlist: Iterable[str | tuple[str, ...]] | None = None,
    blocklist: Iterable[str | tuple[str, ...]] | None = None,
    exclusive: bool = False,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps `fn` so that it also returns the values it sows under `tag`.

    Sows of other tags, and sows that `allowlist`/`blocklist` leave out, stay in
    the program as they are (an enclosing `reap` or `plant` sees them); the sows
    `reap` takes are consumed. See the module documentation for what `scan`,
    `while_loop`, `cond` and `shard_map` do to sown values, and `sow` for the
    modes.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static,
      as in equinox's filter transformations.
    - `tag`: which sows to collect.
    - `allowlist`: if given, an iterable of names: only these are collected. An
      entry is a name as it appears in the result: a top-level name, or a
      `nest` scope (all the names in it); a tuple `("scope", "name")` picks a
      name inside a scope.
    - `blocklist`: an iterable of names (as for `allowlist`) not to collect.
      A name in both lists is an error.
    - `exclusive`: if `True`, sows of other tags are removed while `fn` runs,
      so no enclosing `reap` or `plant` sees them.
    - `policy`: what to do with a control-flow primitive kups has no handler
      for (a library's own, such as lineax's `linear_solve`) when a sow is
      inside it: `InterpreterPolicy.RAISE` (the default) raises
      `NotImplementedError` naming the primitive, since the sow would be lost;
      `WARN` warns and runs it unchanged; `IGNORE` runs it unchanged. A sow
      inside a primitive run unchanged is not reaped (nor planted). Such a
      primitive with no sow inside always runs unchanged.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, sown)`, where `out` is `fn(*args,
    **kwargs)` and `sown` a `dict` from each name sown under `tag` to its value
    (names sown inside `nest(..., scope=s)` under `sown[s]`, a `dict` of
    them). `wrapped` can be jitted, vmapped and differentiated.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from kups.harvest import reap, sow


        def f(xs):
            def step(total, x):
                total = total + x
                sow(total, tag="trace", name="running_total", mode="append")
                sow(x * x, tag="trace", name="square", mode="append")
                return total, None

            total, _ = jax.lax.scan(step, 0.0, xs)
            return total


        total, sown = jax.jit(reap(f, tag="trace"))(jnp.arange(4.0))
        assert jnp.allclose(sown["running_total"], jnp.array([0.0, 1.0, 3.0, 6.0]))
        _, only_totals = reap(f, tag="trace", allowlist=["running_total"])(jnp.arange(4.0))
        assert list(only_totals) == ["running_total"]
        ```
    """
    selection = Selection.of("reap", tag, allowlist, blocklist, exclusive)
    if not callable(fn):
        raise TypeError(f"reap(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "reap(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        reaper = Reaper(selection)
        interpreter = reaper.interpreter("reap", policy)
        out, ctx = reinterpret(fn, interpreter)(Reaped(tag, {}, {}), *args, **kwargs)
        return out, reaper.result(ctx)

    return stage_eagerly(wrapped)
