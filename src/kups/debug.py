"""`find_nans`: where a program made the NaN or Inf that matters.

Two reports share the sites (the equations that can be reported, registered on
the Python side while tracing: primitive, source line, loops and manual mesh
axes around them) and `NanReport`.

`report="first"`: a fallback handler re-binds every equation that is not
control flow and checks its floating outputs with `isfinite`, unless all its
inputs are constants of the program (tracked per jaxpr, and per call site into
`jit` bodies); the context records the index of the first site that failed, the
loop iterations at that moment and the shard. Loops push an iteration counter
(advanced by the loop handlers' `updater`); the record's iteration vector is
padded to the deepest loop nesting inside a loop or `cond` before it is
entered, so that loop carries and branches keep one shape. A `shard_map` body
starts with an empty record and hands out the record made first, by each
shard's count of equations run (ties go to the first shard in mesh order). The
context carries each shard's index in the mesh as a value sharded into the
body, so that no `axis_index` is needed (JAX before 0.10.2 cannot lower one
inside a nested `shard_map`).

`report="reaching"`: every floating value carries an origin (two int32 arrays:
when its NaN/Inf was made, and the site, iterations and shard where), kept per
jaxpr on the Python side; see the section of that name below. Origins cross
sub-program boundaries in the context (`_IO`), become loop carries, and are
reduced over the shards of a `shard_map` like the "first" record.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxprs_in_params
from jax.sharding import PartitionSpec as P

from kups.effects import (
    Dispatcher,
    Handler,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    check_policy,
    contains_subjaxprs,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reinterpret,
    shard_map_axes,
    source_location,
    to_current_mesh,
    wraps_with_leading,
)

__all__ = ["NanReport", "find_nans"]

_REPORTS = ("reaching", "first")

# A shard key larger than any shard's linear index: "no NaN on this shard".
_NO_SHARD = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class _Site:
    """An equation that can produce a NaN, as registered while tracing.

    `loop_depth` is the number of loops around it, `manual_axes` the manual mesh
    axes around it and `mesh_axes` all axes of their mesh, both `((name, size), ...)`
    in mesh order.
    """

    primitive: str
    file: str | None
    line: int | None
    loop_depth: int
    manual_axes: tuple[tuple[Any, int], ...]
    mesh_axes: tuple[tuple[Any, int], ...]


@dataclasses.dataclass(frozen=True)
class _Scope:
    """Static facts about where the current equation is (a static context leaf):
    the manual mesh axes around it, all axes of their mesh, and the innermost call
    (`jit`, `checkpoint`, ...) being interpreted, with which of its inputs are
    constants there."""

    manual_axes: tuple[tuple[Any, int], ...] = ()
    mesh_axes: tuple[tuple[Any, int], ...] = ()
    frame: _Frame | None = None
    # Used by report="reaching" only: the number of loops around the equation, and
    # whether the jaxpr being run is passive (it has no floating output, so nothing
    # it computes can reach one: its equations are only re-bound).
    loop_depth: int = 0
    passive: bool = False


@dataclasses.dataclass(frozen=True)
class _Frame:
    """A call's body and which of its inputs are constants at the call site."""

    jaxpr: Jaxpr
    constant_inputs: tuple[bool, ...]


class _State(NamedTuple):
    """The context `find_nans` threads through the program.

    - `site`: the index of the first equation that produced a NaN/Inf, or -1.
    - `nan`: whether that equation produced a NaN (otherwise an Inf).
    - `shard`: the row-major index in the whole mesh of the first shard (in mesh
      order) where it happened (coordinate 0 along axes that were not manual
      there), or -1.
    - `when`: the value of `tick` when that equation ran, or -1.
    - `tick`: how many checked equations have run so far on this shard: the
      clock that orders records from different shards.
    - `here`: the current shard's index in the same form: 0 outside `shard_map`;
      inside, a block of shape `(1, ...)`, one dimension per manual axis.
    - `iterations`: the iteration of each loop around that equation, outermost
      first, padded with -1 to the deepest loop nesting seen so far.
    - `counters`: the current iteration of each loop around the current equation.
    - `scope`: static facts about where the current equation is (`_Scope`).
    """

    site: Any
    nan: Any
    shard: Any
    iterations: Any
    when: Any
    tick: Any
    here: Any
    counters: tuple[Any, ...]
    scope: _Scope


def _initial_state() -> _State:
    return _State(
        site=jnp.int32(-1),
        nan=jnp.bool_(False),
        shard=jnp.int32(-1),
        iterations=jnp.zeros((0,), jnp.int32),
        when=jnp.int32(-1),
        tick=jnp.int32(0),
        here=jnp.int32(0),
        counters=(),
        scope=_Scope(),
    )


def _pad_iterations(state: _State, length: int) -> _State:
    """The state with `iterations` padded (with -1) to at least `length` entries."""
    missing = length - state.iterations.shape[0]
    if missing <= 0:
        return state
    padding = jnp.full((missing,), -1, jnp.int32)
    return state._replace(iterations=jnp.concatenate([state.iterations, padding]))


def _select(pred: Any, new: _State, old: _State) -> _State:
    """`new` where `pred`, else `old`, for the record fields (not the position)."""
    length = max(new.iterations.shape[0], old.iterations.shape[0])
    new, old = _pad_iterations(new, length), _pad_iterations(old, length)
    return old._replace(
        site=jnp.where(pred, new.site, old.site),
        nan=jnp.where(pred, new.nan, old.nan),
        shard=jnp.where(pred, new.shard, old.shard),
        iterations=jnp.where(pred, new.iterations, old.iterations),
        when=jnp.where(pred, new.when, old.when),
    )


# ---------------------------------------------------------------------------
# Static facts about sub-programs.
# ---------------------------------------------------------------------------

_LOOPS = frozenset({"scan", "while"})
_LOOP_DEPTH: weakref.WeakKeyDictionary[Jaxpr, int] = weakref.WeakKeyDictionary()


def _subjaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    for sub in jaxprs_in_params(eqn.params):
        yield sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def _eqn_loop_depth(eqn: JaxprEqn) -> int:
    """How deep loops nest in `eqn`, itself included."""
    if not contains_subjaxprs(None, eqn, []):
        return 0
    inner = max((_loop_depth(sub) for sub in _subjaxprs(eqn)), default=0)
    return inner + (eqn.primitive.name in _LOOPS)


def _loop_depth(jaxpr: Jaxpr) -> int:
    """How deep loops nest in `jaxpr` and its sub-programs."""
    depth = _LOOP_DEPTH.get(jaxpr)
    if depth is None:
        depth = max((_eqn_loop_depth(eqn) for eqn in jaxpr.eqns), default=0)
        _LOOP_DEPTH[jaxpr] = depth
    return depth


# ---------------------------------------------------------------------------
# Handlers.
# ---------------------------------------------------------------------------


class _Sites:
    """The equations checked during one trace, by index."""

    def __init__(self) -> None:
        self.sites: list[_Site] = []
        # The source of the control-flow equations being interpreted, innermost
        # last: the fallback for an equation with no user frame of its own (JAX
        # keeps none for `lax.cond(p, jnp.log, ...)`, whose branch is jnp's code).
        self.enclosing: list[tuple[str, int]] = []

    def add(self, eqn: JaxprEqn, state: _State) -> int:
        return self.add_at(eqn, len(state.counters), state.scope)

    def add_at(self, eqn: JaxprEqn, loop_depth: int, scope: _Scope) -> int:
        """Registers `eqn` as a site inside `loop_depth` loops, in `scope`."""
        location = source_location(eqn) or (self.enclosing[-1] if self.enclosing else None)
        file, line = location if location is not None else (None, None)
        self.sites.append(
            _Site(eqn.primitive.name, file, line, loop_depth, scope.manual_axes, scope.mesh_axes)
        )
        return len(self.sites) - 1


def _is_float(value: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(value), jnp.inexact)


def _check_equation(
    sites: _Sites, interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The fallback handler: re-binds the equation and checks its float outputs,
    unless they are constants of the program (see `_constant_equations`)."""
    outvals = default_primitive_handler(interpreter, state, eqn, invals).outvals
    floats = [value for value in outvals if _is_float(value)]
    if not floats or _is_constant(state.scope.frame, eqn):
        return HandlerResult(state, outvals)
    site = sites.add(eqn, state)
    bad = functools.reduce(jnp.logical_or, [~jnp.isfinite(value).all() for value in floats])
    nan = functools.reduce(jnp.logical_or, [jnp.isnan(value).any() for value in floats])
    first = bad & (state.site < 0)
    state = state._replace(
        site=jnp.where(first, jnp.int32(site), state.site),
        nan=jnp.where(first, nan, state.nan),
        shard=jnp.where(first, state.here.reshape(()), state.shard),
        iterations=jnp.where(first, _position(state), state.iterations),
        when=jnp.where(first, state.tick, state.when),
        # Saturates rather than wrapping around after 2**31 - 2 equations.
        tick=jnp.minimum(state.tick, _NO_SHARD - 2) + 1,
    )
    return HandlerResult(state, outvals)


# ---------------------------------------------------------------------------
# Constants: a NaN computed from constants alone is part of the program (jnp.var
# keeps one for an empty reduction and selects it away), not a finding.
# ---------------------------------------------------------------------------

_CONSTANTS: weakref.WeakKeyDictionary[
    Jaxpr, dict[tuple[bool, ...], tuple[frozenset[int], frozenset[Any]]]
]
_CONSTANTS = weakref.WeakKeyDictionary()


def _constant_equations(
    jaxpr: Jaxpr, constant_inputs: tuple[bool, ...]
) -> tuple[frozenset[int], frozenset[Any]]:
    """The equations of `jaxpr` (by `id`) whose inputs are all constants, and the
    variables that hold constants, given which inputs are constants.

    Constants are literals, the jaxpr's own constants, the given inputs, and the
    outputs of equations with only constant inputs and no sub-program.
    """
    by_inputs = _CONSTANTS.setdefault(jaxpr, {})
    if constant_inputs in by_inputs:
        return by_inputs[constant_inputs]
    constant = set(jaxpr.constvars)
    constant.update(v for v, c in zip(jaxpr.invars, constant_inputs, strict=True) if c)
    equations = set()
    for eqn in jaxpr.eqns:
        if contains_subjaxprs(None, eqn, []):
            continue
        if all(_is_literal(v) or v in constant for v in eqn.invars):
            equations.add(id(eqn))
            constant.update(eqn.outvars)
    result = frozenset(equations), frozenset(constant)
    by_inputs[constant_inputs] = result
    return result


def _is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def _is_constant(frame: _Frame | None, eqn: JaxprEqn) -> bool:
    """Whether every input of `eqn` is a constant: a literal, or (inside a call
    being interpreted) a constant of the call's body."""
    if all(_is_literal(v) for v in eqn.invars):
        return True
    if frame is None:
        return False
    equations, _ = _constant_equations(frame.jaxpr, frame.constant_inputs)
    return id(eqn) in equations


def _call_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a call-like equation: a sub-jaxpr that takes the equation's
    inputs one to one."""
    for jaxpr in jaxprs_in_params(eqn.params):
        if len(jaxpr.invars) == len(eqn.invars):
            return jaxpr
    return None


# Primitives whose body takes the equation's inputs one to one.
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
)


def _in_frame(handler: Handler) -> Handler:
    """`handler` for a call (`jit`, `checkpoint`, ...): the call's body and which of
    its inputs are constants become the frame that `_FramingInterpreter` picks up
    when the handler interprets the body."""

    def framed(interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]) -> Any:
        body = _call_body(eqn)
        outer = state.scope
        if body is None or outer.frame is None:
            return handler(interpreter, state, eqn, invals)
        _, constant_vars = _constant_equations(outer.frame.jaxpr, outer.frame.constant_inputs)
        constant_inputs = tuple(_is_literal(v) or v in constant_vars for v in eqn.invars)
        inner = dataclasses.replace(outer, frame=_Frame(body, constant_inputs))
        result = handler(interpreter, state._replace(scope=inner), eqn, invals)
        return HandlerResult(result.ctx._replace(scope=outer), result.outvals)

    return framed


class _FramingInterpreter(Interpreter):
    """An interpreter that makes every jaxpr it runs the current frame: the frame a
    call handler prepared for it (see `_in_frame`), or one whose inputs are not
    constants (a loop or branch body, the program itself)."""

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Any, ctx: Any, args: Any
    ) -> tuple[list[Any], Any]:
        if not isinstance(ctx, _State):
            return super().interpret_jaxpr(jaxpr, consts, ctx, args)
        outer = ctx.scope
        frame = outer.frame
        if frame is None or frame.jaxpr is not jaxpr:
            frame = _Frame(jaxpr, (False,) * len(jaxpr.invars))
        inner = dataclasses.replace(outer, frame=frame)
        outs, ctx = super().interpret_jaxpr(jaxpr, consts, ctx._replace(scope=inner), args)
        return outs, ctx._replace(scope=outer)


def _position(state: _State) -> Any:
    """The current loop counters, padded with -1 like `state.iterations`."""
    length = state.iterations.shape[0]
    if length == 0:
        return state.iterations
    padding = [jnp.int32(-1)] * (length - len(state.counters))
    return jnp.stack([jnp.asarray(c, jnp.int32) for c in (*state.counters, *padding)])


def _next_iteration(carried: _State, new: _State) -> _State:
    """The loop updater: the innermost loop counter advances after each iteration."""
    del carried
    *outer, current = new.counters
    return new._replace(counters=(*outer, current + 1))


def _check_loop(
    loop_handler: Callable[..., HandlerResult],
    interpreter: Any,
    state: _State,
    eqn: JaxprEqn,
    invals: list[Any],
) -> HandlerResult:
    """Runs a loop with one more counter; `iterations` is first padded to the
    deepest nesting inside, so that the loop carries a context of fixed shape."""
    outer_counters = state.counters
    state = _pad_iterations(state, len(outer_counters) + _eqn_loop_depth(eqn))
    state = state._replace(counters=(*outer_counters, jnp.int32(0)))
    result = loop_handler(interpreter, state, eqn, invals, updater=_next_iteration)
    return HandlerResult(result.ctx._replace(counters=outer_counters), result.outvals)


def _check_cond(interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]) -> HandlerResult:
    """Pads `iterations` for the deepest loop in any branch, so that every branch
    returns a context of the same shape."""
    depth = max(_loop_depth(branch.jaxpr) for branch in eqn.params["branches"])
    state = _pad_iterations(state, len(state.counters) + depth)
    return default_cond_handler(interpreter, state, eqn, invals)


def _all_axes(reduce: Callable[[Any, Any], Any], value: Any, axes: tuple[Any, ...]) -> Any:
    # One axis at a time: a collective over an axis tuple along some of which the
    # value is varying and along others invariant is an error in JAX 0.10.
    if value.size == 0:
        # Nothing to reduce (the iterations outside any loop). A fresh constant is
        # what the collective would give, invariant; XLA 0.11.2 crashes compiling
        # a collective over an empty array.
        return jnp.zeros(value.shape, value.dtype)
    for axis in axes:
        value = reduce(value, axis)
    return value


def _shard_indices(
    offset: Any, mesh_axes: tuple[tuple[Any, int], ...], manual: tuple[Any, ...]
) -> Any:
    """Every shard's index in the mesh, `offset` plus the part of the `manual` axes,
    as an array with one dimension per manual axis (mesh order) to shard over them."""
    strides, stride = {}, 1
    for name, size in reversed(mesh_axes):
        strides[name] = stride
        stride *= size
    sizes = dict(mesh_axes)
    index = jnp.asarray(offset, jnp.int32).reshape(())
    for position, name in enumerate(manual):
        shape = [1] * len(manual)
        shape[position] = sizes[name]
        part = jnp.arange(sizes[name], dtype=jnp.int32) * strides[name]
        index = index + part.reshape(shape)
    return index


@functools.lru_cache(maxsize=64)
def _first_shard(manual: tuple[Any, ...]) -> Callable[[_State], _State]:
    """`reduce_ctx` that keeps the record that was made first (by each shard's
    count of equations run), and among records made at the same count the one of
    the first shard in mesh order. The result is the same on every shard (cached
    so that the framework's body cache recognises it)."""

    def reduce_ctx(state: _State) -> _State:
        own = state.here.reshape(())
        found = state.site >= 0
        when = jnp.where(found, state.when, _NO_SHARD)
        first_when = _all_axes(jax.lax.pmin, when, manual)
        key = jnp.where(found & (when == first_when), state.shard, _NO_SHARD)
        first_key = _all_axes(jax.lax.pmin, key, manual)
        # Exactly one shard among those with the first key.
        chosen = own == _all_axes(jax.lax.pmin, jnp.where(key == first_key, own, _NO_SHARD), manual)

        def pick(value: Any) -> Any:
            return _all_axes(jax.lax.psum, jnp.where(chosen, value, jnp.zeros_like(value)), manual)

        any_found = first_key < _NO_SHARD
        return state._replace(
            site=jnp.where(any_found, pick(state.site), -1),
            nan=pick(state.nan.astype(jnp.int32)) > 0,
            shard=jnp.where(any_found, pick(state.shard), -1),
            iterations=jnp.where(any_found, pick(state.iterations), -1),
            when=jnp.where(any_found, pick(state.when), -1),
            # The clock goes on from the shard that ran the most equations
            # (`where` on `own` makes it varying, as pmax needs with check_vma).
            tick=_all_axes(jax.lax.pmax, jnp.where(own >= 0, state.tick, 0), manual),
            # Replicated, to leave the body; the caller keeps its own.
            here=jnp.zeros(state.here.shape, jnp.int32),
        )

    return reduce_ctx


def _check_shard_map(
    interpreter: Any, state: _State, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The body starts with no record; the earliest record of any shard comes out
    and replaces the outer one if that is empty."""
    mesh, manual_set = shard_map_axes(eqn)
    sizes = dict(mesh.shape)
    mesh_axes = tuple((name, sizes[name]) for name in mesh.axis_names)
    manual = tuple(name for name in mesh.axis_names if name in manual_set)
    names = {name for name, _ in state.scope.manual_axes} | set(manual)
    scope = tuple((name, size) for name, size in mesh_axes if name in names)
    inner = _initial_state()._replace(
        iterations=jnp.full(state.iterations.shape, -1, jnp.int32),
        tick=state.tick,
        here=_shard_indices(state.here, mesh_axes, manual),
        counters=state.counters,
        scope=_Scope(scope, mesh_axes, state.scope.frame),
    )

    def ctx_in_specs(tree: _State) -> _State:
        return jax.tree.map(lambda _: P(), tree)._replace(here=P(*manual))

    result = default_shard_map_handler(
        interpreter,
        inner,
        eqn,
        invals,
        declare_ctx_in_specs=ctx_in_specs,
        reduce_ctx=_first_shard(manual),
    )
    merged = _select(state.site < 0, result.ctx, state)._replace(tick=result.ctx.tick)
    return HandlerResult(merged, result.outvals)


def _located(sites: _Sites, handler: Handler) -> Handler:
    """`handler`, with its equation's source the enclosing one while it runs."""

    def located(interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]) -> Any:
        location = source_location(eqn)
        if location is None:
            return handler(interpreter, state, eqn, invals)
        sites.enclosing.append(location)
        try:
            return handler(interpreter, state, eqn, invals)
        finally:
            sites.enclosing.pop()

    return located


def _dispatcher(sites: _Sites) -> Dispatcher:
    dispatcher = (
        default_dispatcher()
        .register_handler("scan", functools.partial(_check_loop, default_scan_handler))
        .register_handler(
            "while",
            functools.partial(
                _check_loop, functools.partial(default_while_handler, thread_condition=True)
            ),
        )
        .register_handler("cond", _check_cond)
        .register_handler("shard_map", _check_shard_map)
        .register_fallback_handler(functools.partial(_check_equation, sites))
    )
    for name, handler in dispatcher.handlers.items():
        if name in _CALLS:
            handler = _in_frame(handler)
        dispatcher.register_handler(name, _located(sites, handler))
    return dispatcher


# ---------------------------------------------------------------------------
# report="reaching": every floating value carries the origin of its NaN/Inf.
#
# The origin of a floating value is `(w, info)`: `w` orders creation events (the
# value of `tick` when the event happened: a per-shard count of the equations
# that could create one), `_FINE` if the value is finite, `_UNKNOWN` if it may
# hold a NaN or Inf that no equation of the program created (an argument);
# `info` is `[2 * site + is_nan, shard, iteration of each loop...]` of the
# event. An equation's floating output is checked with `isfinite`: finite, its
# origin is `_FINE` (a NaN that a `where`, a slice or an overwrite dropped is
# forgotten); otherwise it inherits the earliest origin of its inputs, or is a
# new event here when no input held a NaN or Inf with an origin. Equations that
# cannot change whether a value is finite (reshapes, transposes, negation, ...)
# pass the origin on with no check, and values computed from constants alone
# carry none.
# ---------------------------------------------------------------------------

_FINE = np.int32(2**31 - 1)  # w of a finite value
_UNKNOWN = np.int32(2**31 - 2)  # w of a value that may hold a NaN/Inf of no site


class _Marker:
    """A static origin: `_DATA` (a value that is not floating, computed from the
    arguments), `_EXTERNAL` (a floating argument: it may hold a NaN/Inf that no
    equation made), `_FINITE` (a floating value known to be finite)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_DATA = _Marker("data")
_EXTERNAL = _Marker("external")
_FINITE = _Marker("finite")


class _Origin:
    """A traced origin: `w` (int32 scalar) and `info` (int32 vector), see above.
    `external` (static) says that `w` may be `_UNKNOWN`."""

    def __init__(self, w: Any, info: Any, external: bool) -> None:
        self.w = w
        self.info = info
        self.external = external


jax.tree_util.register_pytree_node(
    _Origin,
    lambda o: ((o.w, o.info), o.external),
    lambda external, children: _Origin(*children, external),
)


class _IO:
    """The origins that cross a sub-program's boundary, in the context: those of
    its inputs when the handler calls the interpreter, those of its outputs when
    the interpreter returns. `role` (static) says how they map to the jaxpr's
    inputs and outputs; `counts` (static) splits them into groups."""

    def __init__(self, role: str, counts: tuple[int, ...], origins: tuple[Any, ...]) -> None:
        self.role = role
        self.counts = counts
        self.origins = origins

    def groups(self) -> list[list[Any]]:
        parts, start = [], 0
        for count in self.counts:
            parts.append(list(self.origins[start : start + count]))
            start += count
        return parts


jax.tree_util.register_pytree_node(
    _IO,
    lambda io: ((io.origins,), (io.role, io.counts)),
    lambda aux, children: _IO(aux[0], aux[1], children[0]),
)


class _Taint(NamedTuple):
    """The context of report="reaching".

    - `io`: the origins crossing the boundary of the sub-program being entered
      or left (`_IO`), else `None`.
    - `tick`: the count of equations run so far that could create a NaN/Inf.
    - `pos`: `[0, shard, iteration of each loop...]`, padded with -1 to the
      deepest loop nesting of the program: a new event's `info` is `pos` plus
      its site code.
    - `here`: the current shard's index in the mesh (see `_State.here`).
    - `scope`: static facts about where the current equation is (`_Scope`).
    """

    io: Any
    tick: Any
    pos: Any
    here: Any
    scope: _Scope


def _initial_taint() -> _Taint:
    return _Taint(
        io=_IO("top", (), ()),
        tick=np.int32(0),
        pos=None,
        here=np.int32(0),
        scope=_Scope(),
    )


def _is_float_aval(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _float_origin(aval: Any, origin: Any) -> Any:
    return origin if _is_float_aval(aval) else _DATA


# Whether an output is finite exactly when its inputs are (real dtypes only):
# the origin passes on unchecked.
_TRANSPARENT = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "neg",
        "abs",
        "copy",
        "copy_p",
        "rev",
        "floor",
        "ceil",
        "round",
        "sin",
        "cos",
        "cbrt",
        "concatenate",
        "pvary",
        "pcast",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
    }
)
# Equations that cannot make a NaN/Inf out of finite inputs, but can drop one:
# their output is checked and inherits its inputs' origin. (Not `gather`: out of
# bounds, `mode="fill"` fills with NaN.)
_FILTERS = frozenset(
    {
        "select_n",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "scatter",
        "pad",
        "max",
        "min",
        "reduce_max",
        "reduce_min",
        "cummax",
        "cummin",
        "clamp",
        "tanh",
        "logistic",
        "erf",
        "atan",
        "atan2",
        "sign",
        "real",
        "imag",
        "top_k",
    }
)
# Output j is operand j, reordered or moved.
_PER_OPERAND = frozenset({"sort", "device_put", "optimization_barrier"})
# Collectives: a shard's output depends on other shards' inputs, so the origin
# is the earliest over the shards.
_COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "pbroadcast",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "reduce_scatter",
    }
)


def _all_reduce(op: Callable[..., Any], value: Any) -> Any:
    if value.ndim == 0:
        return value
    return op(value, tuple(range(value.ndim)))


def _finite(value: Any) -> Any:
    """Whether every element of `value` is finite (a traced scalar)."""
    if jnp.issubdtype(value.dtype, jnp.complexfloating):
        value = jnp.stack([jnp.real(value), jnp.imag(value)])
    return _all_reduce(jax.lax.reduce_and, jax.lax.is_finite(value))


def _finite_and_nan(value: Any) -> tuple[Any, Any]:
    """Whether every element of `value` is finite, and whether one is a NaN.

    One pass: a reduction of both flags at once. (Not a `reduce_max` of the
    magnitudes: the maximum of a sharded array is combined across devices by an
    all-reduce that does not propagate NaNs on CPU, JAX 0.10.2.)
    """
    if value.ndim == 0 or jnp.issubdtype(value.dtype, jnp.complexfloating):
        return _finite(value), _all_reduce(jax.lax.reduce_or, jax.lax.ne(value, value))
    finite, nan = jax.lax.reduce(
        (jax.lax.is_finite(value), jax.lax.ne(value, value)),
        (np.bool_(True), np.bool_(False)),
        _and_or,
        tuple(range(value.ndim)),
    )
    return finite, nan


def _and_or(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    return jax.lax.bitwise_and(a[0], b[0]), jax.lax.bitwise_or(a[1], b[1])


def _earliest(origins: list[_Origin]) -> _Origin:
    """The origin with the smallest `w` (the first, on ties)."""
    # Origins made inside an `auto_axes` / `explicit_axes` region are typed for
    # that region's mesh variant.
    origins = to_current_mesh(origins)
    first = origins[0]
    for other in origins[1:]:
        later = jax.lax.lt(other.w, first.w)
        first = _Origin(
            jax.lax.min(first.w, other.w),
            jax.lax.select_n(later, first.info, other.info),
            first.external or other.external,
        )
    return first


def _concrete_finite(value: Any) -> bool:
    """Whether a constant is known (now, while tracing) to be finite."""
    if isinstance(value, Tracer) or not _is_float(value):
        return False
    array = np.asarray(value)
    # Large closed-over arrays are not copied to the host to find out.
    return array.size <= 4096 and bool(np.isfinite(array).all())


class _TaintInterpreter(Interpreter):
    """Keeps the origins of the values of each jaxpr being run (a stack of frames,
    one per nested call), and maps `_IO` onto the jaxpr's inputs and outputs."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        sites: _Sites,
        policy: InterpreterPolicy = InterpreterPolicy.RAISE,
    ) -> None:
        super().__init__(dispatcher, policy=policy, label="find_nans")
        self.sites = sites
        self.frames: list[dict[Any, Any]] = []
        # Per frame: the equations run in it since `tick` was last advanced.
        self.pending: list[int] = []
        # Whether any value met so far is typed for a mesh: only then can origins
        # be typed for different variants of one (see `origins_of`).
        self.has_mesh = False

    def origins_of(self, atoms: Any, eqn: JaxprEqn | None = None) -> list[Any]:
        frame = self.frames[-1]
        # Outputs of an equation run unwatched (an opaque call under
        # policy=IGNORE/WARN) may hold a NaN/Inf of no site, like arguments.
        origins = [
            None if _is_literal(v) else frame[v] if v in frame else _float_origin(v.aval, _EXTERNAL)
            for v in atoms
        ]
        if eqn is None or not self.has_mesh:
            return origins
        # Origins made inside an `auto_axes` / `explicit_axes` region are typed for
        # that region's variant of the mesh; bring them to the one `eqn` runs in.
        return to_current_mesh(origins, eqn)

    def set_origins(self, atoms: Any, origins: Any) -> None:
        self.frames[-1].update(zip(atoms, origins, strict=True))

    def interpret_jaxpr(
        self, jaxpr: Jaxpr, consts: Any, ctx: Any, args: Any
    ) -> tuple[list[Any], Any]:
        if not isinstance(ctx, _Taint) or ctx.scope.passive:
            return super().interpret_jaxpr(jaxpr, consts, ctx, args)
        if not any(_is_float_aval(v.aval) for v in jaxpr.outvars):
            # Nothing it computes can reach a floating output (a while_loop's
            # condition, a function of integers): run it as it is.
            passive = dataclasses.replace(ctx.scope, passive=True)
            outs, out_ctx = super().interpret_jaxpr(
                jaxpr, consts, ctx._replace(scope=passive), args
            )
            return outs, out_ctx._replace(scope=ctx.scope)
        if not self.has_mesh:
            self.has_mesh = not jax.sharding.get_abstract_mesh().empty or any(
                _typed_for_a_mesh(v.aval) for v in (*jaxpr.invars, *jaxpr.outvars)
            )
        io = ctx.io
        origins, ctx = _enter(io, ctx, jaxpr, args)
        frame: dict[Any, Any] = dict.fromkeys(jaxpr.constvars)
        frame.update(zip(jaxpr.invars, origins, strict=True))
        self.frames.append(frame)
        self.pending.append(0)
        try:
            outs, ctx = super().interpret_jaxpr(jaxpr, consts, ctx._replace(io=None), args)
            ctx = _flush(self, ctx)
        finally:
            self.frames.pop()
            self.pending.pop()
        out_origins = [
            None if _is_literal(v) else frame[v] if v in frame else _float_origin(v.aval, _EXTERNAL)
            for v in jaxpr.outvars
        ]
        return outs, ctx._replace(io=_leave(io, ctx, jaxpr, out_origins, outs))


def _typed_for_a_mesh(aval: Any) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty


def _enter(io: _IO, state: _Taint, jaxpr: Jaxpr, args: Any) -> tuple[list[Any], _Taint]:
    """The origins of `jaxpr`'s inputs, from the handler's `io`."""
    avals = [v.aval for v in jaxpr.invars]
    if io.role == "top":
        depth = _loop_depth(jaxpr)
        state = state._replace(pos=np.array([0, 0] + [-1] * depth, np.int32))
        return [_float_origin(a, _EXTERNAL) for a in avals], state
    if io.role == "scan":
        consts, carry, xs, _ = io.groups()
        xs = [_validated(o, x) for o, x in zip(xs, args[len(consts) + len(carry) :], strict=True)]
        return [*consts, *carry, *xs], state
    if io.role == "while":
        consts, carry = io.groups()
        return [*consts, *carry], state
    if io.role == "shard_map":
        origins, split = io.groups()
        here = state.here.reshape((1,))
        state = state._replace(pos=jax.lax.dynamic_update_slice(state.pos, here, (1,)))
        return [
            _validated(o, x) if s else o for o, s, x in zip(origins, split, args, strict=True)
        ], state
    origins = list(io.origins)
    if len(origins) != len(avals):
        # A sub-program that does not take the equation's inputs one to one.
        return [_float_origin(a, _EXTERNAL) for a in avals], state
    return origins, state


def _leave(io: _IO, state: _Taint, jaxpr: Jaxpr, origins: list[Any], outs: Any) -> _IO:
    """The `_IO` that tells the handler the origins of `jaxpr`'s outputs."""
    avals = [v.aval for v in jaxpr.outvars]
    if io.role == "scan":
        consts, carry, xs, ys = io.groups()
        num_carry = len(carry)
        length = state.pos.shape[0]
        carry_out = [
            _as_slot(o, a, length) for o, a in zip(origins[:num_carry], avals, strict=False)
        ]
        merged = [
            _merged_slot(acc, o, a, length)
            for acc, o, a in zip(ys, origins[num_carry:], avals[num_carry:], strict=True)
        ]
        return _IO("scan", io.counts, (*consts, *carry_out, *xs, *merged))
    if io.role == "while":
        consts, carry = io.groups()
        length = state.pos.shape[0]
        carry_out = [_as_slot(o, a, length) for o, a in zip(origins, avals, strict=True)]
        return _IO("while", io.counts, (*consts, *carry_out))
    if io.role == "cond":
        length = state.pos.shape[0]
        return _IO(
            "out", (), tuple(_as_slot(o, a, length) for o, a in zip(origins, avals, strict=True))
        )
    return _IO("out", (), tuple(origins))


def _validated(origin: Any, value: Any) -> Any:
    """The origin of a part (a scan's slice, a shard's block) of a value of
    `origin`: the part may be finite."""
    if not isinstance(origin, _Origin):
        return origin
    return _Origin(jax.lax.select_n(_finite(value), origin.w, _FINE), origin.info, origin.external)


def _as_slot(origin: Any, aval: Any, length: int) -> Any:
    """`origin` as a loop carry or a branch output: traced, and `external`, so that
    every iteration and every branch give the same structure."""
    if not _is_float_aval(aval):
        return _DATA
    if isinstance(origin, _Origin):
        return _Origin(origin.w, origin.info, True)
    w = _FINE if origin is _FINITE else _UNKNOWN
    return _Origin(w, np.zeros((length,), np.int32), True)


def _merged_slot(acc: Any, origin: Any, aval: Any, length: int) -> Any:
    """A scan's stacked output: the earliest origin over the iterations so far."""
    if not _is_float_aval(aval):
        return _DATA
    return _earliest([acc, _as_slot(origin, aval, length)])


def _code_vectors(site: int, pos: Any) -> tuple[Any, Any]:
    """`info` of a new event of `site` without and with a NaN, before `pos`."""
    length = pos.shape[0]
    inf, nan = np.zeros(length, np.int32), np.zeros(length, np.int32)
    inf[0], nan[0] = 2 * site, 2 * site + 1
    if not isinstance(pos, (jax.Array, Tracer)):
        return inf + pos, nan + pos
    return inf, nan


def _new_info(site: int, pos: Any, has_nan: Any) -> Any:
    inf, nan = _code_vectors(site, pos)
    code = jax.lax.select_n(has_nan, inf, nan)
    if isinstance(pos, (jax.Array, Tracer)):
        code = jax.lax.add(pos, code)
    return code


def _scale(value: Any) -> float | None:
    """The magnitude of a concrete real scalar, else `None`."""
    if isinstance(value, Tracer) or np.ndim(value) != 0 or not _is_float(value):
        return None
    if jnp.issubdtype(jnp.result_type(value), jnp.complexfloating):
        return None
    magnitude = abs(float(value))
    return magnitude if np.isfinite(magnitude) else None


def _class_of(eqn: JaxprEqn, invals: list[Any], outval: Any) -> str:
    name = eqn.primitive.name
    if any(_is_float_aval(v.aval) and 0 in _shape(v) for v in eqn.invars):
        return "create"  # a reduction of nothing: `max` of no elements is -inf
    complex_out = jnp.issubdtype(outval.dtype, jnp.complexfloating)
    if name in _TRANSPARENT and not complex_out:
        return "transparent"
    # A multiplication by a constant of at most 1 in magnitude (a learning rate),
    # or a division by one of at least 1 (a mean), cannot overflow; a NaN or Inf
    # stays one (inf * 0 is NaN).
    scales = [_scale(value) for value in invals]
    real_pair = not complex_out and len(invals) == 2
    if name == "mul" and real_pair and any(s is not None and s <= 1.0 for s in scales):
        return "transparent"
    if name == "div" and real_pair and scales[1] is not None and scales[1] >= 1.0:
        return "transparent"
    if name == "convert_element_type":
        source = getattr(eqn.invars[0].aval, "dtype", None)
        target = outval.dtype
        if (
            source is not None
            and jnp.issubdtype(source, jnp.floating)
            and jnp.issubdtype(target, jnp.floating)
            and jnp.finfo(target).max >= jnp.finfo(source).max
        ):
            return "transparent"
    if name in _FILTERS:
        return "filter"
    return "create"


def _taint_equation(
    sites: _Sites, interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    """The fallback handler of report="reaching": re-binds the equation and gives
    each output its origin."""
    outvals = default_primitive_handler(interpreter, state, eqn, invals).outvals
    if state.scope.passive:
        return HandlerResult(state, outvals)
    origins = interpreter.origins_of(eqn.invars, eqn)
    if all(o is None for o in origins):
        interpreter.set_origins(eqn.outvars, [None] * len(eqn.outvars))
        return HandlerResult(state, outvals)
    pending = interpreter.pending[-1]
    created, out_origins = _propagate(sites, state, eqn, invals, origins, outvals, pending)
    interpreter.pending[-1] = pending + created
    interpreter.set_origins(eqn.outvars, out_origins)
    return HandlerResult(state, outvals)


def _propagate(
    sites: _Sites,
    state: _Taint,
    eqn: JaxprEqn,
    invals: list[Any],
    origins: list[Any],
    outvals: list[Any],
    pending: int,
) -> tuple[bool, list[Any]]:
    """Whether `eqn` can make a NaN/Inf, and the origins of its outputs; its
    events are stamped `tick + pending`."""
    name = eqn.primitive.name
    now = None
    floats_in = [i for i, value in enumerate(invals) if _is_float(value)]
    out_origins: list[Any] = []
    site: int | None = None
    collective = name in _COLLECTIVES and bool(state.scope.manual_axes)
    across: dict[tuple[int, ...], Any] = {}
    for j, outval in enumerate(outvals):
        if not _is_float(outval):
            out_origins.append(_DATA)
            continue
        if np.size(outval) == 0:
            out_origins.append(_FINITE)
            continue
        inputs = [j] if name in _PER_OPERAND else floats_in
        traced = [origins[i] for i in inputs if isinstance(origins[i], _Origin)]
        unknown = any(
            origins[i] is _EXTERNAL
            or (isinstance(origins[i], _Origin) and origins[i].external)
            or (origins[i] is None and not _concrete_finite(invals[i]))
            for i in inputs
        )
        kind = "create" if collective else _class_of(eqn, invals, outval)
        if kind != "create" and not unknown:
            if not traced:
                out_origins.append(_FINITE)
                continue
            inherited = _earliest(traced)
            if kind == "filter":
                w = jax.lax.select_n(_finite(outval), inherited.w, _FINE)
                inherited = _Origin(w, inherited.info, False)
            out_origins.append(inherited)
            continue
        # It may create a NaN/Inf here.
        if site is None:
            site = sites.add_at(eqn, state.scope.loop_depth, state.scope)
        inherited = _earliest(traced) if traced else None
        if collective:
            key = tuple(inputs)
            if key not in across:
                across[key] = _across_shards(state, inherited, eqn.params)
            inherited = across[key]
        fine, has_nan = _finite_and_nan(outval)
        info = _new_info(site, state.pos, has_nan)
        if now is None:
            now = _plus(state.tick, pending)
        if inherited is None:
            w = jax.lax.select_n(fine, jnp.asarray(now, jnp.int32), _FINE)
        else:
            w = jax.lax.select_n(fine, jax.lax.min(inherited.w, now), _FINE)
            info = jax.lax.select_n(jax.lax.lt(inherited.w, now), info, inherited.info)
        out_origins.append(_Origin(w, info, False))
    return site is not None, out_origins


# `tick` stops growing here (ordering events made after 2**30 others, per shard,
# by their site instead), so that `tick` plus the equations of one jaxpr stays
# below the reserved values.
_TICK_LIMIT = 2**30


def _plus(tick: Any, count: int) -> Any:
    if count == 0:
        return tick
    if isinstance(tick, (jax.Array, Tracer)):
        return jax.lax.add(tick, np.int32(count))
    return np.int32(int(tick) + count)


def _flush(interpreter: Any, state: _Taint) -> _Taint:
    """`state` with `tick` advanced past the events of the jaxpr being run so far.

    Within one run of a jaxpr, the equations that can make a NaN/Inf stamp their
    events `tick + j` (the j-th of them): one addition, no update of `tick`.
    """
    count = interpreter.pending[-1]
    if count == 0:
        return state
    interpreter.pending[-1] = 0
    tick = state.tick
    if isinstance(tick, (jax.Array, Tracer)):
        tick = jax.lax.min(tick, np.int32(_TICK_LIMIT))
    else:
        tick = np.int32(min(int(tick), _TICK_LIMIT))
    return state._replace(tick=_plus(tick, count))


def _collective_axes(params: Any) -> tuple[Any, ...]:
    axes = params.get("axes", params.get("axis_name", ()))
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    return tuple(a for a in axes if not isinstance(a, int))


def _across_shards(state: _Taint, origin: _Origin | None, params: Any) -> _Origin:
    """The earliest of the shards' `origin`s over the collective's axes (the first
    shard in mesh order on ties): every shard's output may hold any shard's NaN."""
    if origin is None:
        origin = _Origin(_FINE, np.zeros(state.pos.shape[0], np.int32), False)
    return _earliest_over(state.here.reshape(()), origin, _collective_axes(params))


def _earliest_over(own: Any, origin: _Origin, axes: tuple[Any, ...]) -> _Origin:
    """The earliest of the shards' `origin`s over `axes`, the same on every shard;
    `own` is the shard's index in the mesh (the first shard wins ties)."""
    # `where` on the shard index makes the values varying, as the collectives need.
    varying = own >= 0
    w = jnp.where(varying, origin.w, _FINE)
    first = _all_axes(jax.lax.pmin, w, axes)
    candidate = jnp.where(w == first, own, _NO_SHARD)
    chosen = own == _all_axes(jax.lax.pmin, candidate, axes)
    info = _all_axes(jax.lax.psum, jnp.where(chosen, origin.info, 0), axes)
    return _Origin(first, info, origin.external)


def _taint_call(
    interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any], handler: Handler
) -> HandlerResult:
    """A call (`jit`, `checkpoint`, custom derivatives, ...): the body takes the
    equation's inputs one to one."""
    state = _flush(interpreter, state)
    origins = interpreter.origins_of(eqn.invars, eqn)
    result = handler(interpreter, state._replace(io=_IO("call", (), tuple(origins))), eqn, invals)
    return _left(interpreter, state, eqn, result)


def _left(interpreter: Any, state: _Taint, eqn: JaxprEqn, result: HandlerResult) -> HandlerResult:
    """Sets the origins of `eqn`'s outputs from the `_IO` the body left in the
    context, and puts back the position and scope of `state`."""
    io = result.ctx.io
    avals = [v.aval for v in eqn.outvars]
    if isinstance(io, _IO) and io.role == "out" and len(io.origins) == len(avals):
        origins = [_float_origin(a, o) for a, o in zip(avals, io.origins, strict=True)]
    else:
        # The body was run passively (no floating output) or not at all.
        origins = [_float_origin(a, _EXTERNAL) for a in avals]
    interpreter.set_origins(eqn.outvars, origins)
    ctx = result.ctx._replace(io=None, pos=state.pos, here=state.here, scope=state.scope)
    return HandlerResult(ctx, result.outvals)


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _scan_layout(eqn: JaxprEqn) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a scan, from the shapes alone (a carry and a
    const have the same shape outside and inside the body; an `xs` or a `ys`
    gains the leading `length` axis)."""
    body = eqn.params["jaxpr"]
    body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
    num_carry = 0
    for outer, inner in zip(eqn.outvars, body.outvars, strict=True):
        if _shape(outer) != _shape(inner):
            break
        num_carry += 1
    num_unstacked = 0
    for outer, inner in zip(eqn.invars, body.invars, strict=True):
        if _shape(outer) != _shape(inner):
            break
        num_unstacked += 1
    return num_unstacked - num_carry, num_carry


def _advance(slot: int, carried: _Taint, new: _Taint) -> _Taint:
    """The loop updater: the loop's iteration counter in `pos` advances."""
    del carried
    step = np.zeros(new.pos.shape, np.int32)
    step[slot] = 1
    return new._replace(pos=new.pos + step)


def _taint_loop(
    loop_handler: Callable[..., HandlerResult],
    interpreter: Any,
    state: _Taint,
    eqn: JaxprEqn,
    invals: list[Any],
) -> HandlerResult:
    """`scan` and `while`: carries get traced origins; the loop's counter is the
    next slot of `pos` (-1 outside, so one step starts it at 0)."""
    if state.scope.passive:
        return loop_handler(interpreter, state, eqn, invals)
    state = _flush(interpreter, state)
    origins = interpreter.origins_of(eqn.invars, eqn)
    in_avals = [v.aval for v in eqn.invars]
    length = state.pos.shape[0]
    if eqn.primitive.name == "scan":
        num_consts, num_carry = _scan_layout(eqn)
        consts = origins[:num_consts]
        carry = [
            _as_slot(o, a, length)
            for o, a in zip(
                origins[num_consts : num_consts + num_carry],
                in_avals[num_consts : num_consts + num_carry],
                strict=True,
            )
        ]
        xs = origins[num_consts + num_carry :]
        ys = [_as_slot(_FINITE, v.aval, length) for v in eqn.outvars[num_carry:]]
        io = _IO("scan", (len(consts), len(carry), len(xs), len(ys)), (*consts, *carry, *xs, *ys))
    else:
        body = eqn.params["body_jaxpr"]
        body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
        num_carry = len(body.outvars)
        num_body_consts = len(body.invars) - num_carry
        start = len(eqn.invars) - num_carry - num_body_consts
        consts = origins[start : start + num_body_consts]
        carry = [
            _as_slot(o, a, length)
            for o, a in zip(
                origins[start + num_body_consts :],
                in_avals[start + num_body_consts :],
                strict=True,
            )
        ]
        io = _IO("while", (len(consts), len(carry)), (*consts, *carry))
    depth = state.scope.loop_depth
    slot = 2 + depth
    step = np.zeros(state.pos.shape, np.int32)
    step[slot] = 1
    inner = state._replace(
        io=io,
        pos=state.pos + step,
        scope=dataclasses.replace(state.scope, loop_depth=depth + 1),
    )
    result = loop_handler(
        interpreter, inner, eqn, invals, updater=functools.partial(_advance, slot)
    )
    io = result.ctx.io
    if isinstance(io, _IO) and io.role in ("scan", "while"):
        if io.role == "scan":
            _, carry, _, ys = io.groups()
            io = _IO("out", (), (*carry, *ys))
        else:
            _, carry = io.groups()
            io = _IO("out", (), tuple(carry))
        result = HandlerResult(result.ctx._replace(io=io), result.outvals)
    return _left(interpreter, state, eqn, result)


def _taint_cond(interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any]) -> HandlerResult:
    if state.scope.passive:
        return default_cond_handler(interpreter, state, eqn, invals)
    state = _flush(interpreter, state)
    origins = interpreter.origins_of(eqn.invars[1:], eqn)
    inner = state._replace(io=_IO("cond", (), tuple(origins)))
    return _left(interpreter, state, eqn, default_cond_handler(interpreter, inner, eqn, invals))


@functools.lru_cache(maxsize=64)
def _earliest_shard(manual: tuple[Any, ...]) -> Callable[[_Taint], _Taint]:
    """`reduce_ctx`: each output's earliest origin over the shards (the first shard
    in mesh order on ties); the clock goes on from the shard that ran the most."""

    def reduce_ctx(state: _Taint) -> _Taint:
        own = state.here.reshape(())
        varying = own >= 0

        def reduce(origin: Any) -> Any:
            if not isinstance(origin, _Origin):
                return origin
            return _earliest_over(own, origin, manual)

        io = state.io
        io = _IO(io.role, io.counts, tuple(reduce(o) for o in io.origins))
        return state._replace(
            io=io,
            tick=_all_axes(jax.lax.pmax, jnp.where(varying, state.tick, 0), manual),
            pos=np.zeros(state.pos.shape, np.int32),
            here=jnp.zeros(state.here.shape, jnp.int32),
        )

    return reduce_ctx


def _taint_shard_map(
    interpreter: Any, state: _Taint, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    if state.scope.passive:
        return default_shard_map_handler(interpreter, state, eqn, invals)
    state = _flush(interpreter, state)
    mesh, manual_set = shard_map_axes(eqn)
    sizes = dict(mesh.shape)
    mesh_axes = tuple((name, sizes[name]) for name in mesh.axis_names)
    manual = tuple(name for name in mesh.axis_names if name in manual_set)
    names = {name for name, _ in state.scope.manual_axes} | set(manual)
    scope_axes = tuple((name, size) for name, size in mesh_axes if name in names)
    origins = interpreter.origins_of(eqn.invars, eqn)
    split = tuple(bool(_spec_names(spec) & set(manual)) for spec in eqn.params["in_specs"])
    inner = state._replace(
        io=_IO("shard_map", (len(origins), len(split)), (*origins, *[_Flag(s) for s in split])),
        here=_shard_indices(state.here, mesh_axes, manual),
        scope=dataclasses.replace(state.scope, manual_axes=scope_axes, mesh_axes=mesh_axes),
    )

    def ctx_in_specs(tree: _Taint) -> _Taint:
        return jax.tree.map(lambda _: P(), tree)._replace(here=P(*manual))

    result = default_shard_map_handler(
        interpreter,
        inner,
        eqn,
        invals,
        declare_ctx_in_specs=ctx_in_specs,
        reduce_ctx=_earliest_shard(manual),
    )
    return _left(interpreter, state, eqn, result)


class _Flag:
    """A static boolean inside `_IO` (a Python bool would be a traced leaf)."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __bool__(self) -> bool:
        return self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Flag) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def _spec_names(spec: Any) -> set[Any]:
    names: set[Any] = set()
    for entry in spec if spec is not None else ():
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def _taint_dispatcher(sites: _Sites) -> Dispatcher:
    dispatcher = default_dispatcher()
    for name, handler in list(dispatcher.handlers.items()):
        if name in ("scan", "while", "cond", "shard_map", "custom_linear_solve"):
            continue
        dispatcher.register_handler(name, functools.partial(_call_with, handler))
    dispatcher = (
        dispatcher.register_handler("scan", functools.partial(_taint_loop, default_scan_handler))
        .register_handler("while", functools.partial(_taint_loop, default_while_handler))
        .register_handler("cond", _taint_cond)
        .register_handler("shard_map", _taint_shard_map)
        # The solve is an equation like any other here: re-bound as it is, its
        # outputs checked (origins are not followed through the solver).
        .register_handler("custom_linear_solve", functools.partial(_taint_equation, sites))
        .register_fallback_handler(functools.partial(_taint_equation, sites))
    )
    for name, handler in dispatcher.handlers.items():
        dispatcher.register_handler(name, _located(sites, handler))
    return dispatcher


def _call_with(
    handler: Handler, interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult:
    if state.scope.passive:
        return handler(interpreter, state, eqn, invals)
    return _taint_call(interpreter, state, eqn, invals, handler)


def _reaching_report(state: _Taint, sites: _Sites) -> NanReport:
    """The report of the earliest origin among the outputs'."""
    origins = [o for o in state.io.origins if isinstance(o, _Origin)]
    if not origins:
        nothing = jnp.int32(-1)
        depth = 0 if state.pos is None else state.pos.shape[0] - 2
        iterations = jnp.full((depth,), -1, jnp.int32)
        return NanReport(nothing, jnp.bool_(False), nothing, iterations, tuple(sites.sites))
    first = _earliest(origins)
    found = first.w < _UNKNOWN
    code = first.info[0]
    site = jnp.where(found, code // 2, -1)
    if isinstance(first.info, Tracer):
        iterations = first.info[2:]
    else:
        # Eagerly, JAX 0.10.2 cannot slice an array typed for a mesh down to zero
        # entries outside `jax.set_mesh`; on the host it is a plain copy.
        iterations = jnp.asarray(np.asarray(first.info)[2:])
    return NanReport(site, found & (code % 2 == 1), first.info[1], iterations, tuple(sites.sites))


# ---------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------


class NanReport:
    """Where a program made the NaN or Inf that `find_nans` reports: with
    `report="reaching"` the first one that reaches an output, with
    `report="first"` the first one made anywhere.

    `find_nans` returns one. It is a pytree, so a `find_nans` function can be
    jitted and its report returned; read its properties on concrete values,
    outside the jit. It prints as one line in a terminal and as a table in a
    notebook.

    **Properties:**

    - `found`: whether an equation made a NaN or an Inf (that reaches an output,
      for `"reaching"`); a traced boolean inside `jax.jit`, the only property
      that can be read there.
    - `primitive`: the name of that equation's primitive, or `None`.
    - `source`: `"file.py:LINE"` of the user's code that produced it, or `None`.
      When JAX kept no user frame for the equation (a `jnp` function passed as
      it is, as in `lax.cond(p, jnp.log, ...)`), the line of the innermost
      control-flow call around it.
    - `path`: the full path of the file of `source`, or `None`.
    - `kind`: `"nan"` or `"inf"`: what that equation made (`"nan"` if its
      outputs hold both), even if it became a NaN later (`inf - inf`); or `None`.
    - `iterations`: the iteration (0-based, in execution order, also for
      `reverse=True`) of each `scan`, `fori_loop` or `while_loop` around it,
      outermost first; `()` outside loops. An equation of a `while_loop`'s
      condition reports the iteration that it follows (its first evaluation,
      before any iteration, reports 0 too).
    - `iteration`: the innermost of `iterations`, or `None`.
    - `shard`: `{axis: coordinate}` over the manual mesh axes of the
      `shard_map`s around it: the shard that made it (among shards that made
      theirs at the same point, counted in equations run, the first in mesh
      order; a NaN that a collective spreads is reported on the shard that made
      it); `None` outside `shard_map`.

    Values computed from constants alone (literals, closed-over arrays, and what
    is computed from them, such as the NaN `jnp.var` builds for an empty reduction
    and selects away) are not checked: such a NaN belongs to the program, and the
    first equation that combines it with data is reported instead.

    Under `jax.vmap` every property has a batch axis; read one element with
    `jax.tree.map(lambda leaf: leaf[i], report)`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    from kups.debug import find_nans


    def f(xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sqrt(x), None), 0.0, xs)[0]


    _, report = jax.jit(find_nans(f))(jnp.array([4.0, 1.0, -1.0, 9.0]))
    assert (report.primitive, report.kind, report.iteration) == ("sqrt", "nan", 2)
    print(report)  # NanReport(found=True, kind=nan, primitive=sqrt, source=..., iteration=2)
    ```
    """

    def __init__(
        self, site: Any, nan: Any, shard: Any, iterations: Any, sites: tuple[_Site, ...]
    ) -> None:
        self._site = site
        self._nan = nan
        self._shard = shard
        self._iterations = iterations
        self._sites = sites

    def _concrete_site(self, what: str) -> _Site | None:
        if isinstance(self._site, Tracer):
            raise TypeError(
                f"NanReport.{what} needs concrete values, but this report holds traced "
                f"ones (it is used inside jax.jit or another transformation). Return the "
                f"report from the jitted function and read {what} outside."
            )
        if np.ndim(self._site) != 0:
            raise TypeError(
                f"NanReport.{what} is for one report, but this one is batched (shape "
                f"{np.shape(self._site)}, as jax.vmap returns it). Read element i with "
                f"jax.tree.map(lambda leaf: leaf[i], report).{what}."
            )
        index = int(self._site)
        return self._sites[index] if index >= 0 else None

    @property
    def found(self) -> Any:
        if isinstance(self._site, Tracer) or np.ndim(self._site) != 0:
            return self._site >= 0
        return int(self._site) >= 0

    @property
    def primitive(self) -> str | None:
        site = self._concrete_site("primitive")
        return site.primitive if site is not None else None

    @property
    def source(self) -> str | None:
        site = self._concrete_site("source")
        if site is None or site.file is None:
            return None
        return f"{os.path.basename(site.file)}:{site.line}"

    @property
    def path(self) -> str | None:
        """The full path of the file of `source`, or `None`."""
        site = self._concrete_site("path")
        return site.file if site is not None else None

    @property
    def kind(self) -> str | None:
        site = self._concrete_site("kind")
        if site is None:
            return None
        return "nan" if bool(self._nan) else "inf"

    @property
    def iterations(self) -> tuple[int, ...]:
        site = self._concrete_site("iterations")
        if site is None:
            return ()
        return tuple(int(i) for i in self._iterations[: site.loop_depth])

    @property
    def iteration(self) -> int | None:
        iterations = self.iterations
        return iterations[-1] if iterations else None

    @property
    def shard(self) -> dict[Any, int] | None:
        site = self._concrete_site("shard")
        if site is None or not site.manual_axes:
            return None
        index = int(self._shard)
        coordinates: dict[Any, int] = {}
        for name, size in reversed(site.mesh_axes):
            index, coordinates[name] = divmod(index, size)
        return {name: coordinates[name] for name, _ in site.manual_axes}

    def _fields(self) -> list[tuple[str, str]]:
        if not self.found:
            return [("found", "False")]
        fields = [
            ("found", "True"),
            ("kind", str(self.kind)),
            ("primitive", str(self.primitive)),
            ("source", str(self.source)),
        ]
        if self.iterations:
            iterations = self.iterations
            fields.append(
                ("iteration", str(iterations[0]) if len(iterations) == 1 else str(iterations))
            )
        shard = self.shard
        if shard is not None:
            fields.append(("shard", ", ".join(f"{name}={i}" for name, i in shard.items())))
        return fields

    def _opaque(self) -> str | None:
        """What this report holds when it cannot be read: traced or batched values."""
        if isinstance(self._site, Tracer):
            return "<traced>"
        if np.ndim(self._site) != 0:
            return f"<batched, shape {np.shape(self._site)}>"
        return None

    def __repr__(self) -> str:
        opaque = self._opaque()
        if opaque is not None:
            return f"NanReport({opaque})"
        return "NanReport(" + ", ".join(f"{k}={v}" for k, v in self._fields()) + ")"

    def _repr_html_(self) -> str:
        opaque = self._opaque()
        if opaque is not None:
            return f"<code>NanReport({html.escape(opaque)})</code>"
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
            for k, v in self._fields()
        )
        return f"<table><caption>NanReport</caption>{rows}</table>"


def _flatten_report(report: NanReport) -> tuple[tuple[Any, ...], tuple[_Site, ...]]:
    return (report._site, report._nan, report._shard, report._iterations), report._sites


def _unflatten_report(sites: tuple[_Site, ...], children: Any) -> NanReport:
    site, nan, shard, iterations = children
    return NanReport(site, nan, shard, iterations, sites)


jax.tree_util.register_pytree_node(NanReport, _flatten_report, _unflatten_report)


def find_nans(
    fn: Callable[..., Any],
    *,
    report: str = "reaching",
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

    check_policy(policy, "find_nans(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, NanReport]:
        sites = _Sites()
        if report == "first":
            interpreter = _FramingInterpreter(_dispatcher(sites), policy=policy, label="find_nans")
            interpreter.policy_hint = "find_nans(fn, policy=...)"
            out, state = reinterpret(fn, interpreter)(_initial_state(), *args, **kwargs)
            found = NanReport(
                state.site, state.nan, state.shard, state.iterations, tuple(sites.sites)
            )
            return out, found
        taint = _TaintInterpreter(_taint_dispatcher(sites), sites, policy)
        taint.policy_hint = "find_nans(fn, policy=...)"
        out, final = reinterpret(fn, taint)(_initial_taint(), *args, **kwargs)
        return out, _reaching_report(final, sites)

    return wrapped
