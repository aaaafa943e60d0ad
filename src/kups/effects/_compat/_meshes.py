"""Meshes, manual axes and shardings: how JAX types them moves between releases.

Each helper serves JAX 0.10.0 to 0.12.x, the releases kups supports, where it
reads a `jax._src` symbol or a parameter whose name or shape differs between
them; a helper that serves fewer releases names them.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend
import jax.extend.core
from jax._src import config as _config
from jax._src import core as _core
from jax.extend.core import JaxprEqn

from ._core import JAX_VERSION, Tracer

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
    ctx = eqn.ctx
    if hasattr(ctx, "cur_abstract_mesh"):  # JAX 0.10.0 to 0.12.0.1
        return ctx.cur_abstract_mesh
    # JAX 0.12.1: the context keeps the configs it captured, by name.
    names = _config.jaxpr_eqn_ctx_names()  # pyright: ignore[reportAttributeAccessIssue]
    return ctx.configs[names.index("abstract_mesh_context_manager")]


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
