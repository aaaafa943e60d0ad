"""Tracing a sub-program, interpreted with a context, into a jaxpr.

Every control-flow handler does the same thing: interpret the body of the
equation with the context as an extra input and output, trace that into a new
jaxpr once, then bind the primitive again with it. This module is that step, and
the cache that makes each sub-program interpreted once per trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from . import _compat
from ._context import CtxSpec, split

if TYPE_CHECKING:
    from ._interpreter import Interpreter

BodyFn = Callable[..., tuple[list[Any], Any]]


@dataclass(frozen=True)
class TracedBody:
    """A body traced with the context threaded through it.

    `jaxpr` takes `[*consts, *ctx_values, *args]` and returns
    `[*ctx_out_values, *outs]`, where `consts` are the values the body closed over.
    """

    jaxpr: Jaxpr
    consts: tuple[Any, ...]
    ctx_in: CtxSpec
    ctx_out: CtxSpec
    out_avals: tuple[Any, ...]

    @property
    def num_consts(self) -> int:
        return len(self.consts)

    @property
    def num_ctx_out(self) -> int:
        return self.ctx_out.num_values

    def closed(self) -> ClosedJaxpr:
        """The jaxpr, closed with no consts (the consts are its leading inputs)."""
        return _compat.new_closed_jaxpr(self.jaxpr, ())

    def call(self, ctx_values: Sequence[Any], args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Evaluates the traced body: `(ctx_out_values, outs)`."""
        out = _compat.eval_jaxpr(self.jaxpr, [*self.consts, *ctx_values, *args])
        return out[: self.num_ctx_out], out[self.num_ctx_out :]


def trace_body(
    interpreter: Interpreter,
    fn: BodyFn,
    ctx_spec: CtxSpec,
    arg_avals: Sequence[Any],
    *,
    key: Any = None,
    name: str = "body",
) -> TracedBody:
    """Traces `fn(ctx, *args) -> (outs, ctx_out)` on `ctx_spec` and `arg_avals`.

    With a `key` (which must identify `fn`'s behaviour, such as the sub-jaxpr it
    interprets), the result is cached for the rest of the interpreter's top-level
    call: interpreting the same sub-program with the same context again reuses it,
    so nesting does not multiply the work.
    """
    if key is not None:
        entries = interpreter._body_cache.get(key)
        if entries:
            hit = _cached(entries, ctx_spec, arg_avals)
            if hit is not None:
                return hit

    num_ctx = ctx_spec.num_values
    ctx_out_cell: list[CtxSpec] = []

    def flat_fn(*flat: Any) -> list[Any]:
        ctx = ctx_spec.unflatten(flat[:num_ctx])
        outs, ctx_out = fn(ctx, *flat[num_ctx:])
        spec_out, ctx_out_values = split(ctx_out)
        ctx_out_cell.append(spec_out)
        return [*ctx_out_values, *outs]

    jaxpr, out_avals, consts = _compat.trace_to_jaxpr(
        flat_fn, [*ctx_spec.avals, *arg_avals], f"kups {name}"
    )
    spec_out = ctx_out_cell[0]
    spec_out = CtxSpec(
        spec_out.treedef,
        spec_out.paths,
        spec_out.value_mask,
        spec_out.statics,
        tuple(out_avals[: spec_out.num_values]),
    )
    traced = TracedBody(
        jaxpr=_compat.hoist_consts(jaxpr),
        consts=tuple(consts),
        ctx_in=ctx_spec,
        ctx_out=spec_out,
        out_avals=tuple(out_avals),
    )
    if key is not None and not any(isinstance(c, _compat.Tracer) for c in consts):
        # Filed under the key (a dict key keeps its jaxpr alive, so that its id is
        # not reused); the entry's own keys are computed when the key comes again.
        interpreter._body_cache.setdefault(key, []).append(_Entry(traced, tuple(arg_avals)))
    return traced


class _Entry:
    """A traced body in the cache, with the avals it was traced on and, computed
    when first compared, its exact and match keys (see `_cached`)."""

    __slots__ = ("_exact", "_match", "arg_avals", "traced")

    def __init__(self, traced: TracedBody, arg_avals: tuple[Any, ...]):
        self.traced = traced
        self.arg_avals = arg_avals
        self._exact: Any = _UNSET
        self._match: Any = _UNSET

    def exact(self) -> Any:
        if self._exact is _UNSET:
            self._exact = _exact_key(self.traced.ctx_in, self.arg_avals)
        return self._exact

    def match(self) -> Any:
        if self._match is _UNSET:
            self._match = _match_key(self.traced.ctx_in, self.arg_avals)
        return self._match


_UNSET = object()


def _exact_key(ctx_spec: CtxSpec, arg_avals: Sequence[Any]) -> Any:
    """The context's and arguments' types, or `None` when a static leaf of the
    context is not hashable (nothing is cached for it)."""
    ctx_key = ctx_spec.hash_key()
    return None if ctx_key is None else (ctx_key, tuple(arg_avals))


def _match_key(ctx_spec: CtxSpec, arg_avals: Sequence[Any]) -> Any:
    """`_exact_key` without the avals' shardings; only where that is not `None`."""
    return (ctx_spec.match_key(), tuple(map(_compat.aval_match_key, arg_avals)))


def _cached(entries: list[_Entry], ctx_spec: CtxSpec, arg_avals: Sequence[Any]) -> Any:
    """The traced body among `entries` (those of one key) that fits `ctx_spec` and
    `arg_avals`, or `None`.

    One traced on the same types fits. So does the first one traced on the same
    avals but for shardings JAX's type check ignores (a new context leaf made from
    a concrete array has no mesh; the same leaf carried into a shard_map body has
    one), when JAX's type check says so; the match key holds weak types, which
    typematch does not compare."""
    exact = _exact_key(ctx_spec, arg_avals)
    if exact is None:
        return None
    for entry in entries:
        if entry.exact() == exact:
            return entry.traced
    match = _match_key(ctx_spec, arg_avals)
    for entry in entries:
        if entry.exact() is not None and entry.match() == match:
            if all(
                map(
                    _compat.typematch,
                    (*entry.traced.ctx_in.avals, *entry.arg_avals),
                    (*ctx_spec.avals, *arg_avals),
                )
            ):
                return entry.traced
            return None
    return None


def interpret_fn(interpreter: Interpreter, jaxpr: ClosedJaxpr | Jaxpr) -> BodyFn:
    """`fn(ctx, *args) -> (outs, ctx)` that interprets `jaxpr` with `interpreter`."""
    closed = jaxpr if isinstance(jaxpr, ClosedJaxpr) else _compat.new_closed_jaxpr(jaxpr, ())

    def fn(ctx: Any, *args: Any) -> tuple[list[Any], Any]:
        return interpreter(closed, ctx, *args)

    return fn


def trace_interpreted(
    interpreter: Interpreter,
    jaxpr: ClosedJaxpr | Jaxpr,
    ctx_spec: CtxSpec,
    *,
    arg_avals: Sequence[Any] | None = None,
    name: str = "body",
) -> TracedBody:
    """Traces the interpretation of a sub-jaxpr with the context (cached)."""
    open_jaxpr, _ = _compat.open_jaxpr(jaxpr)
    if arg_avals is None:
        arg_avals = [v.aval for v in open_jaxpr.invars]
    return trace_body(
        interpreter, interpret_fn(interpreter, jaxpr), ctx_spec, arg_avals, key=jaxpr, name=name
    )


def passed_through(jaxpr: ClosedJaxpr | Jaxpr, ctx_spec: CtxSpec) -> TracedBody:
    """`jaxpr` as a traced body that takes the context and returns it unchanged,
    without tracing anything: for a sub-program the interpreter would only
    re-bind (`Interpreter._only_rebinds`)."""
    open_jaxpr, consts = _compat.open_jaxpr(jaxpr)
    hoisted = _compat.hoist_consts(open_jaxpr)
    num_consts = len(open_jaxpr.constvars)
    ctx_vars = [_compat.new_var(aval) for aval in ctx_spec.avals]
    new = _compat.replace_jaxpr(
        hoisted,
        invars=[*hoisted.invars[:num_consts], *ctx_vars, *hoisted.invars[num_consts:]],
        outvars=[*ctx_vars, *hoisted.outvars],
    )
    out_avals = (*ctx_spec.avals, *(v.aval for v in open_jaxpr.outvars))
    return TracedBody(new, tuple(consts), ctx_spec, ctx_spec, out_avals)
