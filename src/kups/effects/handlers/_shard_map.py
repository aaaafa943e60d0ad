"""`shard_map`: the body re-wrapped with the context as an extra input and output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import JaxprEqn
from jax.sharding import PartitionSpec
from jax.tree_util import keystr

from .. import _compat
from .._body import interpret_fn, trace_body
from .._context import CtxSpec, split
from .._interpreter import where
from .._types import HandlerResult
from ._loop import trim_call

SpecFn = Callable[[Any], Any]


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _flat_specs(
    eqn: JaxprEqn, what: str, declared: Any, spec: CtxSpec, ctx_tree: Any
) -> list[PartitionSpec]:
    """One `PartitionSpec` per traced context leaf, from a prefix or full tree."""
    if declared is None:
        return [PartitionSpec()] * spec.num_values
    if _is_spec(declared):
        return [declared] * spec.num_values
    try:
        full = spec.treedef.flatten_up_to(declared)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{what} for the shard_map ({where(eqn)}) returned a structure that does not "
            f"match the context: expected one PartitionSpec, or a pytree with the "
            f"context's structure {spec.treedef} holding a PartitionSpec per leaf; got "
            f"{declared!r} ({err})."
        ) from None
    specs = []
    for path, is_value, leaf in zip(spec.paths, spec.value_mask, full, strict=True):
        if not is_value:
            continue
        if not _is_spec(leaf):
            raise ValueError(
                f"{what} for the shard_map ({where(eqn)}) gave ctx{keystr(path)} "
                f"{leaf!r}, which is not a jax.sharding.PartitionSpec. Return one "
                f"PartitionSpec for the whole context, or a pytree with the context's "
                f"structure {spec.treedef} holding one PartitionSpec per leaf."
            )
        specs.append(leaf)
    del ctx_tree
    return specs


def _spec_axes(spec: PartitionSpec) -> frozenset[Any]:
    axes: set[Any] = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return frozenset(axes)


def default_shard_map_handler(
    interpreter: Any,
    ctx: Any,
    eqn: JaxprEqn,
    invals: list[Any],
    *,
    declare_ctx_in_specs: SpecFn | None = None,
    declare_ctx_out_specs: SpecFn | None = None,
    reduce_ctx: Callable[[Any], Any] | None = None,
) -> HandlerResult:
    """Interprets a `jax.shard_map` body and wraps it in `shard_map` again, with the
    context as an extra input and output.

    The mesh, in/out specs, manual axes (partial-manual bodies too) and
    `check_vma` are kept. The body is traced once, inside the manual-axis scope.

    **Arguments:**

    - `declare_ctx_in_specs`: `fn(ctx_tree) -> PartitionSpec | pytree of
      PartitionSpec`, the in-specs of the context (default `P()`, replicated).
      It receives the context with every leaf an `Uninitialized`.
    - `declare_ctx_out_specs`: the same for the context as it leaves the body
      (after `reduce_ctx`); default `P()`.
    - `reduce_ctx`: `fn(ctx) -> ctx`, run inside the manual-axis scope on each
      shard's context before it leaves: the place for `psum`, `pmax`,
      `all_gather`. It must keep the context's tree structure.

    A context leaf that varies across shards where its out-spec says it is
    replicated is a `ValueError` that points at `reduce_ctx` and
    `declare_ctx_out_specs`.
    """
    _compat.check_params(eqn)
    params = eqn.params
    mesh, check_vma = params["mesh"], params["check_vma"]
    manual_axes = _compat.shard_map_manual_axes(params)
    body_jaxpr = params["jaxpr"]

    spec, ctx_values = split(ctx)
    in_specs = _flat_specs(
        eqn,
        "declare_ctx_in_specs",
        declare_ctx_in_specs(spec.uninitialized()) if declare_ctx_in_specs else None,
        spec,
        ctx,
    )
    shard_ctx_avals = [
        _compat.shard_aval(mesh, manual_axes, check_vma, s, a)
        for s, a in zip(in_specs, spec.avals, strict=True)
    ]
    inner_spec = CtxSpec(
        spec.treedef, spec.paths, spec.value_mask, spec.statics, tuple(shard_ctx_avals)
    )
    interpret = interpret_fn(interpreter, body_jaxpr)

    def body_fn(ctx: Any, *args: Any) -> tuple[list[Any], Any]:
        outs, new_ctx = interpret(ctx, *args)
        if reduce_ctx is not None:
            reduced = reduce_ctx(new_ctx)
            if jax.tree.structure(reduced) != jax.tree.structure(new_ctx):
                raise ValueError(
                    f"reduce_ctx for the shard_map ({where(eqn)}) changed the context's "
                    f"tree structure from {jax.tree.structure(new_ctx)} to "
                    f"{jax.tree.structure(reduced)}; it must return a context of the same "
                    f"structure (reduce each leaf, e.g. jax.tree.map(lambda v: "
                    f"jax.lax.psum(v, axes), ctx))."
                )
            new_ctx = reduced
        return outs, new_ctx

    arg_avals = [v.aval for v in body_jaxpr.invars]
    with _compat.manual_axis_scope(mesh, manual_axes, check_vma):
        body = trace_body(
            interpreter,
            body_fn,
            inner_spec,
            arg_avals,
            key=(body_jaxpr, "shard_map", tuple(in_specs), reduce_ctx),
            name="shard_map body",
        )
    out_spec = body.ctx_out
    out_specs = _flat_specs(
        eqn,
        "declare_ctx_out_specs",
        declare_ctx_out_specs(out_spec.uninitialized()) if declare_ctx_out_specs else None,
        out_spec,
        None,
    )
    if check_vma:
        _check_replication(eqn, out_spec, out_specs, manual_axes, reduce_ctx is not None)

    const_specs = tuple(PartitionSpec() for _ in body.consts)
    all_in_specs = (*const_specs, *in_specs, *params["in_specs"])
    args = [*body.consts, *ctx_values, *invals]
    # A context value passes through only with the same spec in and out.
    call = trim_call(
        body.jaxpr,
        len(body.consts) + len(ctx_values),
        out_spec.num_values,
        passes=lambda j, f: all_in_specs[f] == out_specs[j],
    )
    new_params = _compat.shard_map_params(
        params,
        jaxpr=call.jaxpr,
        in_specs=tuple(call.inputs(all_in_specs)),
        out_specs=(*(out_specs[j] for j in call.kept_out), *params["out_specs"]),
    )
    bound_args = call.inputs(args)
    num_extra = len(bound_args) - len(invals)
    bound_args = [
        *_placed(bound_args[:num_extra], new_params["in_specs"][:num_extra], mesh, invals),
        *bound_args[num_extra:],
    ]

    def bind(*args: Any) -> list[Any]:
        return _compat.bind_shard_map(eqn.primitive, new_params, args)

    if any(isinstance(a, _compat.Tracer) for a in bound_args) or not _contains_shard_map(
        body.jaxpr
    ):
        # Eagerly, bound as it is: JAX runs a shard_map body op by op, and compiling
        # it instead could change the result in its last bits.
        out = bind(*bound_args)
    else:
        # Run eagerly, JAX 0.10.2 fails on a shard_map nested in this one that takes a
        # replicated (P()) input, as the context always is: run it compiled instead.
        out = jax.jit(bind)(*bound_args)
    ctx_out, outs = call.outputs(args, out)
    return HandlerResult(out_spec.unflatten(ctx_out), outs)


def _placed(values: list[Any], specs: Any, mesh: Any, invals: list[Any]) -> list[Any]:
    """Eagerly, on a mesh with Explicit axes, `jax.shard_map` checks each argument's
    sharding against its in-spec: the handler's own arguments (the context, the
    body's consts) are put on the user's devices with their specs, as the user's
    arguments already are. A traced value typed for the mesh (under `jax.set_mesh`)
    is resharded to its spec, as JAX 0.12's lowering checks the types."""
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return values
    concrete = next(
        (
            a.sharding.mesh
            for a in invals
            if isinstance(a, jax.Array)
            and not isinstance(a, _compat.Tracer)
            and isinstance(a.sharding, jax.sharding.NamedSharding)
            and isinstance(a.sharding.mesh, jax.sharding.Mesh)
        ),
        mesh if isinstance(mesh, jax.sharding.Mesh) else None,
    )
    if concrete is None and not any(isinstance(v, _compat.Tracer) for v in values):
        return values
    return [
        _compat.reshard_to_spec(v, mesh, spec)
        if isinstance(v, _compat.Tracer)
        else v
        if not isinstance(v, jax.Array) or concrete is None
        else jax.device_put(v, jax.sharding.NamedSharding(concrete, spec))
        for v, spec in zip(values, specs, strict=True)
    ]


def _contains_shard_map(jaxpr: Any) -> bool:
    jaxpr, _ = _compat.open_jaxpr(jaxpr)
    return any(
        eqn.primitive.name == "shard_map"
        or any(_contains_shard_map(sub) for sub in _compat.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def _check_replication(
    eqn: JaxprEqn,
    out_spec: CtxSpec,
    out_specs: list[PartitionSpec],
    manual_axes: frozenset[Any],
    has_reduce: bool,
) -> None:
    value_paths = [p for p, m in zip(out_spec.paths, out_spec.value_mask, strict=True) if m]
    for path, aval, pspec in zip(value_paths, out_spec.avals, out_specs, strict=True):
        varying = _compat.varying_axes(aval) & manual_axes
        unmentioned = varying - _spec_axes(pspec)
        if unmentioned:
            axes = tuple(sorted(unmentioned, key=str))
            hint = (
                "reduce_ctx returned it still varying" if has_reduce else "no reduce_ctx was given"
            )
            raise ValueError(
                f"Context leaf ctx{keystr(path)} ({aval.str_short()}) differs between the "
                f"shards of mesh axes {axes} when it leaves the shard_map ({where(eqn)}), "
                f"but its out-spec {pspec} says it is replicated over them ({hint}). "
                f"Reduce it across the shards in reduce_ctx (for example "
                f"reduce_ctx=lambda ctx: jax.tree.map(lambda v: jax.lax.psum(v, {axes!r}), "
                f"ctx)), or declare it sharded with declare_ctx_out_specs (for example "
                f"PartitionSpec({axes!r})), via functools.partial(default_shard_map_handler, "
                f"...)."
            )
