"""Which context values a custom function's (or library primitive's) outputs
are computed from: a derivative with respect to one of them is one its
derivative rule cannot give."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat
from .._body import TracedBody
from .._matching import CALL_PRIMITIVES, sub_jaxprs


def ctx_read_by_outputs(body: TracedBody) -> tuple[bool, ...]:
    """For each context value the body takes, whether the function's outputs (not
    the context it returns) are computed from it (a value `plant` gives a sow
    inside it, say)."""
    num_outs = len(body.jaxpr.outvars) - body.num_ctx_out
    outputs = [False] * body.num_ctx_out + [True] * num_outs
    start, stop = body.num_consts, body.num_consts + body.ctx_in.num_values
    # Both over-approximate what is read, so both are asked: JAX's dead-code
    # elimination (which sees through loops, but not through custom derivatives,
    # and keeps an effect's inputs), then, where it finds a read, kups' own walk
    # (which sees through custom derivatives and calls only).
    used = _compat.used_inputs(body.jaxpr, outputs)[start:stop]
    if any(used):
        walked = _inputs_read(body.jaxpr, outputs)[start:stop]
        used = [u and w for u, w in zip(used, walked, strict=True)]
    return tuple(used)


# Equations whose one sub-program takes their inputs and gives their outputs, in
# order: what an output is computed from is read inside.
_CALLS = CALL_PRIMITIVES | {"shard_map"}


def _inputs_read(jaxpr: Any, used_outputs: Sequence[bool]) -> list[bool]:
    """Which inputs of `jaxpr` the marked outputs may be computed from. Unlike
    JAX's dead-code elimination it goes inside `custom_jvp`/`custom_vjp`
    functions (the context kups threads through one it leaves as it is is not
    read there), and it ignores effects, which keep their inputs alive but
    compute no output from them. Any other equation reads all its inputs for
    any output it computes."""
    read: set[Any] = {
        v
        for v, u in zip(jaxpr.outvars, used_outputs, strict=True)
        if u and not _compat.is_literal(v)
    }
    for eqn in reversed(jaxpr.eqns):
        outs_used = [v in read for v in eqn.outvars if not isinstance(v, _compat.DropVar)]
        if not any(outs_used):
            continue
        subs = sub_jaxprs(eqn) if eqn.primitive.name in _CALLS else ()
        if (
            len(subs) == 1
            and len(subs[0].invars) == len(eqn.invars)
            and len(subs[0].outvars) == len(eqn.outvars)
        ):
            ins_used = _inputs_read(subs[0], [v in read for v in eqn.outvars])
        else:
            ins_used = [True] * len(eqn.invars)
        read.update(
            v for v, u in zip(eqn.invars, ins_used, strict=True) if u and not _compat.is_literal(v)
        )
    return [v in read for v in jaxpr.invars]
