"""The values `reap` gives a name before a loop or a cond runs: a `sow_cond`'s
`init`, the `init` a zero-trip loop yields, and the clobber names a scan carries
instead of stacking. A base of `Reaper`, which gives `tag`, `first_sown`,
`sows` and `label`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from kups.effects import CALL_PRIMITIVES, source_line, varying_axes

from ._names import LazyLine, SowPath, Tag, path_of
from ._reaped import Reaped, filled_with_init, init_of
from ._rules import given_by_init
from ._selection import sows_around
from ._sow import split_operands


class Seeding:
    """Setting names before a loop or a cond (see the module)."""

    tag: Tag
    first_sown: dict[SowPath, str | LazyLine]

    def sows(self, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        raise NotImplementedError

    def label(self, path: SowPath) -> str:
        raise NotImplementedError

    def seeded(self, ctx: Reaped, sows: list[JaxprEqn], eqn: JaxprEqn) -> Reaped:
        """`ctx` with every `sow_cond` name of `sows` that has no value yet set to its
        `init`, so that a loop carries it (a sow_cond keeps a value from one
        iteration to the next) and a cond's branches agree on it."""
        for sow_eqn in sows:
            path, params = path_of(sow_eqn), sow_eqn.params
            if not params["conditional"] or path in ctx.values:
                continue
            if params["init"] is None:
                raise ValueError(
                    f"{self.label(path)} is sown with sow_cond at {source_line(sow_eqn)}, inside "
                    f"the {eqn.primitive.name} at {source_line(eqn)}, and has no value before it. "
                    f"pred may never hold, and then the name would have no value; kups does "
                    f"not invent one. Give sow_cond(..., init=<number>), or sow an initial "
                    f"value with sow(..., mode='clobber') before."
                )
            ctx = self._init_value(ctx, sow_eqn)
        return ctx

    def _init_value(self, ctx: Reaped, sow_eqn: JaxprEqn, fill: bool = False) -> Reaped:
        """`ctx` with the name of `sow_eqn` set to its `init` (zeros with `fill`), in
        the shape and dtype of its value."""
        path, params = path_of(sow_eqn), sow_eqn.params
        _, operands = split_operands(params, list(sow_eqn.invars))
        leaves = []
        for operand in operands:
            if fill:
                aval = operand.aval
                leaf = jax.lax.broadcast_in_dim(np.zeros((), aval.dtype), aval.shape, ())
            else:
                leaf = filled_with_init(self.tag, params, LazyLine(sow_eqn), operand.aval)
            # Inside shard_map, a loop carries it with the sown value's
            # varying manual axes.
            varying = tuple(sorted(varying_axes(operand.aval), key=str))
            leaves.append(jax.lax.pcast(leaf, varying, to="varying") if varying else leaf)
        value = jax.tree.unflatten(params["tree"], leaves)
        self.first_sown.setdefault(path, LazyLine(sow_eqn))
        return ctx.sown(path, value, params["mode"])

    def preseeded(
        self, ctx: Reaped, inits: dict[SowPath, JaxprEqn], in_loop: list[JaxprEqn], eqn: JaxprEqn
    ) -> Reaped:
        """`ctx` with each name of `inits` set to its `init` when that is the value
        the loop's initializer would give, known without tracing the body to find
        its shape (so the body is traced once, and nested loops do not trace theirs
        again for each trace of the outer one).

        It is when every sow of the name in the loop is a plain clobber sow of one
        shape and dtype, inside nothing but `jit`s, `checkpoint`s, and loops and
        conds that would give the name the same value had it none before: each
        enclosing loop has a sow of it with `init` (a zero-trip loop yields the
        init), and every branch of each enclosing cond sows it."""
        around: dict[int, list[tuple[JaxprEqn, ...]]] = {}
        for jaxpr in (eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]):
            for key, places in sows_around(jaxpr).items():
                around.setdefault(key, []).extend(places)
        for path, init in inits.items():
            sows = [e for e in in_loop if path_of(e) == path]
            avals = {
                tuple(v.aval for v in split_operands(e.params, list(e.invars))[1]) for e in sows
            }
            if len(avals) == 1 and all(
                e.params["mode"] == "clobber"
                and not e.params["conditional"]
                and all(
                    self._keeps_value(path, outer) for place in around[id(e)] for outer in place
                )
                for e in sows
            ):
                ctx = self._init_value(ctx, init)
        return ctx

    def carried_clobbers(self, ctx: Reaped, in_body: list[JaxprEqn], eqn: JaxprEqn) -> Reaped:
        """`ctx` with each clobber name new in a scan's body that every iteration
        sows set before the scan (to its `init`, or zeros the first iteration
        overwrites), so that the scan carries its last value instead of stacking
        one per iteration and taking the last: no stack to hold, and two
        equations fewer to trace at each level of a nest of scans."""
        length = eqn.params["length"]
        by_path: dict[SowPath, list[JaxprEqn]] = {}
        for sow_eqn in in_body:
            path = path_of(sow_eqn)
            if path not in ctx.values:
                by_path.setdefault(path, []).append(sow_eqn)
        around = None
        for path, sows in by_path.items():
            shapes = {
                tuple(v.aval for v in split_operands(e.params, list(e.invars))[1]) for e in sows
            }
            if len(shapes) != 1 or any(
                e.params["mode"] != "clobber" or e.params["conditional"] for e in sows
            ):
                continue
            if around is None:
                around = sows_around(eqn.params["jaxpr"])
            init = init_of(self.tag, path, in_body)
            outer = [o for e in sows for p in around[id(e)] for o in p]
            every = all(self._always_sows(path, o) for o in outer)
            if not every:
                # An iteration may run a cond's branch that does not sow it
                # (equinox's bounded while loop is a scan of conds): the scan
                # carries its last value from its init, as a while loop does. (A
                # loop inside that runs no step still yields the init.)
                if init is not None and all(
                    o.primitive.name == "cond" or self._always_sows(path, o) for o in outer
                ):
                    ctx = self._init_value(ctx, init)
                continue
            # A scan that never runs leaves the name without a value (or its init).
            if length > 0 and all(map(_fillable, next(iter(shapes)))):
                ctx = self._init_value(
                    ctx, init if init is not None else sows[0], fill=init is None
                )
        return ctx

    def seeded_for_cond(self, ctx: Reaped, branches: list[list[JaxprEqn]]) -> Reaped:
        """`ctx` with each clobber name that some branch of a cond does not sow, and
        that has no value yet, set to its sow's `init` (what the name holds when a
        branch that does not sow it runs)."""
        for _, init in given_by_init(self.tag, branches, ctx.values):
            ctx = self._init_value(ctx, init)
        return ctx

    def _always_sows(self, path: SowPath, outer: JaxprEqn) -> bool:
        """Whether `outer`, an equation around a sow of `path` in a scan's body, runs
        a sow of `path` whenever it runs."""
        name, params = outer.primitive.name, outer.params
        if name in _TRANSPARENT:
            return True
        if name == "scan":
            return params["length"] > 0
        if name == "cond":
            return all(
                any(path_of(e) == path for e in self.sows(branch)) for branch in params["branches"]
            )
        return False

    def _keeps_value(self, path: SowPath, outer: JaxprEqn) -> bool:
        """Whether `outer`, an equation around a clobber sow of `path`, gives the
        name the value it would give had the name its init before `outer`."""
        name, params = outer.primitive.name, outer.params
        if name in _TRANSPARENT:
            return True
        if name == "scan":
            return init_of(self.tag, path, self.sows(params["jaxpr"])) is not None
        if name == "while":
            in_loop = [*self.sows(params["cond_jaxpr"]), *self.sows(params["body_jaxpr"])]
            return init_of(self.tag, path, in_loop) is not None
        if name == "cond":
            return all(
                any(path_of(e) == path for e in self.sows(branch)) for branch in params["branches"]
            )
        return False


def _fillable(aval: Any) -> bool:
    """Whether zeros of `aval` are the same type (a number or bool, not weakly typed)."""
    dtype = getattr(aval, "dtype", None)
    return (
        dtype is not None
        and not getattr(aval, "weak_type", False)
        and (np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_))
    )


# Calls that run their body once, as it is: a clobber sow inside gives its value as
# it would directly (`eval_jaxpr`, from JAX 0.11, is the call that `grad`'s forward
# pass makes of a `jax.checkpoint` body). Not the custom-derivative calls, whose
# sows `reap` keeps to the primal function.
_TRANSPARENT = CALL_PRIMITIVES - {"custom_jvp_call", "custom_vjp_call"}
