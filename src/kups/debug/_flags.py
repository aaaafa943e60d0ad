"""Whether values hold a NaN or an Inf: the flags of a check (`_flags`), and,
for a recorder that counts only what an equation made itself, whether an
equation's inputs already held one (`_inherited`), known from the checks that
made them, from the inputs of an equation that only moves their elements
(`_passes_through`), carried by a `scan` or a `while` loop and passed into calls
(`_held_through`)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from kups.effects import CALL_PRIMITIVES, HandlerResult, reduce_shards, to_current_mesh

from ._constants import _constant_equations, _is_literal, known_finite
from ._sites import (
    _is_float,
    _is_float_aval,
    collective_axes,
    gathers_only,
    keeps_elements,
    scan_layout,
    widening_cast,
)
from ._taint_tables import _COLLECTIVE_MOVES, _COLLECTIVES, _MOVES, _MOVING_FILTERS, _SLICES


class _Check(NamedTuple):
    """A check of `site` that found `flags` (kind to traced bool). For a recorder
    that counts only what an equation made itself, `inherited` says whether each
    input that may hold a watched NaN/Inf did (traced bools): if one did, the
    check counts nothing."""

    site: int
    flags: dict[str, Any]
    inherited: tuple[Any, ...] = ()


class _Carried:
    """For a recorder that counts only what an equation made itself: whether each
    input of a sub-program from `offset` on held a watched NaN/Inf (a traced
    bool, or `None`), so that the sub-program does not reduce it again. For a
    loop (`loop`) they are its carries, and the body gives them back for its
    carry outputs (the loop carries them); for a call, the body gives back the
    flags it knows of its outputs, and the `checks` it made that are not yet in
    the record (the caller records them with its own).

    A `while` loop runs its condition too with them: `body` is then the loop's
    body, the one jaxpr that gives them back; the condition's last inputs are
    the carries, and it leaves the flags as they are. A `cond`'s branch takes
    its operands' flags and gives nothing back (`back`): each branch would give
    its own."""

    def __init__(
        self,
        offset: int,
        flags: tuple[Any, ...],
        loop: bool = True,
        checks: tuple[_Check, ...] = (),
        body: Any = None,
        back: bool = True,
    ) -> None:
        self.offset = offset
        self.flags = flags
        self.loop = loop
        self.checks = checks
        self.body = body
        self.back = back

    def start(self, jaxpr: Any) -> int:
        """The index of `jaxpr`'s first input that `flags` describe."""
        if self.body is None or self.body is jaxpr:
            return self.offset
        return len(jaxpr.invars) - len(self.flags)

    def gives_back(self, jaxpr: Any) -> bool:
        """Whether `jaxpr`'s outputs are the carries the flags describe (a loop's
        body), rather than a condition's predicate."""
        return self.loop and (self.body is None or self.body is jaxpr)


jax.tree_util.register_pytree_node(
    _Carried,
    lambda c: (
        (c.flags, tuple((check.flags, check.inherited) for check in c.checks)),
        (c.offset, c.loop, tuple(check.site for check in c.checks), c.body, c.back),
    ),
    lambda aux, children: _Carried(
        aux[0],
        tuple(children[0]),
        aux[1],
        tuple(
            _Check(site, flags, tuple(inherited))
            for site, (flags, inherited) in zip(aux[2], children[1], strict=True)
        ),
        aux[3],
        aux[4],
    ),
)


def _or(a: Any, b: Any) -> Any:
    return jax.lax.bitwise_or(a, b)


def _flags(
    values: list[Any], kinds: tuple[str, ...], exact: bool = True, either: bool = False
) -> tuple[dict[str, Any], Any]:
    """Whether any element of `values` is a NaN / an Inf, for each of `kinds`, and
    (if `either`, else `None`) whether any is of a watched kind: one reduction of
    all the flags at once per value. Not `exact`, the flag of "inf" says whether
    any element is not finite (one operation less per element), when "nan" is
    watched too (its own flag tells the NaNs apart)."""
    found: dict[str, Any] = {}
    held = None
    for value in values:
        real = not jnp.issubdtype(value.dtype, jnp.complexfloating)
        finite = not exact and real and "inf" in kinds and "nan" in kinds
        masks, inits, combine = [], [], []
        for kind in kinds:
            if kind == "inf" and finite:
                masks.append(jax.lax.is_finite(value))
                inits.append(np.bool_(True))
                combine.append(jax.lax.bitwise_and)
            else:
                masks.append(_is_nan(value) if kind == "nan" else _is_inf(value))
                inits.append(np.bool_(False))
                combine.append(_or)
        # Exact flags of both kinds: whether either is held is a third output of
        # the same reduction (an `or` of the two would be a kernel of its own).
        third = either and exact and len(kinds) == 2
        if third:
            masks.append(jax.lax.bitwise_not(jax.lax.is_finite(value)) if real else _or(*masks))
            inits.append(np.bool_(False))
            combine.append(_or)
        if value.ndim == 0:
            flags = masks
        else:
            flags = jax.lax.reduce(
                tuple(masks),
                tuple(inits),
                lambda a, b, combine=tuple(combine): tuple(
                    op(x, y) for op, x, y in zip(combine, a, b, strict=True)
                ),
                tuple(range(value.ndim)),
            )
        flags = list(flags)
        if finite:
            flags[kinds.index("inf")] = jax.lax.bitwise_not(flags[kinds.index("inf")])
        for kind, flag in zip(kinds, flags, strict=False):
            found[kind] = _or(found[kind], flag) if kind in found else flag
        if either:
            flag = flags[-1] if third else functools.reduce(_or, flags)
            held = flag if held is None else _or(held, flag)
    return found, held


def _is_nan(value: Any) -> Any:
    return jax.lax.ne(value, value)


def _is_inf(value: Any) -> Any:
    magnitude = jax.lax.abs(value)
    return jax.lax.eq(magnitude, np.array(np.inf, magnitude.dtype))


# Primitives whose output holds the elements of their inputs, each unchanged or
# negated, and all of them (`broadcast_in_dim` may repeat them): it holds a
# NaN/Inf exactly when an input does, so the equation never makes one.
_MOVES_ELEMENTS = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "tile",
        "transpose",
        "squeeze",
        "expand_dims",
        "rev",
        "copy",
        "copy_p",
        "neg",
        "conj",
        "concatenate",
    }
)


class _Same:
    """The flag of a value that holds a NaN/Inf exactly when one of `inputs`
    (`(var, value)` pairs) does: found from theirs when first needed."""

    def __init__(self, inputs: tuple[tuple[Any, Any], ...]) -> None:
        self.inputs = inputs


def _passes_through(interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]) -> bool:
    """For a recorder that counts only what an equation made itself: whether
    `eqn` only moves the elements of inputs that are not constants (it then makes
    no NaN/Inf, and is not checked); its outputs then hold one exactly when an
    input does, which is noted for the equations they feed."""
    name = eqn.primitive.name
    if not (name in _MOVES_ELEMENTS or widening_cast(eqn) or (name == "abs" and _real(invals))):
        return False
    if _reads_constants(state, eqn):
        return False  # a constant NaN/Inf combined with data is made here
    same = _Same(tuple((v, x) for v, x in zip(eqn.invars, invals, strict=True) if _is_float(x)))
    interpreter.held[-1].update(dict.fromkeys(eqn.outvars, same))
    return True


def _moves_data(state: Any, eqn: JaxprEqn) -> bool:
    """Whether `eqn` only moves values that are not constants (or casts them to a
    float dtype that holds them), within the shard or between shards. It is not
    checked: a NaN/Inf that an argument held is first seen at the equation that
    computes with it, and one made in the program was found where it was made."""
    name = eqn.primitive.name
    moves = (
        name in _MOVES
        or name in _SLICES
        or name in _COLLECTIVE_MOVES
        or widening_cast(eqn)
        or keeps_elements(eqn)
        or gathers_only(eqn)
        # Inside a loop, an overwrite or a `where` may be where a constant NaN/Inf
        # that the loop carries (not a constant in its body) first meets data.
        or (name in _MOVING_FILTERS and state.position.depth == 0)
    )
    return moves and not _reads_constants(state, eqn)


def _across_collective(eqn: JaxprEqn, flags: tuple[Any, ...]) -> tuple[Any, ...]:
    """`flags` (whether each input held a NaN/Inf, on this shard) of a collective
    that computes over shards (`psum`, `pmax`), held by any shard of its axes: its
    output may hold the NaN/Inf of another shard's input."""
    if eqn.primitive.name not in _COLLECTIVES:
        return flags
    axes = collective_axes(eqn.params)
    return tuple(reduce_shards(jnp.asarray(flag, jnp.int32), axes, op="max") > 0 for flag in flags)


def _is_constant_var(state: Any, var: Any) -> bool:
    """Whether `var`, of the jaxpr being run, is a literal or a constant of the
    program."""
    if _is_literal(var):
        return True
    frame = state.scope.frame
    return frame is not None and var in _constant_equations(frame.jaxpr, frame.constant_inputs)[1]


def _reads_constants(state: Any, eqn: JaxprEqn) -> bool:
    """Whether a float input of `eqn` is a literal or a constant of the program
    that may hold a NaN/Inf (not an index, nor a `0.0` broadcast to an array)."""
    return any(
        _is_float_aval(var.aval)
        and _is_constant_var(state, var)
        and not known_finite(state.scope.frame, var)
        for var in eqn.invars
    )


def _real(values: list[Any]) -> bool:
    return all(not jnp.issubdtype(v.dtype, jnp.complexfloating) for v in values if _is_float(v))


def _known(held: dict[Any, Any], var: Any) -> Any:
    """The flag of `var` if known without reducing a value, else `None`."""
    flag = None if _is_literal(var) else held.get(var)
    if isinstance(flag, _Same):
        flags = [_known(held, input_var) for input_var, _ in flag.inputs]
        if any(f is None for f in flags):
            return None
        flag = held[var] = functools.reduce(_or, flags)
    return flag


def _inherited(
    interpreter: Any,
    state: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    held_here: Any,
    kinds: tuple[str, ...],
) -> tuple[Any, ...]:
    """Whether each input of `eqn` that may hold a watched NaN/Inf did (judged per
    array): if one did, `eqn` made none itself. A constant input does not count:
    the equation that first combines a constant NaN with data made it.
    `held_here` (whether `eqn`'s outputs hold one) is kept for the equations
    they feed."""
    held = interpreter.held[-1]
    held.update(dict.fromkeys(eqn.outvars, held_here))
    frame = state.scope.frame
    constants = _constant_equations(frame.jaxpr, frame.constant_inputs)[1] if frame else frozenset()
    return tuple(
        _held_flag(held, var, value, kinds)
        for var, value in zip(eqn.invars, invals, strict=True)
        if not (_is_literal(var) or var in constants or not _is_float(value))
    )


def _held_flag(held: dict[Any, Any], var: Any, value: Any, kinds: tuple[str, ...]) -> Any:
    """Whether `var` (of value `value`) holds any watched NaN/Inf: its flag in
    `held`, or one reduction of `value`, kept there for its next use."""
    if not _is_literal(var) and var in held:
        flag = held[var]
        if isinstance(flag, _Same):
            flags = [_held_flag(held, v, value, kinds) for v, value in flag.inputs]
            flag = held[var] = functools.reduce(_or, flags)
        return flag
    value = value if hasattr(value, "ndim") else np.asarray(value)  # a Python float
    # An input of an equation of an `auto_axes` / `explicit_axes` region is typed
    # for the mesh outside it, while the equation runs under the region's.
    value = to_current_mesh(value)
    # With both kinds, `not isfinite` alone would say it; but XLA on CPU splits a
    # reduction of one bool into three kernels, and compiles a reduction of two
    # (NaN and not finite) at once as one.
    _, flag = _flags([value], kinds, exact=len(kinds) == 1, either=True)
    if not _is_literal(var):
        held[var] = flag
    return flag


# Calls whose body takes the call's inputs and gives its outputs, one for one.
_PLAIN_CALLS = CALL_PRIMITIVES


def _held_through(handler: Any) -> Any:
    """`handler` of a loop (`scan`, `while`), a `cond` or a plain call, for a
    recorder that counts only what an equation made itself: whether each floating
    carry held a NaN/Inf rides the loop with it (`_Carried`), and is known after
    the loop; a call's body (a `cond`'s branch) knows its inputs' flags, and the
    call's outputs get the flags the body knew. Not inside `shard_map`, where a
    flag would have to keep its value's varying axes."""

    def through(interpreter: Any, state: Any, eqn: JaxprEqn, invals: list[Any]) -> Any:
        if (
            not hasattr(state, "carried")
            or not interpreter.recorder.made_only
            or state.scope.manual_axes
            or not interpreter.held
        ):
            return handler(interpreter, state, eqn, invals)
        held, kinds = interpreter.held[-1], interpreter.kinds
        name = eqn.primitive.name
        if name in ("scan", "while"):
            if name == "scan":
                num_consts, num_carry = scan_layout(eqn)
                offset, body = num_consts, None
            else:
                params = eqn.params
                num_consts = params["cond_nconsts"] + params["body_nconsts"]
                num_carry = len(invals) - num_consts
                offset, body = params["body_nconsts"], params["body_jaxpr"].jaxpr
            carries = range(num_consts, num_consts + num_carry)

            def initial(i: int) -> Any:
                if not _is_float(invals[i]):
                    return None
                if _is_constant_var(state, eqn.invars[i]):
                    # A constant (a -inf to accumulate from) holds no NaN/Inf of
                    # its own: where the loop first combines it with data, that
                    # equation made one, as outside loops.
                    return np.False_
                return _held_flag(held, eqn.invars[i], invals[i], kinds)

            flags = tuple(initial(i) for i in carries)
            carried = _Carried(offset, flags, body=body)
            useful = any(flag is not None for flag in flags)
        elif name == "cond":
            # A branch takes the flags its operands already have; it gives back
            # neither flags nor checks (the branch that runs is not known here).
            flags = tuple(_known(held, var) for var in eqn.invars[1:])
            carried = _Carried(0, flags, loop=False, back=False)
            useful = any(flag is not None for flag in flags)
        else:
            # A call's body takes the flags its inputs already have (no reduction),
            # and, for a recorder that takes its checks in batches, gives back
            # its last checks to be recorded with the caller's.
            flags = tuple(_known(held, var) for var in eqn.invars)
            carried = _Carried(0, flags, loop=False)
            useful = interpreter.recorder.batched or any(flag is not None for flag in flags)
        if not useful:
            return handler(interpreter, state, eqn, invals)
        result = handler(interpreter, state._replace(carried=carried), eqn, invals)
        after = result.ctx.carried
        if after is not None and after is not carried:
            for var, flag in zip(eqn.outvars, after.flags, strict=False):
                if flag is not None:
                    held[var] = flag
            interpreter.pending[-1].extend(after.checks)
        return HandlerResult(result.ctx._replace(carried=None), result.outvals)

    return through
