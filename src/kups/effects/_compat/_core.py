"""Basic adapters: JAX's types, binding an equation, source info and traceback
filtering, effect registration, and the trace state (JAX 0.10 to 0.12).

Each helper serves JAX 0.10.0 to 0.12.x, the releases kups supports, where it
reads a `jax._src` symbol or a parameter whose name or shape differs between
them; a helper that serves fewer releases names them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.extend
import jax.extend.core
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import Literal

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


def stage_unchanged(eqn: Any, invals: Sequence[Any]) -> list[Any] | None:
    """Emits `eqn` as it is into the jaxpr being staged, on `invals`: `None`
    (nothing emitted) unless staging and every input has the aval of the
    equation's own.

    With the same inputs' avals and parameters, `bind` would recompute the same
    outputs' avals, and a `shard_map` or custom-derivative equation would turn its
    jaxpr back into a function and trace it again (a second tracing of the body
    that the user's program never does). The equation's source info is the current
    one, as `bind` gives it. Equations with input effects (on references) and
    hijax primitives are left to `bind` (JAX 0.10 to 0.12: `emit_eqn` has one
    signature there).
    """
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace or trace.requires_low:
        return None
    if eqn.effects and any(isinstance(e, _effects.JaxprInputEffect) for e in eqn.effects):
        return None
    source_info = _source_info_util.current()
    tracers = []
    for x, v in zip(invals, eqn.invars, strict=True):
        if type(v) is Literal:
            x = trace.to_jaxpr_tracer(_dtypes.canonicalize_value(x), source_info)
        elif not (isinstance(x, _pe.DynamicJaxprTracer) and x._trace is trace):
            return None
        if x.aval != v.aval:
            return None
        tracers.append(x)
    if eqn.primitive.is_high(*(t.aval for t in tracers), **eqn.params):
        return None
    out_avals = [v.aval for v in eqn.outvars]
    outs = trace.emit_eqn(tracers, out_avals, eqn.primitive, eqn.params, eqn.effects, source_info)
    return list(outs)


def wrapped_in(fun: Any, around: Callable[[], Any]) -> Any:
    """The `linear_util.WrappedFun` `fun` (a `custom_vjp_call`'s `bwd` param, a
    `WrappedFun` in JAX 0.10 to 0.12) that runs inside the context `around()`."""

    def call(*args: Any) -> Any:
        with around():
            return fun.call_wrapped(*args)

    return _lu.wrap_init(call, debug_info=fun.debug_info)


# An equation runs under `user_context(eqn.source_info.traceback, name_stack=...)`
# and `eqn.ctx.manager`, as `jax.core.eval_jaxpr` runs it (JAX 0.10).
user_context = _source_info_util.user_context
current_name_stack = _source_info_util.current_name_stack


@contextlib.contextmanager
def without_traceback() -> Iterator[None]:
    """Traces inside with no current traceback, the name stack kept: equations
    then get the lines of the code that binds them, not those of an enclosing
    `user_context(traceback)` (which would replace them; JAX 0.10 to 0.12)."""
    previous = _source_info_util._source_info_context.context
    _source_info_util._source_info_context.context = _source_info_util.SourceInfo(
        None, previous.name_stack
    )
    try:
        yield
    finally:
        _source_info_util._source_info_context.context = previous


# The frames of a traceback that JAX counts as the user's (those of files not
# registered as excluded, as kups' are), innermost first (JAX 0.10 to 0.12).
user_frames = _source_info_util.user_frames

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


def register_recompute_rule(primitive: Any, rule: Callable[..., Any]) -> None:
    """Registers how `primitive` splits when JAX partially evaluates a jaxpr to
    rematerialise it (`jax.checkpoint`, and the bodies of `while_loop`s under
    differentiation): `rule(saveable, unknowns_in, instantiated_in, eqn) ->
    (known_eqn | None, staged_eqn | None, unknowns_out, instantiated_out,
    residuals)`, JAX's signature from 0.10 to 0.12."""
    _pe.partial_eval_jaxpr_custom_rules[primitive] = rule


def saved_by(policy: Any) -> bool:
    """Whether a rematerialisation policy's answer for an equation is "save its
    outputs" (`True`, or `Saveable`) rather than recompute or offload them."""
    return policy is True or type(policy).__name__ == "SaveableType"


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


def is_eager() -> bool:
    """Whether JAX evaluates eagerly here: no transformation is tracing (not even
    an eager `vmap`, `grad` or `shard_map` body)."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def used_inputs(jaxpr: Any, used_outputs: Sequence[bool]) -> list[bool]:
    """Which inputs of a const-free `jaxpr` the outputs marked in `used_outputs`
    are computed from, through its sub-programs (JAX's dead-code elimination;
    an equation with an effect keeps its inputs)."""
    _, used = _pe.dce_jaxpr(jaxpr, list(used_outputs))
    return list(used)


def in_eager_shard_map() -> bool:
    """Whether a `shard_map` body is running eagerly around this point (a trace of
    JAX's `ShardMapTrace` on the current trace's chain of parents)."""
    trace: Any = _core.trace_ctx.trace
    while trace is not None:
        if type(trace).__name__ == "ShardMapTrace":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


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


def former_primitive_names() -> dict[str, str]:
    """Names that older JAX releases gave a primitive, and the name this release
    gives it: `closed_call` and `call` became `eval_jaxpr` in JAX 0.11; `pjit`
    and `custom_vjp_call_jaxpr` were renamed before 0.10."""
    from jax.extend.core import primitives

    former = {"pjit": "jit", "custom_vjp_call_jaxpr": "custom_vjp_call"}
    for name, primitive in (("call", primitives.call_p), ("closed_call", primitives.closed_call_p)):
        if primitive.name != name:
            former[name] = primitive.name
    return former
