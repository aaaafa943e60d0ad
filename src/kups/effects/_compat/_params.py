"""The parameters of the control-flow primitives, which move between JAX
releases (`scan`'s layout in 0.11, `shard_map`'s manual axes in 0.10.2).

Each helper serves JAX 0.10.0 to 0.12.x, the releases kups supports, where it
reads a `jax._src` symbol or a parameter whose name or shape differs between
them; a helper that serves fewer releases names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import shard_map as _shard_map_impl
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import ClosedJaxpr, Jaxpr

from ._core import bind_equation

# ---------------------------------------------------------------------------
# Parameters of control-flow primitives.
# ---------------------------------------------------------------------------


# The parameters each control-flow primitive carries in the JAX releases kups
# supports (0.10.0 to 0.12.x), by name: what its handler reads, rebuilds or passes
# on. A parameter outside this table is one kups has never seen, so re-binding the
# equation might drop or misread it: `check_params` stops there instead.
KNOWN_PARAMS: dict[str, frozenset[str]] = {
    "jit": frozenset(
        {
            "jaxpr",
            "in_shardings",
            "out_shardings",
            "in_layouts",
            "out_layouts",
            "donated_invars",
            "ctx_mesh",
            "name",
            "keep_unused",
            "inline",
            "compiler_options_kvs",
        }
    ),
    # `num_consts`/`num_carry` up to JAX 0.10; `ft_in`/`ft_out` from 0.11.
    "scan": frozenset(
        {"jaxpr", "length", "reverse", "unroll", "num_consts", "num_carry", "ft_in", "ft_out"}
    ),
    "while": frozenset({"cond_jaxpr", "cond_nconsts", "body_jaxpr", "body_nconsts"}),
    # `branches_platforms` on a `lax.platform_dependent` cond (one branch per platform).
    "cond": frozenset({"branches", "branches_platforms"}),
    "remat2": frozenset({"jaxpr", "prevent_cse", "differentiated", "policy"}),
    "custom_jvp_call": frozenset({"call_jaxpr", "jvp_jaxpr_fun", "num_consts", "symbolic_zeros"}),
    "custom_vjp_call": frozenset(
        {"call_jaxpr", "fwd_jaxpr_thunk", "num_consts", "bwd", "out_trees", "symbolic_zeros"}
    ),
    # `manual_axes` before JAX 0.10.2, `newly_manual_axes` from it.
    "shard_map": frozenset(
        {"jaxpr", "mesh", "in_specs", "out_specs", "check_vma", "manual_axes", "newly_manual_axes"}
    ),
    "custom_linear_solve": frozenset({"const_lengths", "jaxprs"}),
    "closed_call": frozenset({"call_jaxpr"}),
    # A call of a jaxpr, new in JAX 0.11 (what `closed_call` and custom rules emit).
    "eval_jaxpr": frozenset({"call_jaxpr"}),
    # `lax.composite`: its decomposition is `jaxpr` up to JAX 0.10, `call_jaxpr` after.
    "composite": frozenset({"name", "attributes", "version", "jaxpr", "call_jaxpr"}),
    # The forward pass of a `custom_vjp` declared with `optimize_remat=True`, as
    # differentiation stages it (the same in JAX 0.10.0 to 0.12.0.1).
    "remat_opt": frozenset({"num_consts", "num_res", "fwd_jaxpr", "fun_jaxpr_thunk"}),
    # `jax.custom_batching.custom_vmap` (the same in JAX 0.10.0 to 0.12.0.1).
    "custom_vmap_call": frozenset({"call", "rule", "in_tree", "out_tree"}),
    # `custom_partitioning` is deliberately absent: it has no handler (its
    # partitioning rule runs when XLA compiles, out of any interpreter's reach), and
    # a JAX primitive listed here with no handler goes to the interpreter's policy
    # even when nothing inside it is touched. Unlisted, it is re-bound quietly
    # unless a handler would see something inside it.
}


def scan_layout(params: dict[str, Any]) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a scan equation; the xs follow the carries.

    Up to JAX 0.10 the equation says so in `num_consts` and `num_carry`; from
    JAX 0.11 on, `ft_in` groups the inputs as `(consts, carry, xs)` flat trees.
    """
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


def scan_params(
    params: dict[str, Any], *, jaxpr: ClosedJaxpr, num_consts: int, num_carry: int
) -> dict[str, Any]:
    """Scan parameters for a new body that takes `num_consts` consts and
    `num_carry` carries, of which the ones beyond the equation's own are leading
    (a handler's consts and context carries), and returns extra stacked outputs
    after the equation's own.

    JAX 0.10 counts them in `num_consts`/`num_carry` (and before 0.10 also had
    `linear`). From JAX 0.11 on, `ft_in` = `(consts, carry, xs)` and `ft_out` =
    `(carry, ys)` are flat trees; the equation's own groups are kept as they are
    (`ys` may be filtered: outputs JAX forwards from `xs` around the scan), with
    the extra entries beside them.
    """
    new = dict(params, jaxpr=jaxpr)
    if "ft_in" not in params:
        new.update(num_consts=num_consts, num_carry=num_carry)
        if "linear" in new:  # JAX < 0.10
            new["linear"] = (False,) * len(jaxpr.in_avals)
        return new
    from jax._src import flattree as _flattree  # pyright: ignore[reportAttributeAccessIssue]

    def prepend(extra: int, group: Any) -> Any:
        return _flattree.pack((_flattree.nones(extra), group)) if extra else group

    consts_group, carry_group, xs_group = params["ft_in"].unpack()
    carry_out_group, ys_group = params["ft_out"].unpack()
    extra_consts, extra_carry = num_consts - len(consts_group), num_carry - len(carry_group)
    extra_ys = len(jaxpr.out_avals) - num_carry - len(ys_group)
    if min(extra_consts, extra_carry, extra_ys) < 0:
        raise AssertionError("kups: a rebuilt scan lost consts, carries or outputs")
    new["ft_in"] = _flattree.pack(
        (prepend(extra_consts, consts_group), prepend(extra_carry, carry_group), xs_group)
    )
    ys = _flattree.pack((ys_group, _flattree.nones(extra_ys))) if extra_ys else ys_group
    new["ft_out"] = _flattree.pack((prepend(extra_carry, carry_out_group), ys))
    return new


def cond_params(params: dict[str, Any], *, branches: tuple[ClosedJaxpr, ...]) -> dict[str, Any]:
    """Cond parameters for new branches. JAX < 0.10 also carried `linear`."""
    new = dict(params, branches=branches)
    if "linear" in new:
        new["linear"] = (False,) * (len(branches[0].in_avals))
    return new


def shard_map_manual_axes(params: dict[str, Any]) -> frozenset[Any]:
    """The axes a shard_map equation makes manual: `newly_manual_axes` from JAX 0.10.2,
    `manual_axes` before."""
    if "newly_manual_axes" in params:
        return frozenset(params["newly_manual_axes"])
    return frozenset(params["manual_axes"])


def shard_map_params(
    params: dict[str, Any], *, jaxpr: Jaxpr, in_specs: tuple[Any, ...], out_specs: tuple[Any, ...]
) -> dict[str, Any]:
    return dict(params, jaxpr=jaxpr, in_specs=in_specs, out_specs=out_specs)


def bind_shard_map(primitive: Any, params: dict[str, Any], invals: Sequence[Any]) -> list[Any]:
    """Binds a `shard_map` whose body is already an (interpreted) jaxpr.

    While staging (under `jit` or inside another body being traced), the equation
    is emitted as it is. `bind` would turn the body back into a function and trace
    it again, and every shard_map nested in it again with it: quadratic in the
    nesting depth. JAX 0.10.2's staging rule is followed (the `newly_manual_axes`
    signature); elsewhere, and where the outputs' varying axes do not fit their
    specs (so that JAX raises its own error), this is `bind_equation`.
    """
    trace = _core.trace_ctx.trace
    jaxpr = params["jaxpr"]
    if (
        not isinstance(trace, _pe.DynamicJaxprTrace)
        or trace.requires_low
        or "newly_manual_axes" not in params
        or jaxpr.constvars
        or jaxpr.is_high
    ):
        return bind_equation(primitive, params, invals)
    mesh, check_vma, out_specs = params["mesh"], params["check_vma"], params["out_specs"]
    inner_avals = [v.aval for v in jaxpr.outvars]
    if check_vma and not all(
        _shard_map_impl._valid_repeats(mesh, aval.mat, spec)
        for spec, aval in zip(out_specs, inner_avals, strict=True)
    ):
        return bind_equation(primitive, params, invals)
    out_avals = [
        _core.unshard_aval(mesh, check_vma, spec, aval)
        for spec, aval in zip(out_specs, inner_avals, strict=True)
    ]
    effects = _core.filter_named_axis_effects(_core.positional_effects(jaxpr), mesh.axis_names)
    source_info = _source_info_util.current()
    tracers = [
        trace.to_jaxpr_tracer(_dtypes.canonicalize_value(x), source_info=source_info)
        for x in invals
    ]
    return list(trace.emit_eqn(tracers, out_avals, primitive, params, effects, source_info))
