"""`report="reaching"`: the interpreter that keeps the origins of each jaxpr's
values, and maps the origins crossing a sub-program's boundary onto its inputs
and outputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.extend.core import Jaxpr, JaxprEqn

from kups.effects import (
    Dispatcher,
    Interpreter,
    InterpreterPolicy,
    to_current_mesh,
)

from ._constants import _is_literal, finite_atom, keeps_finite
from ._position import _loop_depth
from ._sites import _Sites
from ._taint_crossing import with_pieces, with_rows, without_pieces, without_rows
from ._taint_known import known_outputs
from ._taint_origin import (
    _EXTERNAL,
    _IO,
    _as_slot,
    _float_origin,
    _is_float_aval,
    _merged_slot,
    _Origin,
    _shape,
    _Taint,
    _validated,
    fenced,
)
from ._taint_pieces import origin_of_parts
from ._taint_rows import (
    _Rows,
    _RowSlot,
    broadcast_rows,
    written,
)
from ._taint_rules import _flush


class _TaintInterpreter(Interpreter):
    """Keeps the origins of the values of each jaxpr being run (a stack of frames,
    one per nested call), and maps `_IO` onto the jaxpr's inputs and outputs."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        sites: _Sites,
        policy: InterpreterPolicy = InterpreterPolicy.RAISE,
    ) -> None:
        super().__init__(
            dispatcher, policy=policy, label="find_nans", policy_hint="find_nans(fn, policy=...)"
        )
        self.sites = sites
        self.frames: list[dict[Any, Any]] = []
        # Per frame: the values whose parts came from different inputs (`_Pieces`).
        self.pieces: list[dict[Any, Any]] = []
        # Per frame: the origins of the rows of scans' stacked outputs (`_Rows`).
        self.rows: list[dict[Any, Any]] = []
        # Per frame: the integers computed from literals alone (`_taint_known`).
        self.known: list[dict[Any, Any]] = []
        # Per frame: the float constants known to be finite (`_finite_constants`).
        self.finite: list[set[Any]] = []
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

    def pieces_of(self, atoms: Any) -> list[Any]:
        """The `_Pieces` of each of `atoms`, or `None`."""
        pieces = self.pieces[-1]
        if not pieces:
            return [None] * len(atoms)
        return [None if _is_literal(v) else pieces.get(v) for v in atoms]

    def set_pieces(self, atom: Any, pieces: Any) -> None:
        self.pieces[-1][atom] = pieces

    def rows_of(self, atom: Any) -> Any:
        """The `_Rows` of a scan's stacked output, or `None`."""
        rows = self.rows[-1]
        return None if not rows or _is_literal(atom) else rows.get(atom)

    def set_rows(self, atom: Any, rows: Any) -> None:
        self.rows[-1][atom] = rows

    def learn(self, eqn: JaxprEqn, invals: list[Any]) -> None:
        """Keeps the value of `eqn`'s integer output if it is computed from
        literals and known integers alone (`_taint_known`), and whether its
        outputs are finite constants (moved finite literals)."""
        finite = self.finite[-1]
        if keeps_finite(eqn) and all(self.finite_atoms(eqn.invars)):
            finite.update(eqn.outvars)
        known = self.known[-1]
        values = []
        for v, x in zip(eqn.invars, invals, strict=True):
            if _is_literal(v):
                values.append(v.val)  # pyright: ignore[reportAttributeAccessIssue]
            elif v in known:
                values.append(known[v])
            elif isinstance(x, Tracer):
                return
            else:
                values.append(x)
        value = known_outputs(eqn, values)
        if value is not None:
            known[eqn.outvars[0]] = value

    def finite_atoms(self, atoms: Any) -> tuple[bool, ...]:
        """Which of `atoms`, of the jaxpr being run, are finite literals or
        constants known to be finite."""
        finite = self.finite[-1]
        return tuple(finite_atom(v, finite) for v in atoms)

    def static(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
        """`invals`, with the integers computed from literals alone known."""
        known = self.known[-1]
        if not known:
            return invals
        return [
            known.get(v, x) if isinstance(x, Tracer) and not _is_literal(v) else x
            for v, x in zip(eqn.invars, invals, strict=True)
        ]

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
        in_pieces: list[Any] = []
        in_rows: list[Any] = []
        if io.role in ("call", "cond"):
            # A call's inputs may have pieces (see `_taint_pieces`) and rows, a
            # cond's operands rows.
            entries, in_rows = without_rows(io.origins)
            unpieced, in_pieces = without_pieces(entries)
            io = _IO(io.role, io.counts, tuple(unpieced), io.finite)
        origins, ctx = _enter(io, ctx, jaxpr, args, self.sites.kinds)
        # A loop's buffer written row by row comes in with the origins of its rows.
        rows = {
            v: o.rows for v, o in zip(jaxpr.invars, origins, strict=True) if isinstance(o, _RowSlot)
        }
        origins = [o.origin if isinstance(o, _RowSlot) else o for o in origins]
        if len(in_rows) == len(jaxpr.invars):  # a body that takes the inputs one to one
            rows.update((v, r) for v, r in zip(jaxpr.invars, in_rows, strict=True) if r is not None)
        frame: dict[Any, Any] = dict.fromkeys(jaxpr.constvars)
        frame.update(zip(jaxpr.invars, origins, strict=True))
        self.frames.append(frame)
        pieces: dict[Any, Any] = {}
        if len(in_pieces) == len(jaxpr.invars):  # a body that takes the inputs one to one
            pieces = {v: p for v, p in zip(jaxpr.invars, in_pieces, strict=True) if p is not None}
        self.pieces.append(pieces)
        self.known.append({})
        finite_in = io.finite if len(io.finite) == len(jaxpr.invars) else ()
        self.finite.append({v for v, f in zip(jaxpr.invars, finite_in, strict=False) if f})
        self.rows.append(rows)
        self.pending.append(0)
        try:
            outs, ctx = super().interpret_jaxpr(jaxpr, consts, ctx._replace(io=None), args)
            ctx = _flush(self, ctx)
            out_rows = [None if _is_literal(v) else rows.get(v) for v in jaxpr.outvars]  # pyright: ignore[reportArgumentType]
        finally:
            self.frames.pop()
            self.pieces.pop()
            self.known.pop()
            self.finite.pop()
            self.rows.pop()
            self.pending.pop()
        out_origins = [
            None if _is_literal(v) else frame[v] if v in frame else _float_origin(v.aval, _EXTERNAL)
            for v in jaxpr.outvars
        ]
        if io.role == "top" and pieces:
            # An output written in parts (`buf.at[:2].set(a)`, then `.at[2:]`):
            # only the parts that are not finite reach.
            for i, (v, out) in enumerate(zip(jaxpr.outvars, outs, strict=True)):
                own = None if _is_literal(v) else pieces.get(v)
                if own is not None and isinstance(out_origins[i], _Origin):
                    exact = origin_of_parts(own, out, self.sites.kinds)
                    if exact is not None:
                        out_origins[i] = exact
        left = fenced(_leave(io, ctx, jaxpr, out_origins, out_rows))
        if io.role == "call" and pieces:
            out_pieces = [None if _is_literal(v) else pieces.get(v) for v in jaxpr.outvars]  # pyright: ignore[reportArgumentType]
            left = _IO(left.role, left.counts, with_pieces(list(left.origins), out_pieces))
        if io.role == "call" and any(r is not None for r in out_rows):
            left = _IO(left.role, left.counts, with_rows(left.origins, out_rows))
        return outs, ctx._replace(io=left)


def _typed_for_a_mesh(aval: Any) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty


def _enter(
    io: _IO, state: _Taint, jaxpr: Jaxpr, args: Any, kinds: tuple[str, ...]
) -> tuple[list[Any], _Taint]:
    """The origins of `jaxpr`'s inputs, from the handler's `io`."""
    avals = [v.aval for v in jaxpr.invars]
    if io.role == "top":
        depth = _loop_depth(jaxpr)
        state = state._replace(pos=np.array([0, 0] + [-1] * depth, np.int32))
        return [_float_origin(a, _EXTERNAL) for a in avals], state
    if io.role == "scan":
        consts, carry, xs, _ = io.groups()
        xs = [
            _validated(o, x, kinds)
            for o, x in zip(xs, args[len(consts) + len(carry) :], strict=True)
        ]
        return [*consts, *carry, *xs], state
    if io.role == "while":
        consts, carry = io.groups()
        return [*consts, *carry], state
    if io.role == "shard_map":
        origins, split = io.groups()
        here = state.here.reshape((1,))
        state = state._replace(pos=jax.lax.dynamic_update_slice(state.pos, here, (1,)))
        return [
            _validated(o, x, kinds) if s else o
            for o, s, x in zip(origins, split, args, strict=True)
        ], state
    origins = list(io.origins)
    if len(origins) != len(avals):
        # A sub-program that does not take the equation's inputs one to one.
        return [_float_origin(a, _EXTERNAL) for a in avals], state
    return origins, state


def _carried(slot: Any, origin: Any, rows: Any, aval: Any, length: int) -> Any:
    """The loop slot a carry leaves the body with: `_Rows` if it came in with
    rows (those the body left it, or each row with its origin)."""
    out = _as_slot(origin, aval, length)
    if not isinstance(slot, _RowSlot):
        return out
    return _RowSlot(out, rows if rows is not None else broadcast_rows(out, slot.rows.w.shape[0]))


def _leave(io: _IO, state: _Taint, jaxpr: Jaxpr, origins: list[Any], rows: list[Any]) -> _IO:
    """The `_IO` that tells the handler the origins of `jaxpr`'s outputs (and the
    rows of the buffers a loop writes row by row)."""
    avals = [v.aval for v in jaxpr.outvars]
    if io.role == "scan":
        consts, carry, xs, ys = io.groups()
        num_carry = len(carry)
        length = state.pos.shape[0]
        carry_out = [
            _carried(slot, o, r, a, length)
            for slot, o, r, a in zip(carry, origins, rows, avals, strict=False)
        ]
        # The iteration's index: the loop's slot in `pos` (see `_taint_loop`).
        index = state.pos[1 + state.scope.loop_depth]
        merged = [
            written(acc, index, _as_slot(o, a, length))
            if isinstance(acc, _Rows)
            else _merged_slot(acc, o, a, length)
            for acc, o, a in zip(ys, origins[num_carry:], avals[num_carry:], strict=True)
        ]
        return _IO("scan", io.counts, (*consts, *carry_out, *xs, *merged))
    if io.role == "while":
        consts, carry = io.groups()
        length = state.pos.shape[0]
        carry_out = [
            _carried(slot, o, r, a, length)
            for slot, o, r, a in zip(carry, origins, rows, avals, strict=True)
        ]
        return _IO("while", io.counts, (*consts, *carry_out))
    if io.role == "cond":
        # Every branch gives the same structure: the outputs `io.counts` names
        # (`cond_rows`) leave with rows.
        length = state.pos.shape[0]
        slots = [_as_slot(o, a, length) for o, a in zip(origins, avals, strict=True)]
        out_rows = [
            (rows[j] or broadcast_rows(slots[j], _shape(v)[0])) if j in io.counts else None
            for j, v in enumerate(jaxpr.outvars)
        ]
        return _IO("out", (), with_rows(slots, out_rows))
    return _IO("out", (), tuple(origins))
