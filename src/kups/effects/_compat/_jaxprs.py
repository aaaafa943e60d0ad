"""Tracing functions to jaxprs and building jaxprs (JAX 0.10 to 0.12).

Each helper serves JAX 0.10.0 to 0.12.x, the releases kups supports, where it
reads a `jax._src` symbol or a parameter whose name or shape differs between
them; a helper that serves fewer releases names them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
import jax.extend.core
from jax._src import api_util as _api_util
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from ._meshes import current_mesh

# ---------------------------------------------------------------------------
# Tracing a Python function to a jaxpr, inside whatever trace is current.
# ---------------------------------------------------------------------------


def trace_to_jaxpr(
    fn: Callable[..., Sequence[Any]],
    in_avals: Sequence[Any],
    name: str,
    source: Callable[..., Any] | None = None,
) -> tuple[Jaxpr, list[Any], list[Any]]:
    """Traces `fn(*flat_args) -> flat_outs` on `in_avals`.

    Returns the jaxpr (with `constvars`), its consts and its output avals. Tracers
    of enclosing traces that `fn` closes over become consts. JAX's messages about
    the trace name `source` (by default `fn`) by its file and line; the flat
    arguments have no names (reading `fn`'s signature for them costs more than
    small programs take to trace). JAX 0.10 signature.
    """
    debug_info = _core.DebugInfo(
        name, _api_util.fun_sourceinfo(source or fn), None, _core.initial_result_paths
    )
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


def is_high_equation(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is one that JAX lowers to other equations before compiling
    (a "hijax" primitive, such as JAX 0.12's `jnp.nonzero(..., size=)`): a jaxpr
    built of equations must then say so (`is_high`) for JAX to lower it."""
    is_high = getattr(eqn.primitive, "is_high", None)
    return bool(is_high is not None and is_high(*(v.aval for v in eqn.invars), **eqn.params))


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


def unmemoized_rules(params: dict[str, Any]) -> dict[str, Any]:
    """`custom_jvp_call` or `custom_vjp_call` params whose JVP rule or `fwd` is
    traced afresh each time JAX runs it. A staged equation of either keeps its
    traced rule in a memo (`jvp_jaxpr_fun` and `fwd_jaxpr_thunk`, `pe._memoize`d
    thunks, JAX 0.10 to 0.12), shared by every bind of that equation (a `jit` or
    `jax.checkpoint` body is traced once and cached): a rule traced under a
    changed differentiation rule must neither take an earlier trace from it nor
    leave its own there. A param of another form is left as it is."""
    fresh = dict(params)
    for key in ("jvp_jaxpr_fun", "fwd_jaxpr_thunk"):
        fun: Any = params.get(key)
        memoized: Any = getattr(fun, "f", None)
        code = getattr(memoized, "__code__", None)
        if code is None or code.co_name != "memoized" or getattr(fun, "transforms", None):
            continue
        cells = dict(zip(code.co_freevars, memoized.__closure__ or (), strict=True))
        if "fn" in cells:
            fresh[key] = _lu.wrap_init(cells["fn"].cell_contents, debug_info=fun.debug_info)
    return fresh


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
    if "debug_info" not in kwargs and "constvars" not in kwargs and not jaxpr.constvars:
        # The names `Jaxpr.replace` would give, fixed up front: one new jaxpr, not two.
        info = jaxpr.debug_info
        invars = kwargs.get("invars", jaxpr.invars)
        if info is not None:
            if invars != jaxpr.invars or kwargs.get("outvars", jaxpr.outvars) != jaxpr.outvars:
                info = info.with_unknown_names()
            if info.arg_names is None:
                info = info._replace(arg_names=("",) * len(invars))
            return jaxpr.replace(**kwargs, debug_info=info)
    new = jaxpr.replace(**kwargs)
    info = new.debug_info
    if info is not None and info.arg_names is None:
        new = new.replace(debug_info=info._replace(arg_names=("",) * len(new.invars)))
    return new
