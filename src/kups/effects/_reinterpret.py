"""`reinterpret`: trace a Python function and interpret it with a context."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from . import _compat
from ._interpreter import Interpreter
from ._source import api_boundary, call_site

Ctx = TypeVar("Ctx")
F = TypeVar("F", bound=Callable[..., Any])

_POSITIONAL_ONLY = inspect.Parameter.POSITIONAL_ONLY


def user_signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """The signature of `fn`, or `None` when Python cannot read one (some builtins
    and C extensions)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def signature_with_leading(fn: Callable[..., Any], *names: str) -> inspect.Signature:
    """`fn`'s signature with positional-only parameters `names` put in front.

    A leading name that clashes with one of `fn`'s parameters gets underscores
    appended. When `fn`'s signature cannot be read, `(*names, /, *args, **kwargs)`.
    The return annotation is left out.
    """
    signature = user_signature(fn)
    if signature is None:
        rest = [
            inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]
        taken: set[str] = {"args", "kwargs"}
    else:
        rest = list(signature.parameters.values())
        taken = set(signature.parameters)
    leading = []
    for name in names:
        while name in taken:
            name += "_"
        taken.add(name)
        leading.append(inspect.Parameter(name, _POSITIONAL_ONLY))
    # No return annotation: a wrapper returns something else than `fn` (`(out, ctx)`).
    return inspect.Signature([*leading, *rest])


def wraps_with_leading(fn: Callable[..., Any], *names: str) -> Callable[[F], F]:
    """Decorates a wrapper of `fn` that takes the leading arguments `names` before
    `fn`'s own, so that it looks like `fn` with those arguments in front.

    The wrapper gets `fn`'s `__name__`, `__qualname__`, `__doc__` and `__module__`,
    and as `__signature__` the one of `fn` with positional-only `names` in front
    (`inspect.signature`, `jax.jit`'s `static_argnums`/`donate_argnums` and
    `equinox.filter_jit` read it). Unlike `functools.wraps` it sets no
    `__wrapped__`: the wrapper is not `fn`, and tools that follow `__wrapped__`
    would read `fn`'s signature (or its arrays) instead of the wrapper's. With no
    `names`, the wrapper takes exactly `fn`'s arguments.

    The wrapper is also a traceback boundary, as JAX's transformations are: an
    error raised below it (in `fn`, or in a handler) shows the user's frames and
    none of kups' or JAX's, unless `JAX_TRACEBACK_FILTERING=off`.

    **Arguments:**

    - `fn`: the wrapped function.
    - `names`: the names of the arguments the wrapper takes before `fn`'s.

    **Returns:**

    A decorator that returns the wrapper with these attributes, as a traceback
    boundary that JAX's messages describe by `fn`'s source line (a traced function
    that returns a string names `fn`'s file, not kups' or JAX's).

    **Example:**

    ```python
    import inspect

    from kups.effects import wraps_with_leading


    def f(x, y=1.0):
        return x * y


    @wraps_with_leading(f, "values")
    def wrapped(values, *args, **kwargs):
        return f(*args, **kwargs)


    assert str(inspect.signature(wrapped)) == "(values, /, x, y=1.0)"
    assert wrapped.__name__ == "f" and not hasattr(wrapped, "__wrapped__")
    ```
    """

    def decorate(wrapper: F) -> F:
        wrapper = api_boundary(wrapper)
        wrapper.__name__, wrapper.__qualname__ = _names(fn)
        described = _unpartial(fn)
        wrapper.__doc__ = getattr(described, "__doc__", None)
        wrapper.__module__ = getattr(described, "__module__", None) or wrapper.__module__
        if "__wrapped__" in getattr(wrapper, "__dict__", {}):
            del wrapper.__wrapped__  # pyright: ignore[reportAttributeAccessIssue]
        # The signature is read when asked for: effects wrap a function at each call.
        return described_by(wrapper, fn, signature=lambda: signature_with_leading(fn, *names))

    return decorate


class _Described:
    """A wrapper that JAX describes by the source of the function it wraps.

    JAX names a traced function in its messages by the `__code__` of the callable
    it is given ("function f at model.py:3 traced for jit returned ..."). A
    traceback boundary's code is JAX's (`jax/_src/traceback_util.py`), which is
    what `jax.jit(reap(f, tag=...))` named; this callable carries `fn`'s code
    instead, as data: what runs is the wrapper. It binds as a method, as a
    function does.
    """

    def __init__(
        self,
        wrapper: Callable[..., Any],
        fn: Callable[..., Any],
        signature: Callable[[], inspect.Signature | None],
    ) -> None:
        self._wrapper = wrapper
        self._signature_of = signature
        for name in ("__name__", "__qualname__", "__doc__", "__module__"):
            if hasattr(wrapper, name):
                setattr(self, name, getattr(wrapper, name))
        code = getattr(_unpartial(fn), "__code__", None)
        if code is not None:
            self.__code__ = code

    @functools.cached_property
    def __signature__(self) -> inspect.Signature | None:
        """What `inspect.signature` shows, computed once when first asked for."""
        return self._signature_of()

    @api_boundary  # so that its own frame is filtered out of tracebacks too
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapper(*args, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<kups wrapper of {getattr(self, '__qualname__', '?')}>"


def described_by(
    wrapper: F,
    fn: Callable[..., Any],
    signature: Callable[[], inspect.Signature | None] | None = None,
) -> F:
    """`wrapper`, which JAX's messages describe by `fn`'s source file and line (as
    they describe `fn` itself) rather than by the wrapper's own code; its
    signature is `signature()` (by default `wrapper`'s), read when first asked for."""
    if signature is None:
        signature = functools.partial(user_signature, wrapper)
    return _Described(wrapper, fn, signature)  # pyright: ignore[reportReturnType]


def _unpartial(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a `functools.partial` (nested or not) calls, or `fn`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _names(fn: Callable[..., Any]) -> tuple[str, str]:
    """`(__name__, __qualname__)` of `fn` (of the function a `functools.partial`
    calls), or else of a callable object's type (an `equinox.Module`)."""
    fn = _unpartial(fn)
    name = getattr(fn, "__name__", None)
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(name, str) and isinstance(qualname, str):
        return name, qualname
    return type(fn).__name__, type(fn).__qualname__


def missing_leading_argument(
    signature: inspect.Signature | None, leading: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether `fn(*args, **kwargs)` cannot bind but `fn(leading, *args, **kwargs)`
    can: the caller forgot a leading argument, so that `fn`'s first argument was
    taken for it."""
    if signature is None:
        return False
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        try:
            signature.bind(leading, *args, **kwargs)
        except TypeError:
            return False
        return True
    return False


def reinterpret(fn: Callable[..., Any], interpreter: Interpreter) -> Callable[..., tuple[Any, Any]]:
    """Wraps `fn` so that it runs under `interpreter`, threading a context.

    `fn` is traced on the given pytree arguments; leaves that are not arrays
    (functions, strings, `None`, Python numbers) are static, as in equinox's filter
    transformations, so an `equinox.Module` can be passed as it is. The result
    works eagerly and under `jax.jit`, `vmap`, `grad`, `jvp`, `vjp`, `shard_map`,
    and can itself be interpreted again.

    The wrapped function looks like `fn` with a leading positional-only `ctx`:
    `inspect.signature` shows it, so `jax.jit(wrapped, donate_argnums=1)` donates
    `fn`'s first argument and `equinox.filter_jit(wrapped)` binds its arguments as
    `fn`'s. Errors raised inside `fn` or a handler show the user's frames and not
    kups' (see `JAX_TRACEBACK_FILTERING`).

    **Arguments:**

    - `fn`: the function to interpret.
    - `interpreter`: the `Interpreter` to run it with.

    **Returns:**

    `wrapped(ctx, *args, **kwargs) -> (out, ctx)`.

    **Example:**

    ```python
    import inspect

    import jax.numpy as jnp
    from kups.effects import Interpreter, default_dispatcher, reinterpret


    def f(x, scale=2.0):
        return jnp.tanh(x) * scale


    identity = Interpreter(default_dispatcher())
    wrapped = reinterpret(f, identity)
    out, ctx = wrapped(0, jnp.ones(3), scale=3.0)
    assert (out == f(jnp.ones(3), scale=3.0)).all() and ctx == 0
    assert str(inspect.signature(wrapped)) == "(ctx, /, x, scale=2.0)"
    ```
    """
    if not callable(fn):
        raise TypeError(
            f"reinterpret(fn, interpreter) needs a callable fn, got {type(fn).__name__}: "
            f"{fn!r}. Did you swap the arguments?"
        )
    if not isinstance(interpreter, Interpreter):
        raise TypeError(
            f"reinterpret(fn, interpreter) needs a kups.effects.Interpreter, got "
            f"{type(interpreter).__name__}. Build one with Interpreter(default_dispatcher())."
        )

    # `ctx` is positional-only: `fn` may take a keyword argument of that name.
    def call(ctx: Ctx, /, *args: Any, **kwargs: Any) -> tuple[Any, Ctx]:
        dyn_leaves, rebuild_args = _arrays_of((args, kwargs))
        out_rebuild: list[Callable[[Sequence[Any]], Any]] = []

        def flat_fn(*leaves: Any) -> list[Any]:
            call_args, call_kwargs = rebuild_args(leaves)
            try:
                out = fn(*call_args, **call_kwargs)
            except TypeError as error:
                # Read `fn`'s signature only when the call failed.
                _check_context_given(fn, ctx, args, kwargs, error)
                raise
            out_leaves, rebuild_out = _arrays_of(out)
            out_rebuild.append(rebuild_out)
            return out_leaves

        with call_site():
            avals = [jax.typeof(leaf) for leaf in dyn_leaves]
            jaxpr, _, consts = _compat.trace_to_jaxpr(flat_fn, avals, "kups reinterpret", fn)
            closed = _compat.new_closed_jaxpr(jaxpr, consts)
            outs, ctx = interpreter(closed, ctx, *dyn_leaves)
        return out_rebuild[0]([_as_array(out) for out in outs]), ctx

    return wraps_with_leading(fn, "ctx")(call)


def _arrays_of(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """The array leaves of `tree` (JAX and NumPy arrays, as `equinox.is_array`
    says), and a function that rebuilds `tree` with new array leaves and its other
    leaves as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [eqx.is_array(leaf) for leaf in leaves]
    if all(mask):
        return leaves, functools.partial(jax.tree.unflatten, treedef)
    statics = [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]

    def rebuild(arrays: Sequence[Any]) -> Any:
        arrays_iter, statics_iter = iter(arrays), iter(statics)
        return jax.tree.unflatten(
            treedef, [next(arrays_iter) if m else next(statics_iter) for m in mask]
        )

    return [leaf for leaf, m in zip(leaves, mask, strict=True) if m], rebuild


def _check_context_given(
    fn: Callable[..., Any],
    ctx: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: Exception,
) -> None:
    """A `TypeError` saying so when `fn` failed to bind its arguments because its
    first one was taken for the context."""
    signature = user_signature(fn)
    if missing_leading_argument(signature, ctx, args, kwargs):
        name = _names(fn)[1]
        raise TypeError(
            f"The reinterpreted {name}{signature} was called with "
            f"{len(args)} positional argument(s) after the context, one fewer than it "
            f"needs: the first argument of a reinterpreted function is the context, "
            f"so your first argument was taken for it. Call it as "
            f"wrapped(ctx, *args), where ctx is the context the interpreter's handlers "
            f"thread through (any pytree; None if they read none)."
        ) from error


def _as_array(value: Any) -> Any:
    """An output that the jaxpr holds as a literal (a `TypedFloat`, a NumPy scalar)
    as the `jax.Array` that calling the function returns."""
    if isinstance(value, jax.Array):
        return value
    aval = jax.typeof(value)
    return jnp.asarray(value) if aval.weak_type else jnp.asarray(value, dtype=aval.dtype)
