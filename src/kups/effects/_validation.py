"""What the interpreter checks: its arguments, the results of handlers, and the
parameters of the control-flow equations handlers re-bind."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from . import _compat, _source
from ._context import leaked_static_paths
from ._source import where


def check_arguments(label: str, closed_jaxpr: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """`(jaxpr, consts)` of `closed_jaxpr`, after checking that it is a jaxpr and
    that `args` has one value per input."""
    if not isinstance(closed_jaxpr, (ClosedJaxpr, Jaxpr)):
        raise TypeError(_not_a_jaxpr(label, closed_jaxpr))
    jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
    if len(args) != len(jaxpr.invars):
        raise TypeError(
            f"{label or 'Interpreter'}: the jaxpr takes {len(jaxpr.invars)} "
            f"inputs, got {len(args)} arguments."
        )
    return jaxpr, consts


def in_handler(err: Exception, handler: Any, eqn: JaxprEqn, ctx: Any) -> Exception | None:
    """`err`, raised by the user's code in `handler` (the handler itself, or a hook
    it calls such as `reduce_ctx`) for `eqn`, as an exception of the same type
    whose message adds which handler, which equation and what the context was
    (`err` is its cause); `None` for an error of kups' own, which already says
    where, or one that was given this context already. An exception type that
    is not made from a message (JAX's `TracerBoolConversionError` takes the
    tracer) gets the same words as a note, and `None` is returned: the caller
    raises `err` itself."""
    if getattr(err, "_kups_context", False):
        return None
    raised_at = _user_line(err)
    mismatch = raised_at is None and _called_with_wrong_arguments(err)
    if raised_at is None and not mismatch:
        return None
    hooks = ""
    if isinstance(handler, functools.partial) and handler.keywords:
        hooks = f" (with {', '.join(f'{k}=' for k in handler.keywords)})"
    tracer_error = isinstance(err, jax.errors.ConcretizationTypeError)
    if mismatch:
        wrong = TypeError(
            f"{err}\n\nkups: the handler {handler_name(handler)}{hooks} for the "
            f"{where(eqn)}, or a function given to it, was called with arguments it does "
            f"not take. A handler is called as handler(interpreter, ctx, eqn, invals) and "
            f"returns a HandlerResult(ctx, outvals); the hooks of the default handlers "
            f"(initializer, updater, reduce_ctx, ...) take what their docs say."
        )
        wrong._kups_context = True  # pyright: ignore[reportAttributeAccessIssue]
        return wrong
    if tracer_error:
        advice = (
            "Inside a loop, a cond or a jit call (and anywhere under a transformation) a "
            "handler runs while that body is traced: the context's arrays and the values "
            "are tracers there, which Python's `if`, `bool()` and `int()` cannot read. "
            "Compute on them with jnp.where or lax.cond instead."
        )
    else:
        advice = (
            "A handler receives the context as it was given to the interpreted function "
            "(or as the previous handler returned it): check that it has the structure "
            "your handler and its hooks expect."
        )
    message = (
        f"{err}\n\nkups: raised at {raised_at}, in the handler {handler_name(handler)}"
        f"{hooks} for the {where(eqn)}, called with the context {_describe(ctx)}. {advice}"
    )
    error_type: type[Exception] = type(err)
    wrapped = None
    if not tracer_error:  # those are made from the tracer
        # A type that takes other arguments than a message gets a note instead.
        with contextlib.suppress(Exception):
            wrapped = error_type(message)
    if wrapped is None:
        err.add_note(message[len(str(err)) :].lstrip("\n"))
        err._kups_context = True  # pyright: ignore[reportAttributeAccessIssue]
        return None
    wrapped._kups_context = True  # pyright: ignore[reportAttributeAccessIssue]
    return wrapped


# How Python words a call with arguments the function does not take.
_MISMATCH_WORDS = (
    "positional argument",
    "unexpected keyword argument",
    "required keyword-only argument",
    "multiple values for argument",
)


def _called_with_wrong_arguments(err: BaseException) -> bool:
    """Whether `err` is the `TypeError` of a call, from kups' own code, of a
    function given to it (a handler, a hook) with arguments it does not take:
    raised by the call itself, so that no frame of the function is in its
    traceback."""
    if not isinstance(err, TypeError) or not any(w in str(err) for w in _MISMATCH_WORDS):
        return False
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _source.is_library_file(tb.tb_frame.f_code.co_filename)


def _user_line(err: BaseException) -> str | None:
    """`file:LINE (function)` of the innermost frame of `err` outside installed
    libraries (JAX, NumPy) when it is the user's; `None` when it is kups'."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    for code, line in reversed(frames):
        if _source.is_library_file(code.co_filename):
            return None
        if not _source.is_installed_library(code.co_filename):
            return f"{code.co_filename}:{line} ({code.co_name})"
    return None


def _describe(ctx: Any) -> str:
    """A short description of a context: its leaves' types in its structure."""
    if _is_array(ctx):
        return f"{_compat.aval_of(ctx).str_short(short_dtypes=True)} (an array)"
    shown = repr(
        jax.tree.map(
            lambda leaf: (
                _Shown(_compat.aval_of(leaf).str_short(short_dtypes=True))
                if _is_array(leaf)
                else leaf
            ),
            ctx,
        )
    )
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return f"{shown} (of type {type(ctx).__name__})"


class _Shown(str):
    def __repr__(self) -> str:
        return str(self)


def _is_array(leaf: Any) -> bool:
    try:
        _compat.aval_of(leaf)
    except TypeError:
        return False
    return hasattr(leaf, "shape")


def checked_result(handler: Any, eqn: JaxprEqn, result: Any) -> tuple[Any, list[Any]]:
    """`(ctx, outvals)` of what `handler` returned for `eqn`, after checking that it
    is a `HandlerResult` with one value of the right type per output."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"The handler {handler_name(handler)} for {where(eqn)} returned "
            f"{type(result).__name__}; a handler returns HandlerResult(ctx, outvals)."
        )
    new_ctx, outvals = result
    _check_outvals(handler, eqn, outvals)
    return new_ctx, outvals


def check_params(eqn: JaxprEqn) -> None:
    """Raises if `eqn` carries a parameter that kups does not know for its primitive.

    A JAX release newer than the ones kups supports may add one; re-binding the
    equation without understanding it could change the program silently.
    """
    known = _compat.KNOWN_PARAMS.get(eqn.primitive.name)
    if known is None:
        return
    unknown = sorted(set(eqn.params) - known)
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise NotImplementedError(
            f"kups does not know the parameter(s) {names} of the control-flow primitive "
            f"'{eqn.primitive.name}' at {_source.source_line(eqn)}, which JAX {jax.__version__} "
            f"gives it. kups supports JAX {_compat.SUPPORTED_JAX}, where '{eqn.primitive.name}' has "
            f"only {sorted(known)}; re-binding the equation without understanding "
            f"{names} could change your program, so kups stops here. Use a JAX release in "
            f"that range, or a kups release that supports JAX {jax.__version__}."
        )


def _not_a_jaxpr(label: str, value: Any) -> str:
    label = label or "Interpreter"
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__name__
        return (
            f"{label} interprets a jaxpr, and was given the function {name} "
            f"({type(value).__name__}). To run a Python function (jitted or not) under "
            f"the interpreter, wrap it: reinterpret({name}, interpreter)(ctx, *args); "
            f"or trace it first: interpreter(jax.make_jaxpr({name})(*args), ctx, *args)."
        )
    return (
        f"{label} interprets a jaxpr (a jax.extend.core.ClosedJaxpr, as "
        f"jax.make_jaxpr(fn)(*args) returns), and was given a {type(value).__name__}. "
        f"Call it as interpreter(jax.make_jaxpr(fn)(*args), ctx, *args), or wrap the "
        f"function: reinterpret(fn, interpreter)(ctx, *args)."
    )


def handler_name(handler: Any) -> str:
    func = getattr(handler, "func", handler)  # functools.partial
    return getattr(func, "__qualname__", None) or type(handler).__name__


def check_static_leaves(handler: Any, eqn: JaxprEqn, ctx_before: Any, ctx: Any) -> None:
    leaked = leaked_static_paths(ctx_before, ctx)
    if leaked:
        path, type_name = leaked[0]
        raise TypeError(
            f"The handler {handler_name(handler)} for {where(eqn)} returned a context whose leaf "
            f"ctx{path} is a {type_name} holding a traced array. A context leaf that is "
            f"not an array (nor a pytree of arrays) is static to kups, like a string, so "
            f"it cannot carry an array out of the '{eqn.primitive.name}' body: the array "
            f"would be a leaked tracer. Register {type_name} as a pytree (for example "
            f"with jax.tree_util.register_dataclass or "
            f"jax.tree_util.register_pytree_node_class, or make it an equinox.Module) so "
            f"that its arrays are context leaves."
        )


def _check_outvals(handler: Any, eqn: JaxprEqn, outvals: Any) -> None:
    if not isinstance(outvals, list):
        raise TypeError(
            f"The handler {handler_name(handler)} for {where(eqn)} returned outvals of type "
            f"{type(outvals).__name__}; outvals must be a list with one value per output "
            f"of the equation (for example HandlerResult(ctx, [y]) or "
            f"HandlerResult(ctx, list(ys)))."
        )
    if len(outvals) != len(eqn.outvars):
        raise ValueError(
            f"The handler {handler_name(handler)} for {where(eqn)} returned {len(outvals)} "
            f"outvals; the equation has {len(eqn.outvars)} outputs "
            f"({', '.join(v.aval.str_short() for v in eqn.outvars)}). Return a list with "
            f"one value per output, in the order of eqn.outvars."
        )
    for i, (var, val) in enumerate(zip(eqn.outvars, outvals, strict=True)):
        try:
            aval = _compat.aval_of(val)
        except TypeError as err:
            raise TypeError(
                f"The handler {handler_name(handler)} for {where(eqn)} returned a "
                f"{type(val).__name__} as output {i}, which is not an array. Return an "
                f"array (or a tracer) of type {var.aval.str_short()} for it."
            ) from err
        want: Any = var.aval
        if aval.shape != want.shape or aval.dtype != want.dtype:
            raise ValueError(
                f"The handler {handler_name(handler)} for {where(eqn)} returned output {i} of "
                f"type {aval.str_short()}; the equation's output {i} is "
                f"{want.str_short()}. A handler must keep every output's shape and dtype."
            )
        missing = _compat.varying_axes(want) - _compat.varying_axes(aval)
        if missing and isinstance(val, _compat.Tracer):
            axes = tuple(sorted(missing, key=str))
            raise ValueError(
                f"The handler {handler_name(handler)} for {where(eqn)} returned output {i} of "
                f"type {aval.str_short()}, the same on every shard of {axes}; the equation's "
                f"output {i} is {want.str_short()}, which differs between them. JAX would "
                f"fail later, at the collective that reads it. Cast it to vary with "
                f"jax.lax.pcast(value, {axes!r}, to='varying') before returning it."
            )
