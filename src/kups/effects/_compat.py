"""Adapters for the JAX internals that kups needs and that move between releases.

Every read of a `jax._src` symbol, and every parameter name that differs between
JAX releases, lives here, each helper naming the releases it serves. The rest of
kups imports only public JAX and this module.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.extend
import jax.extend.core
from jax._src import api_util as _api_util
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import shard_map as _shard_map_impl
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
# The JAX releases kups is tested with (pyproject.toml declares the same range).
SUPPORTED_JAX = "0.10.0 to 0.12.x"

# `jit`'s marker for a sharding left to the compiler (in `sharding_impls` in every
# release kups supports; JAX 0.10 defines it in `named_sharding` and re-exports it).
UNSPECIFIED = _sharding_impls.UNSPECIFIED  # pyright: ignore[reportPrivateImportUsage]
Tracer = _core.Tracer
DropVar = _core.DropVar
ShapedArray = _core.ShapedArray


def is_literal(atom: Any) -> bool:
    return type(atom) is Literal


def aval_of(value: Any) -> Any:
    """The abstract value of a concrete array, a tracer or a Python scalar."""
    return jax.typeof(value)


# ---------------------------------------------------------------------------
# Binding an equation again.
# ---------------------------------------------------------------------------


def bind_equation(primitive: Any, params: dict[str, Any], invals: Sequence[Any]) -> list[Any]:
    """Binds `primitive` on `invals` with the parameters of a staged equation.

    `get_bind_params` turns staged parameters (jaxprs) into the callables `bind`
    expects. It returns a parameter dict holding `subfuns` from JAX 0.9.2 on; before
    that it returned a `(subfuns, params)` pair.
    """
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # JAX < 0.9.2
        subfuns, bind_params = bind_params
        out = primitive.bind(*subfuns, *invals, **bind_params)
    else:
        out = primitive.bind(*invals, **bind_params)
    return list(out) if primitive.multiple_results else [out]


# An equation runs under `user_context(eqn.source_info.traceback, name_stack=...)`
# and `eqn.ctx.manager`, as `jax.core.eval_jaxpr` runs it (JAX 0.10).
user_context = _source_info_util.user_context
current_name_stack = _source_info_util.current_name_stack


# kups' own frames are not the user's: an effect bound by `define_effect`'s
# `bind` (or by `kups.harvest.sow`) is attributed to the caller of kups.
_KUPS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


# The demo is a user program that ships inside the package: its lines are the
# user's lines.
_USER_FILES_IN_KUPS = frozenset({os.path.join(_KUPS_DIR, "_demo.py")})


def _is_kups_frame(file_name: str) -> bool:
    return file_name.startswith(_KUPS_DIR) and file_name not in _USER_FILES_IN_KUPS


def _user_frame(eqn: JaxprEqn) -> Any:
    frames = _source_info_util.user_frames(eqn.source_info.traceback)
    return next((f for f in frames if not _is_kups_frame(f.file_name)), None)


def _is_installed_library(file_name: str) -> bool:
    return any(part in file_name for part in _INSTALLED)


_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _show_frame(frame: Any) -> str:
    column = f":{frame.start_column}" if frame.start_column else ""
    return f"{frame.file_name}:{frame.start_line}{column} ({frame.function_name})"


def source_line(eqn: JaxprEqn) -> str:
    """`file.py:LINE (function)` of the user's code that produced `eqn`. When that
    line is in an installed library (an equinox primitive, a diffrax solver), the
    line of the user's own code that called into it follows: `lib.py:LINE (fn),
    called from user.py:LINE (fn)`."""
    frames = [
        f
        for f in _source_info_util.user_frames(eqn.source_info.traceback)
        if not _is_kups_frame(f.file_name)
    ]
    if not frames:
        return "unknown"
    shown = _show_frame(frames[0])
    if _is_installed_library(frames[0].file_name):
        caller = next((f for f in frames if not _is_installed_library(f.file_name)), None)
        if caller is not None:
            shown += f", called from {_show_frame(caller)}"
    return shown


def user_frames(eqn: JaxprEqn) -> list[tuple[str, int, str]]:
    """`(file, line, function)` of each user frame of `eqn`, innermost first, kups'
    own frames left out."""
    frames = _source_info_util.user_frames(eqn.source_info.traceback)
    return [
        (f.file_name, f.start_line, f.function_name)
        for f in frames
        if not _is_kups_frame(f.file_name)
    ]


def user_frame(eqn: JaxprEqn) -> tuple[str, int] | None:
    """`(file, line)` of the user's code that produced `eqn`, if known."""
    frame = _user_frame(eqn)
    if frame is None:
        return None
    return frame.file_name, frame.start_line


# ---------------------------------------------------------------------------
# Tracing a Python function to a jaxpr, inside whatever trace is current.
# ---------------------------------------------------------------------------


def trace_to_jaxpr(
    fn: Callable[..., Sequence[Any]], in_avals: Sequence[Any], name: str
) -> tuple[Jaxpr, list[Any], list[Any]]:
    """Traces `fn(*flat_args) -> flat_outs` on `in_avals`.

    Returns the jaxpr (with `constvars`), its consts and its output avals. Tracers
    of enclosing traces that `fn` closes over become consts. JAX 0.10 signature.
    """
    debug_info = _api_util.debug_info(name, fn, tuple(in_avals), {})
    wrapped = _lu.wrap_init(fn, debug_info=debug_info)
    jaxpr, out_avals, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, list(out_avals), list(consts)


def hoist_consts(jaxpr: Jaxpr) -> Jaxpr:
    """The same jaxpr with its constvars turned into leading invars."""
    return _pe.convert_constvars_jaxpr(jaxpr)


def new_closed_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, list(consts))


def close_over(
    jaxpr: Jaxpr, which: Sequence[bool], values: Sequence[Any]
) -> tuple[Jaxpr, list[Any]]:
    """`jaxpr` with those of its leading inputs that `which` marks turned into
    constvars, and their values, to be closed over (`new_closed_jaxpr`).

    A ClosedJaxpr's consts are constants to XLA (folded where it can); the same
    values passed as arguments are not. From JAX 0.11 a `Jaxpr` carries its
    consts itself; the constvars must lead its inputs in every release.
    """
    if not any(which):
        return jaxpr, []
    leading = jaxpr.invars[: len(which)]
    constvars = [v for v, c in zip(leading, which, strict=True) if c]
    rest = [v for v, c in zip(leading, which, strict=True) if not c]
    constants = [x for x, c in zip(values, which, strict=True) if c]
    new = replace_jaxpr(
        jaxpr, constvars=[*jaxpr.constvars, *constvars], invars=[*rest, *jaxpr.invars[len(which) :]]
    )
    return new, constants


def has_input_effects(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` has effects that name one of its inputs by position."""
    return any(isinstance(e, _effects.JaxprInputEffect) for e in jaxpr.effects)


def has_input_effects_any(jaxprs: Sequence[Jaxpr]) -> bool:
    return any(has_input_effects(jaxpr) for jaxpr in jaxprs)


def is_var(atom: Any) -> bool:
    return isinstance(atom, Var)


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


def check_params(eqn: JaxprEqn) -> None:
    """Raises if `eqn` carries a parameter that kups does not know for its primitive.

    A JAX release newer than the ones kups supports may add one; re-binding the
    equation without understanding it could change the program silently.
    """
    known = KNOWN_PARAMS.get(eqn.primitive.name)
    if known is None:
        return
    unknown = sorted(set(eqn.params) - known)
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise NotImplementedError(
            f"kups does not know the parameter(s) {names} of the control-flow primitive "
            f"'{eqn.primitive.name}' at {source_line(eqn)}, which JAX {jax.__version__} "
            f"gives it. kups supports JAX {SUPPORTED_JAX}, where '{eqn.primitive.name}' has "
            f"only {sorted(known)}; re-binding the equation without understanding "
            f"{names} could change your program, so kups stops here. Use a JAX release in "
            f"that range, or a kups release that supports JAX {jax.__version__}."
        )


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

    old_consts, old_carry = scan_layout(params)
    consts_group, carry_group, xs_group = params["ft_in"].unpack()
    carry_out_group, ys_group = params["ft_out"].unpack()
    extra_consts, extra_carry = num_consts - old_consts, num_carry - old_carry
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


_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
# Where a collective of JAX 0.10.2 to 0.12 keeps the axis names it was given, in
# the frames of the error it raises for an unbound one.
_AXIS_NAME_LOCALS = ("axis_name", "axis_names", "axes")
_UNBOUND_AXIS = re.compile(r"unbound axis name: (\S+?)\.?(?:\s|$)")


def axis_names_in_error(err: BaseException) -> list[str]:
    """The axis names JAX was handling when it raised `err`: the collective's
    arguments in JAX's own frames, and the name in an 'unbound axis name' message."""
    names: list[Any] = []
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(_JAX_DIR):
            for local in _AXIS_NAME_LOCALS:
                value = frame.f_locals.get(local)
                names.extend(value if isinstance(value, (tuple, list)) else (value,))
        tb = tb.tb_next
    names.extend(_UNBOUND_AXIS.findall(str(err)))
    return list(dict.fromkeys(name for name in names if isinstance(name, str)))


def equation_mesh(eqn: JaxprEqn) -> Any:
    """The abstract mesh an equation was traced under (`jax.set_mesh`, and the
    Auto or Explicit variant of it inside `auto_axes` / `explicit_axes`)."""
    return eqn.ctx.cur_abstract_mesh


def current_mesh() -> Any:
    return jax.sharding.get_abstract_mesh()


def drops_manual_axes(eqn_mesh: Any, mesh: Any) -> bool:
    """Whether `eqn_mesh` is `mesh` with some of its Manual axes not Manual: an
    equation JAX staged inside a `shard_map` body under the enclosing mesh (the
    zeros of the gradient of a value the body closes over). From JAX 0.11 such an
    equation binds as well under the body's mesh, where a handler's operations on
    a context typed for the manual mesh are accepted; JAX 0.10 checks the
    equation's own sharding against the mesh in effect, so there it stays under
    its own (and a handler cannot update the context in it)."""
    if JAX_VERSION < (0, 11) or eqn_mesh is mesh or eqn_mesh.empty or mesh.empty:
        return False
    if eqn_mesh.axis_names != mesh.axis_names or eqn_mesh.axis_sizes != mesh.axis_sizes:
        return False
    manual = jax.sharding.AxisType.Manual
    return any(
        kind == manual and eqn_kind != manual
        for kind, eqn_kind in zip(mesh.axis_types, eqn_mesh.axis_types, strict=True)
    )


def abstract_mesh(mesh: Any) -> Any:
    """A context manager that puts `mesh` in effect as the abstract mesh."""
    return jax.sharding.use_abstract_mesh(mesh)


def typed_mesh(value: Any) -> Any:
    """The (non-empty) mesh an array's type names in its sharding, or `None`."""
    if not isinstance(value, (jax.Array, Tracer)):
        return None
    mesh = getattr(getattr(jax.typeof(value), "sharding", None), "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def values_mesh(eqn: JaxprEqn) -> Any:
    """The (non-empty) mesh the outputs (or else the inputs) of `eqn` are typed
    for, or `None`."""
    for var in (*eqn.outvars, *eqn.invars):
        sharding = getattr(getattr(var, "aval", None), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def retype_for_mesh(value: Any, mesh: Any) -> Any:
    """`value`, typed for `mesh` when its sharding is typed for another variant of
    it: the same axes with Auto and Explicit types swapped, as inside
    `jax.sharding.auto_axes` and `explicit_axes` (JAX rejects an operation whose
    operands are typed for a mesh other than the one in effect). Other values are
    returned as they are."""
    if mesh.empty or not isinstance(value, (jax.Array, Tracer)):
        return value
    sharding = getattr(jax.typeof(value), "sharding", None)
    value_mesh = getattr(sharding, "mesh", None)
    if (
        value_mesh is None
        or value_mesh.empty
        or value_mesh == mesh
        or value_mesh.axis_names != mesh.axis_names
        or value_mesh.axis_sizes != mesh.axis_sizes
    ):
        return value
    manual = jax.sharding.AxisType.Manual
    if manual in value_mesh.axis_types or manual in mesh.axis_types:
        return value
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }

    def keep(entry: Any) -> Any:
        names = entry if isinstance(entry, tuple) else (entry,)
        return entry if entry is not None and set(names) <= explicit else None

    spec = jax.sharding.PartitionSpec(*(keep(entry) for entry in sharding.spec))  # pyright: ignore[reportOptionalMemberAccess]
    if not isinstance(value, Tracer):
        # Eagerly, an array on devices: the same devices, typed the other way.
        devices = getattr(getattr(value.sharding, "mesh", None), "devices", None)
        if devices is None:
            return value
        concrete = jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        return jax.device_put(value, jax.sharding.NamedSharding(concrete, spec))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.reshard(value, spec)


def reshard_to_spec(value: Any, mesh: Any, spec: Any) -> Any:
    """A traced `value` typed for `mesh` (explicit sharding), resharded to `spec`
    when its type says otherwise; other values as they are."""
    value_mesh = typed_mesh(value)
    if value_mesh is None or value_mesh.axis_names != mesh.axis_names:
        return value
    have = tuple(jax.typeof(value).sharding.spec)
    want = tuple(spec)
    pad = (None,) * max(0, len(have) - len(want))
    if have == want + pad:
        return value
    with jax.sharding.use_abstract_mesh(value_mesh):
        return jax.reshard(value, spec)


def shard_aval(
    mesh: Any, manual_axes: frozenset[Any], check_vma: bool, spec: Any, aval: Any
) -> Any:
    """The per-shard aval of a global `aval` entering a shard_map with `spec`."""
    return _core.shard_aval(mesh, manual_axes, check_vma, spec, aval)


@contextlib.contextmanager
def manual_axis_scope(mesh: Any, manual_axes: frozenset[Any], check_vma: bool) -> Iterator[None]:
    """The environment a shard_map body is traced in: the manual axes bound, the
    abstract mesh with them manual, and `check_vma` set. JAX 0.10."""
    from jax._src import config as _config
    from jax._src import shard_map as _shard_map

    inner_mesh = _shard_map._as_manual_mesh(mesh, manual_axes)
    with (
        _shard_map._extend_axis_env(mesh, manual_axes),
        jax.sharding.use_abstract_mesh(inner_mesh),
        _config._check_vma(check_vma),
    ):
        yield


def varying_axes(aval: Any) -> frozenset[Any]:
    """The manual mesh axes over which a value may differ between shards.

    JAX 0.10 keeps them in `aval.mat.varying`; earlier releases in `aval.vma`.
    """
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def shape_dtype_struct(aval: Any) -> jax.ShapeDtypeStruct:
    """A `ShapeDtypeStruct` with the shape, dtype, sharding and manual axes of `aval`."""
    mat = getattr(aval, "mat", None)
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and sharding.mesh.empty:
        sharding = None
    return jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        sharding=sharding,
        weak_type=aval.weak_type,
        manual_axis_type=None if mat is None or mat.empty else mat,
    )


def jaxprs_in_params(params: dict[str, Any]) -> list[Jaxpr]:
    return list(jax.extend.core.jaxprs_in_params(params))


def jaxpr_like(original: Jaxpr | ClosedJaxpr, jaxpr: Jaxpr) -> Jaxpr | ClosedJaxpr:
    """A const-free `jaxpr` in the form a parameter held `original`: a `ClosedJaxpr`
    up to JAX 0.10, an open `Jaxpr` for some parameters from JAX 0.11 on
    (`custom_vmap_call`'s `call`, `remat_opt`'s `fwd_jaxpr`)."""
    if isinstance(original, ClosedJaxpr):
        return new_closed_jaxpr(jaxpr, ())
    return jaxpr


def new_jaxpr(
    invars: Sequence[Var], outvars: Sequence[Var], eqns: Sequence[JaxprEqn], name: str
) -> Jaxpr:
    """A const-free, effect-free jaxpr of existing equations, described as `name`."""
    info = _lu.DebugInfo("kups", name, ("",) * len(invars), ("",) * len(outvars))
    return Jaxpr((), list(invars), list(outvars), list(eqns), _core.no_effects, info)


@functools.cache
def _call_template() -> JaxprEqn:
    """A `jit` equation with two inputs and three outputs, whose parameters
    `call_jaxpr` adapts (traced once, so that no parameter name is spelled here)."""
    return jax.make_jaxpr(jax.jit(lambda a, b: (a, a + b, b)))(1.0, 2.0).eqns[0]


def call_jaxpr(jaxpr: Jaxpr, invals: Sequence[Any], name: str) -> list[Any]:
    """Binds a const-free, effect-free `jaxpr` as one `jit` equation named `name`,
    with no sharding, layout or donation of its own, in the abstract mesh in
    effect (the `jit` primitive's parameters are those of JAX 0.10 to 0.12)."""
    template = _call_template()
    n_in, n_out = len(jaxpr.invars), len(jaxpr.outvars)
    params: dict[str, Any] = {}
    for key, value in template.params.items():
        if isinstance(value, tuple) and len(value) == 2:  # one entry per input
            value = (value[0],) * n_in
        elif isinstance(value, tuple) and len(value) == 3:  # one entry per output
            value = (value[0],) * n_out
        params[key] = value
    params["jaxpr"] = jaxpr_like(template.params["jaxpr"], jaxpr)
    params["name"] = name
    if "ctx_mesh" in params:
        params["ctx_mesh"] = current_mesh()
    return list(template.primitive.bind(*invals, **params))


def open_jaxpr(jaxpr: Jaxpr | ClosedJaxpr) -> tuple[Jaxpr, Sequence[Any]]:
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def remat_primitive() -> Any:
    return jax.extend.core.primitives.remat_p


def symbolic_zero_type() -> type:
    return jax.custom_derivatives.SymbolicZero


def eval_jaxpr(jaxpr: Jaxpr, args: Sequence[Any]) -> list[Any]:
    """Evaluates a const-free jaxpr by re-binding its equations."""
    return list(_core.eval_jaxpr(jaxpr, (), *args))


def new_var(aval: Any) -> Var:
    return Var(aval)


def replace_jaxpr(jaxpr: Jaxpr, **kwargs: Any) -> Jaxpr:
    """`jaxpr` with some of `invars`, `outvars`, `constvars` replaced.

    `Jaxpr.replace` forgets the argument names when the binders change
    (`arg_names=None`). JAX 0.10.0's while-loop JVP rule appends to those names and
    fails on `None`, so give every binder an empty name instead.
    """
    new = jaxpr.replace(**kwargs)
    info = new.debug_info
    if info is not None and info.arg_names is None:
        new = new.replace(debug_info=info._replace(arg_names=("",) * len(new.invars)))
    return new


# ---------------------------------------------------------------------------
# Effect primitives.
# ---------------------------------------------------------------------------


def register_effect_type(effect_type: type[Any]) -> None:
    """Declares an effect type to JAX as unordered, lowerable, and allowed (and
    kept) everywhere a transformation might otherwise reject or drop it.

    Serves JAX 0.10.2. The effect type is *not* added to
    `effects.ordered_effects`: unordered effects need no runtime tokens, so the
    compiled program is the same as without the effect.

    - `lowerable_effects`: `jit` refuses to lower jaxprs with other effects.
    - `control_flow_allowed_effects`: `scan`, `while_loop`, `cond` reject
      bodies with other effects.
    - `remat_allowed_effects`: `jax.checkpoint` rejects bodies with other
      effects.
    - `custom_derivatives_allowed_effects`: `custom_jvp`/`custom_vjp` reject
      bodies with other effects.
    - `partial_eval_kept_effects`: on JAX 0.10.2, partial evaluation under
      `jax.grad` drops an effect whose outputs are unused inside a `scan` (and
      `jit`, `compute_on`) body unless its type is in this table.

    **Arguments:**

    - `effect_type`: a subclass of `jax.extend.core.Effect`.

    **Returns:**

    Nothing; JAX's global effect tables are updated in place.
    """
    for table in (
        _effects.lowerable_effects,
        _effects.control_flow_allowed_effects,
        _effects.remat_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.partial_eval_kept_effects,
    ):
        table.add_type(effect_type)


# ---------------------------------------------------------------------------
# Traceback filtering and trace state (JAX 0.10 to 0.12).
#
# JAX removes its own frames from the traceback of an error that crosses one of
# its API boundaries (`jax.jit`, `jax.grad`, ...), unless
# `JAX_TRACEBACK_FILTERING=off`. kups joins that mechanism: its frames are
# registered as JAX's are, and its entry points are API boundaries.
# ---------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


def register_traceback_exclusion(path: str) -> None:
    """Hides frames of files under `path` (a file or a directory ending in the path
    separator) from filtered tracebacks, as JAX hides its own."""
    _traceback_util.register_exclusion(path)


def api_boundary(fn: _F) -> _F:
    """`fn`, below which tracebacks are filtered (JAX's `api_boundary`)."""
    return _traceback_util.api_boundary(fn)


def is_staging() -> bool:
    """Whether the current trace stages a jaxpr (`jax.jit`, `make_jaxpr`, a control
    flow body) rather than evaluating eagerly or differentiating concrete values."""
    return isinstance(_core.trace_ctx.trace, _pe.DynamicJaxprTrace)


def adopt_debug_info(fn: Callable[..., Any], debug_info: Any) -> None:
    """Makes JAX describe `fn` (in jaxprs and error messages) by `debug_info`, the
    `DebugInfo` of the user's function `fn` stands in for, without its argument
    names and result paths (which belong to the user's signature, not `fn`'s).

    `jax._src.api_util.debug_info` reads the `__fun_debug_info__` attribute first
    (JAX 0.10 to 0.12); elsewhere `fn` keeps only the user's name.
    """
    replace = getattr(debug_info, "_replace", None)
    fields = getattr(debug_info, "_fields", ())
    if replace is not None and {"arg_names", "result_paths"} <= set(fields):
        fn.__fun_debug_info__ = replace(arg_names=None, result_paths=None)  # pyright: ignore[reportFunctionMemberAccess]


# ---------------------------------------------------------------------------
# Avals that differ only where JAX's own type check does not look.
# ---------------------------------------------------------------------------


def aval_match_key(aval: Any) -> Any:
    """`aval` without its sharding: what `typematch` always compares (shape,
    dtype, manual axis types, memory space), with the weak type (which decides
    type promotion) and the layout, where avals carry one. Avals of other kinds
    are their own key."""
    if not isinstance(aval, _core.ShapedArray):
        return aval
    return (
        type(aval),
        aval.shape,
        aval.dtype,
        aval.weak_type,
        getattr(aval, "mat", None),
        getattr(aval, "memory_space", None),
        getattr(aval, "layout", None),
    )


def typematch(a: Any, b: Any) -> bool:
    """JAX's type check between avals: it compares shardings only when both carry
    a mesh and one of them has an explicit axis."""
    return _core.typematch(a, b)
