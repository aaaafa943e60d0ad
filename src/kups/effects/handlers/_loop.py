"""What the handlers of sub-programs share: finding the context a loop carries,
which context values a body passes through unchanged, and trimming a call to the
context it really reads and changes."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import JaxprEqn

from .. import _compat
from .._body import TracedBody, trace_body
from .._context import CtxSpec, diff, spec_from_avals, split, uninitialized_paths
from .._matching import call_body
from .._source import where
from .._types import Uninitialized

Initializer = Callable[[Any, Any], Any]
Updater = Callable[[Any, Any], Any]


def sentinel(ctx_before: Any, spec_before: CtxSpec, spec_after: CtxSpec) -> Any:
    """The body's output context with the leaves that existed before the loop
    holding their values from before the loop, and new leaves `Uninitialized`."""
    before = dict(zip(spec_before.paths, jax.tree.leaves(ctx_before), strict=True))
    avals = iter(spec_after.avals)
    statics = iter(spec_after.statics)
    leaves = []
    for path, is_value in zip(spec_after.paths, spec_after.value_mask, strict=True):
        leaf = next(avals) if is_value else next(statics)
        if path in before:
            leaves.append(before[path])
        elif is_value:
            leaves.append(Uninitialized(leaf))
        else:
            leaves.append(leaf)
    return jax.tree.unflatten(spec_after.treedef, leaves)


def resolve_carry(
    eqn: JaxprEqn,
    kind: str,
    trace: Callable[[CtxSpec], TracedBody],
    ctx: Any,
    initializer: Initializer | None,
) -> tuple[TracedBody, CtxSpec, list[Any]]:
    """Traces a loop body and finds the context it carries.

    A body that returns a context of the same structure, shapes and dtypes is
    carried as it is. Otherwise `initializer(ctx_before, sentinel)` gives the
    initial context, and the body is traced with it (once: nested bodies are
    cached, so nesting does not multiply the work).

    **Returns:**

    `(body, carried_spec, initial_values)`.
    """
    spec, values = split(ctx)
    body = trace(spec)
    if body.ctx_out.same_as(spec):
        return _vary_like_body(trace, body, spec, values)
    if initializer is None:
        raise ValueError(
            f"The {kind} body ({where(eqn)}) changes the context's structure, shapes "
            f"or dtypes, so the context cannot be a loop carry as it is:\n"
            + "\n".join(diff(spec, body.ctx_out))
            + "\nPass an initializer that builds the context the loop starts with, e.g. "
            f"functools.partial(default_{_handler_name(kind)}_handler, initializer=init) "
            f"with init(ctx_before, sentinel) returning the sentinel with every "
            f"Uninitialized leaf replaced by a starting value."
        )
    init_ctx = initializer(ctx, sentinel(ctx, spec, body.ctx_out))
    missing = uninitialized_paths(init_ctx)
    if missing:
        raise ValueError(
            f"The initializer for the {kind} ({where(eqn)}) left context leaves "
            f"Uninitialized: {', '.join('ctx' + p for p in missing)}. Give each a "
            f"starting value (for example jnp.zeros(leaf.shape, leaf.dtype))."
        )
    init_spec, init_values = split(init_ctx)
    body = trace(init_spec)
    if not body.ctx_out.same_as(init_spec):
        raise ValueError(
            f"The {kind} body ({where(eqn)}) does not return the context its "
            f"initializer built; a loop carry must keep its structure, shapes and "
            f"dtypes:\n"
            + "\n".join(diff(init_spec, body.ctx_out))
            + "\nMake the initializer return the context the body returns."
        )
    return _vary_like_body(trace, body, init_spec, init_values)


def _vary_like_body(
    trace: Callable[[CtxSpec], TracedBody], body: TracedBody, spec: CtxSpec, values: list[Any]
) -> tuple[TracedBody, CtxSpec, list[Any]]:
    """Inside `shard_map`, a loop carry must enter with the manual axes it varies
    over when it leaves (JAX 0.10 checks `scan` and `while` carries). A context
    leaf that the body makes vary over more axes (a per-shard count, say) is cast
    to varying before the loop and the body traced again."""
    while True:
        extra = [
            _compat.varying_axes(out) - _compat.varying_axes(aval)
            for aval, out in zip(spec.avals, body.ctx_out.avals, strict=True)
        ]
        if not any(extra):
            return body, spec, values
        values = [
            jax.lax.pcast(v, tuple(sorted(axes, key=str)), to="varying") if axes else v
            for v, axes in zip(values, extra, strict=True)
        ]
        spec = spec_from_avals(spec, [_compat.aval_of(v) for v in values])
        body = trace(spec)


def with_updater(
    interpreter: Any,
    eqn: JaxprEqn,
    kind: str,
    body: TracedBody,
    arg_avals: Sequence[Any],
    updater: Updater | None,
) -> TracedBody:
    """The loop body followed by `updater(carried, new)`."""
    if updater is None:
        return body

    def step(ctx: Any, *args: Any) -> tuple[list[Any], Any]:
        ctx_values = split(ctx)[1]
        ctx_out, outs = body.call(ctx_values, args)
        merged = updater(ctx, body.ctx_out.unflatten(ctx_out))
        return outs, merged

    updated = trace_body(interpreter, step, body.ctx_in, arg_avals, name=f"{kind} updater")
    if not updated.ctx_out.same_as(body.ctx_in):
        raise ValueError(
            f"The updater of the {kind} ({where(eqn)}) returned a context that differs "
            f"from the carried one:\n"
            + "\n".join(diff(body.ctx_in, updated.ctx_out))
            + "\nupdater(carried, new) must return a context like `carried`."
        )
    return updated


def _handler_name(kind: str) -> str:
    return "while" if kind == "while_loop" else kind


def consts_first(
    body: TracedBody, num_ctx: int, num_consts: int, outvars: Sequence[Any] | None = None
) -> Any:
    """The traced body's jaxpr with invars `[body consts, consts, ctx, rest]` (and
    `outvars` for its outputs, if given).

    It was traced as `[body consts, ctx, consts, rest]`; loop primitives take their
    consts before their carries, and the context is a carry.
    """
    k = body.num_consts
    invars = body.jaxpr.invars
    new_invars = [
        *invars[:k],
        *invars[k + num_ctx : k + num_ctx + num_consts],
        *invars[k : k + num_ctx],
        *invars[k + num_ctx + num_consts :],
    ]
    if outvars is None:
        return _compat.replace_jaxpr(body.jaxpr, invars=new_invars)
    return _compat.replace_jaxpr(body.jaxpr, invars=new_invars, outvars=list(outvars))


def arg_avals_of(jaxpr: Any) -> list[Any]:
    open_jaxpr, _ = _compat.open_jaxpr(jaxpr)
    return [v.aval for v in open_jaxpr.invars]


def invariant_ctx_first(
    jaxpr: Any, num_consts: int, invariant: list[bool], *, is_body: bool
) -> Any:
    """A while condition (`[consts, ctx, carry] -> [pred]`) or body (`[consts, ctx,
    carry] -> [ctx, carry]`) with the invariant context inputs moved in front of its
    consts, and the body's outputs for them dropped."""
    num_ctx = len(invariant)
    invars = jaxpr.invars
    ctx_vars = invars[num_consts : num_consts + num_ctx]
    moved = [v for v, inv in zip(ctx_vars, invariant, strict=True) if inv]
    kept = [v for v, inv in zip(ctx_vars, invariant, strict=True) if not inv]
    new_invars = [*moved, *invars[:num_consts], *kept, *invars[num_consts + num_ctx :]]
    outvars = jaxpr.outvars
    if is_body:
        outvars = [
            *(v for v, inv in zip(outvars[:num_ctx], invariant, strict=True) if not inv),
            *outvars[num_ctx:],
        ]
    return _compat.replace_jaxpr(jaxpr, invars=new_invars, outvars=outvars)


# Per jaxpr, `forwarded_inputs` of it. Each enclosing loop asks it of the body it
# traced, which holds the inner loops' rebuilt bodies: cached, nesting costs one
# walk per body rather than one per body and enclosing level.
_FORWARDED: weakref.WeakKeyDictionary[Any, tuple[int | None, ...]] = weakref.WeakKeyDictionary()


def forwarded_inputs(jaxpr: Any) -> list[int | None]:
    """For each output of `jaxpr`, the index of the input it returns unchanged, or
    `None`; values are followed through sub-programs that pass them through."""
    jaxpr, _ = _compat.open_jaxpr(jaxpr)
    found = _FORWARDED.get(jaxpr)
    if found is None:
        source: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
        for sub_eqn in jaxpr.eqns:
            for var, index in zip(sub_eqn.outvars, _eqn_forwarding(sub_eqn), strict=True):
                atom = None if index is None else sub_eqn.invars[index]
                if atom is not None and not _compat.is_literal(atom) and atom in source:
                    source[var] = source[atom]
        found = tuple(None if _compat.is_literal(v) else source.get(v) for v in jaxpr.outvars)
        _FORWARDED[jaxpr] = found
    return list(found)


def _eqn_forwarding(eqn: JaxprEqn) -> list[int | None]:
    """For each output of `eqn`, the index of the input it equals, or `None`."""
    name, params = eqn.primitive.name, eqn.params
    unknown: list[int | None] = [None] * len(eqn.outvars)
    sub = call_body(eqn)
    if sub is not None:
        return forwarded_inputs(sub)
    if name == "cond":
        per_branch = [forwarded_inputs(branch) for branch in params["branches"]]
        return [
            # Input 0 of a cond is the branch index; operands follow it.
            None if f[0] is None or any(g != f[0] for g in f) else f[0] + 1
            for f in zip(*per_branch, strict=True)
        ]
    if name == "while":
        num_body_consts = params["body_nconsts"]
        body = forwarded_inputs(params["body_jaxpr"])
        return [
            params["cond_nconsts"] + i if i == num_body_consts + j else None
            for j, i in enumerate(body)
        ]
    if name == "scan":
        num_consts, num_carry = _compat.scan_layout(params)
        body = forwarded_inputs(params["jaxpr"])
        return [
            num_consts + j if j < num_carry and body[j] == num_consts + j else None
            for j in range(len(eqn.outvars))
        ]
    return unknown


def unused_dropped(jaxpr: Any, num: int) -> tuple[Any, list[bool]]:
    """`jaxpr` without those of its first `num` inputs that it never reads, and
    which of them it keeps.

    The handlers pass the context (and the consts of a traced body) into a call as
    leading inputs; where the body does not read them, leaving them out keeps the
    call as the user wrote it (XLA may compile a program differently when an
    otherwise dead call takes one more input). Jaxprs with effects that refer to
    inputs by position are left as they are.
    """
    if _compat.has_input_effects(jaxpr):
        return jaxpr, [True] * num
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if _compat.is_var(v)}
    read.update(v for v in jaxpr.outvars if _compat.is_var(v))
    keep = [v in read for v in jaxpr.invars[:num]]
    if all(keep):
        return jaxpr, keep
    invars = [v for v, k in zip(jaxpr.invars[:num], keep, strict=True) if k]
    return _compat.replace_jaxpr(jaxpr, invars=[*invars, *jaxpr.invars[num:]]), keep


@dataclasses.dataclass(frozen=True)
class TrimmedCall:
    """A call's body without the context outputs it passes through unchanged and
    without the leading (context and const) inputs it never reads.

    `forwarded[j]` is the input that context output `j` equals, or `None` where
    the body computes it; `kept_out` lists the computed ones, `kept_in` says which
    leading inputs stay.
    """

    jaxpr: Any
    kept_in: tuple[bool, ...]
    kept_out: tuple[int, ...]
    forwarded: tuple[int | None, ...]

    def inputs(self, values: Sequence[Any]) -> list[Any]:
        """`values` (one per input of the untrimmed body) for the trimmed one."""
        num = len(self.kept_in)
        return [*(v for v, k in zip(values[:num], self.kept_in, strict=True) if k), *values[num:]]

    def outputs(self, inputs: Sequence[Any], out: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The context values and the other outputs, from the trimmed call's `out`
        and the untrimmed body's `inputs`."""
        computed = iter(out[: len(self.kept_out)])
        ctx = [next(computed) if f is None else inputs[f] for f in self.forwarded]
        return ctx, list(out[len(self.kept_out) :])


def trim_call(
    jaxpr: Any,
    num_extra_in: int,
    num_ctx_out: int,
    passes: Callable[[int, int], bool] = lambda out_index, in_index: True,
) -> TrimmedCall:
    """Trims a traced call body whose first `num_extra_in` inputs and first
    `num_ctx_out` outputs are the handler's (consts and context).

    A context output that equals an input (and for which `passes(output, input)`
    holds) is taken from outside rather than computed: a call whose outputs
    nobody uses then stays dead code, as in the original program. Leading inputs
    the body never reads are left out (see `unused_dropped`).
    """
    forwarded = tuple(
        f if f is not None and passes(j, f) else None
        for j, f in enumerate(forwarded_inputs(jaxpr)[:num_ctx_out])
    )
    kept_out = tuple(j for j, f in enumerate(forwarded) if f is None)
    outvars = jaxpr.outvars
    jaxpr = _compat.replace_jaxpr(
        jaxpr, outvars=[*(outvars[j] for j in kept_out), *outvars[num_ctx_out:]]
    )
    jaxpr, kept_in = unused_dropped(jaxpr, num_extra_in)
    return TrimmedCall(jaxpr, tuple(kept_in), kept_out, forwarded)
