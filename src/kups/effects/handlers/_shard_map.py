"""`shard_map`: the body re-wrapped with the context as an extra input and output."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import JaxprEqn
from jax.sharding import PartitionSpec
from jax.tree_util import keystr

from .. import _compat
from .._body import interpret_fn, trace_body
from .._context import CtxSpec, split
from .._registry import default_handler_for
from .._source import where
from .._types import HandlerResult
from .._validation import check_params
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


def _in_mesh_order(mesh: Any, axes: Any) -> tuple[Any, ...]:
    return tuple(name for name in mesh.axis_names if name in axes)


def _did_you_mean(name: Any, candidates: Sequence[Any]) -> str:
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _for_leaf(spec: CtxSpec, path: Any, expr: str, others: str) -> str:
    """Code mapping `ctx` to `expr` (of `v`) at `path` and to `others` elsewhere:
    `jax.tree.map` when the context is that one leaf."""
    if spec.treedef.num_leaves == 1:
        return f"jax.tree.map(lambda v: {expr}, ctx)"
    return (
        f"jax.tree_util.tree_map_with_path(lambda path, v: {expr} if "
        f"jax.tree_util.keystr(path) == {keystr(path)!r} else {others}, ctx)"
    )


def _check_specs(
    eqn: JaxprEqn,
    what: str,
    spec: CtxSpec,
    specs: list[PartitionSpec],
    mesh: Any,
    manual_axes: frozenset[Any],
    *,
    entering: bool,
) -> None:
    """Each context leaf's spec fits the leaf and the mesh, checked before JAX sees
    it (JAX's own failures are an `IndexError` in lowering, a `KeyError`, or a leaf
    silently cut short).

    Entering, `aval` is the global leaf, split into equal blocks: each sharded
    dimension must divide by its axes' sizes. Leaving, `aval` is one shard's leaf,
    and the shards' leaves are concatenated along the sharded dimensions, so any
    size fits."""
    value_paths = [p for p, m in zip(spec.paths, spec.value_mask, strict=True) if m]
    manual = _in_mesh_order(mesh, manual_axes)
    for path, aval, pspec in zip(value_paths, spec.avals, specs, strict=True):
        problem = _names_problem(pspec, mesh, manual) or (
            _rank_problem(pspec, aval, mesh, manual_axes, spec, path, entering=entering)
        )
        if problem is None and entering:
            problem = _divisibility_problem(pspec, tuple(aval.shape), mesh)
        if problem is not None:
            shape = f"{'' if entering else 'per-shard '}shape {tuple(aval.shape)}"
            raise ValueError(
                f"{what} for the shard_map ({where(eqn)}) gave context leaf "
                f"ctx{keystr(path)} ({shape}, {aval.dtype}) the spec {pspec}: {problem}"
            )


def _names_problem(pspec: PartitionSpec, mesh: Any, manual: tuple[Any, ...]) -> str | None:
    """What is wrong with the axis names of `pspec`, and the fix; `None` if nothing."""
    seen: set[Any] = set()
    for entry in pspec:
        for name in () if entry is None else _entry_axes(entry):
            if name not in mesh.axis_names:
                return (
                    f"{name!r} is not an axis of the mesh{_did_you_mean(name, mesh.axis_names)}"
                    f"; the mesh's axes are {tuple(mesh.axis_names)}, and of them this "
                    f"shard_map makes {manual} manual. Name only those."
                )
            if name not in manual:
                return (
                    f"mesh axis {name!r} is not a manual axis of this shard_map (its manual "
                    f"axes are {manual}, the axis_names of jax.shard_map), and a context "
                    f"spec can name only those: leave {name!r} out."
                )
            if name in seen:
                return (
                    f"mesh axis {name!r} is used more than once, but a mesh axis can shard "
                    f"only one dimension: name it in one entry only."
                )
            seen.add(name)
    return None


def _rank_problem(
    pspec: PartitionSpec,
    aval: Any,
    mesh: Any,
    manual_axes: frozenset[Any],
    spec: CtxSpec,
    path: Any,
    *,
    entering: bool,
) -> str | None:
    rank = aval.ndim
    if len(pspec) <= rank:
        return None
    entries = f"{len(pspec)} entr{'y' if len(pspec) == 1 else 'ies'}"
    dims = {0: "it is a scalar", 1: "it has 1 dimension"}.get(rank, f"it has {rank} dimensions")
    problem = (
        f"the spec has {entries} but {dims}, and a PartitionSpec has one entry at most "
        f"per dimension."
    )
    replicate = "replicate it with the spec `PartitionSpec()`"
    varying = _in_mesh_order(mesh, _compat.varying_axes(aval) & manual_axes)
    if not entering and varying:
        reduce = _for_leaf(spec, path, f"jax.lax.psum(v, {varying!r})", "v")
        replicate += (
            f", reduced across the shards of {varying} that it differs between, with "
            f"`reduce_ctx=lambda ctx: {reduce}`"
        )
    if rank > 0:
        return f"{problem} Give it at most {rank}, or {replicate}."
    shape = tuple(
        1 if entry is None else math.prod(mesh.shape[name] for name in _entry_axes(entry))
        for entry in pspec
    )
    if entering:
        return (
            f"{problem} Either {replicate}, or pass the leaf as an array of shape {shape}, "
            f"one entry per shard, and keep this spec."
        )
    index = ", ".join(["None"] * len(pspec))
    return (
        f"{problem} Either {replicate}; or keep one value per shard: give it "
        f"{'a leading axis' if len(pspec) == 1 else 'leading axes'} in reduce_ctx, with "
        f"`reduce_ctx=lambda ctx: {_for_leaf(spec, path, f'v[{index}]', 'v')}`, and keep "
        f"this spec; it then leaves with shape {shape}."
    )


def _entry_axes(entry: Any) -> tuple[Any, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def _divisibility_problem(pspec: PartitionSpec, shape: tuple[int, ...], mesh: Any) -> str | None:
    for dim, entry in enumerate(pspec):
        if entry is None:
            continue
        names = _entry_axes(entry)
        num_shards = math.prod(mesh.shape[name] for name in names)
        if shape[dim] % num_shards:
            return (
                f"dimension {dim} has size {shape[dim]}, which the {num_shards} shards of "
                f"mesh axes {names} do not divide evenly. Make it a multiple of "
                f"{num_shards} (pad the leaf), or replicate the leaf with `PartitionSpec()`."
            )
    return None


@default_handler_for("shard_map")
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
    check_params(eqn)
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
    _check_specs(eqn, "declare_ctx_in_specs", spec, in_specs, mesh, manual_axes, entering=True)
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
            try:
                reduced = reduce_ctx(new_ctx)
            except (AssertionError, NameError, ValueError) as err:
                _raise_if_unbound_axis(eqn, err, manual_axes, mesh)
                raise
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
    _check_specs(
        eqn, "declare_ctx_out_specs", out_spec, out_specs, mesh, manual_axes, entering=False
    )
    if check_vma:
        _check_replication(eqn, out_spec, out_specs, mesh, manual_axes, reduce_ctx is not None)

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


def _is_bound(name: str) -> bool:
    """Whether collectives may name `name` here (a manual mesh axis, or the
    `axis_name` of an enclosing `vmap`)."""
    try:
        jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def _raise_if_unbound_axis(
    eqn: JaxprEqn, err: BaseException, manual_axes: frozenset[Any], mesh: Any
) -> None:
    """Re-raises an error of a collective in `reduce_ctx` that was given an axis name
    that is not manual here as a `ValueError` that names it. JAX's own error is a
    bare `AssertionError` (psum, pmax, ppermute, pcast), a `NameError` (all_gather,
    axis_index) or, for a name mixed with valid ones, a `ValueError`, on JAX 0.10.2
    and 0.12. Any other error is left alone: the caller re-raises it."""
    unbound = [name for name in _compat.axis_names_in_error(err) if not _is_bound(name)]
    if not unbound:
        return
    bound = jax.sharding.get_abstract_mesh().manual_axes
    own = _in_mesh_order(mesh, manual_axes)
    enclosing = tuple(name for name in bound if name not in manual_axes)
    listed = f"{own} of this shard_map" + (
        f" and {enclosing} of the enclosing shard_maps" if enclosing else ""
    )
    raise ValueError(
        f"reduce_ctx for the shard_map ({where(eqn)}) used the axis name "
        f"{unbound[0]!r}{_did_you_mean(unbound[0], bound)}, which is not a manual axis "
        f"here. The manual axes here are {listed}; name only those in reduce_ctx's "
        f"collectives (psum, pmax, all_gather, axis_index, ...)."
    ) from err


def _check_replication(
    eqn: JaxprEqn,
    out_spec: CtxSpec,
    out_specs: list[PartitionSpec],
    mesh: Any,
    manual_axes: frozenset[Any],
    has_reduce: bool,
) -> None:
    value_paths = [p for p, m in zip(out_spec.paths, out_spec.value_mask, strict=True) if m]
    for path, aval, pspec in zip(value_paths, out_spec.avals, out_specs, strict=True):
        varying = _compat.varying_axes(aval) & manual_axes
        unmentioned = varying - _spec_axes(pspec)
        if unmentioned:
            axes = _in_mesh_order(mesh, unmentioned)
            hint = (
                "reduce_ctx returned it still varying" if has_reduce else "no reduce_ctx was given"
            )
            raise ValueError(
                f"Context leaf ctx{keystr(path)} ({aval.str_short()}) differs between the "
                f"shards of mesh axes {axes} when it leaves the shard_map ({where(eqn)}), "
                f"but its out-spec {pspec} says it is replicated over them ({hint}). "
                + _replication_fixes(out_spec, path, aval, mesh, axes, varying)
            )


def _replication_fixes(
    out_spec: CtxSpec,
    path: Any,
    aval: Any,
    mesh: Any,
    axes: tuple[Any, ...],
    varying: frozenset[Any],
) -> str:
    """The two ways out for a leaf that varies over `axes`, as the options to give
    `functools.partial(default_shard_map_handler, ...)`. Written for this leaf alone
    when the context has others: a `psum` of a replicated leaf would multiply it by
    the number of shards."""
    reduce = _for_leaf(out_spec, path, f"jax.lax.psum(v, {axes!r})", "v")
    sharded_axes = _in_mesh_order(mesh, varying)
    specs = f"PartitionSpec({sharded_axes!r})"
    if out_spec.treedef.num_leaves > 1:
        specs = _for_leaf(out_spec, path, specs, "PartitionSpec()")
    num_shards = math.prod(mesh.shape[name] for name in sharded_axes)
    if aval.ndim == 0:
        keep = (
            f"or keep one value per shard: a scalar has no dimension to shard, so give it "
            f"a leading axis in reduce_ctx and shard that, with "
            f"`reduce_ctx=lambda ctx: {_for_leaf(out_spec, path, 'v[None]', 'v')}` and "
            f"`declare_ctx_out_specs=lambda ctx: {specs}`; it then leaves with shape "
            f"({num_shards},), entry i from shard i"
        )
    else:
        keep = (
            f"or keep one value per shard: declare it sharded, with "
            f"`declare_ctx_out_specs=lambda ctx: {specs}`; the shards' values are then "
            f"concatenated along dimension 0"
        )
    return (
        f"Reduce it across the shards in reduce_ctx, for example with "
        f"`reduce_ctx=lambda ctx: {reduce}` (this sums the value the leaf entered the "
        f"body with too, once per shard: right when it enters as zero; for a leaf that "
        f"may enter with a value, see 'Reduce it' in docs/concepts/shard-map.md); "
        f"{keep}. Pass these options with functools.partial(default_shard_map_handler, "
        f"...)."
    )
