"""Effect primitives: identities that JAX keeps so that interpreters can see them."""

import contextlib
import threading
from collections.abc import Hashable, Iterator, Sequence
from functools import partial
from typing import Any, ClassVar

from jax.extend.core import Effect, Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat


class KupsEffect(Effect):
    """The JAX effect carried by every primitive made by `define_effect`.

    It is unordered (no runtime tokens are threaded through the compiled
    program) and registered in JAX's effect tables so that `jit`, control flow,
    `jax.checkpoint`, custom derivatives and partial evaluation keep the
    primitive even when its outputs are unused.

    Each primitive has its own subclass (`effect_type`), whose instances are
    all equal: `jax.export` serializes an effect as its class's name and
    deserializes it by calling that class with no arguments, among the
    lowerable effect types registered in the process that deserializes.
    """

    name: ClassVar[str] = ""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"KupsEffect({self.name!r})"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled by class name (`jax.experimental.serialize_executable` pickles
        # a compiled program's effects): the class is made at run time, so
        # pickle cannot find it as a module attribute.
        return (_effect_named, (type(self).__name__,))


_compat.register_effect_type(KupsEffect)

# How many effect types each name has (two primitives may share a name).
_TYPES_PER_NAME: dict[str, int] = {}
# Every effect type made so far, by class name.
_EFFECT_TYPES: dict[str, type[KupsEffect]] = {}


def _effect_named(class_name: str) -> KupsEffect:
    """The effect of the type called `class_name`, for unpickling."""
    try:
        return _EFFECT_TYPES[class_name]()
    except KeyError:
        raise ValueError(
            f"The effect {class_name} is not defined in this process. Define it first "
            "(import the module that calls define_effect), then load the program."
        ) from None


def effect_type(name: str) -> type[KupsEffect]:
    """A new subclass of `KupsEffect` for a primitive called `name`.

    Its class name, which `jax.export` serializes, is `KupsEffect[name]`, with
    `#2`, `#3`... for later primitives of the same name, so a process that
    defines its effects in the same order deserializes each to its own type.
    """
    count = _TYPES_PER_NAME[name] = _TYPES_PER_NAME.get(name, 0) + 1
    class_name = f"KupsEffect[{name}]" if count == 1 else f"KupsEffect[{name}]#{count}"
    # `jax.export` writes `str(cls)`, which names the module: the public one, so
    # serialized programs do not depend on where in kups the class is made.
    namespace = {"name": name, "__qualname__": class_name, "__module__": "kups.effects"}
    cls = type(class_name, (KupsEffect,), namespace)
    _EFFECT_TYPES[class_name] = cls
    # The base class in JAX's tables already admits it; `jax.export` looks a
    # deserialized effect up by its exact type among the lowerable ones.
    _compat.register_effect_type(cls)
    return cls


# The names of every effect primitive made so far (see `UNSEEN`).
EFFECT_NAMES: set[str] = set()


class LostEffectError(NotImplementedError):
    """An effect that an interpreter handles was bound where it cannot see it."""


class _Unseen(threading.local):
    def __init__(self) -> None:
        # The innermost (interpreter, equation) whose primitive an interpreter is
        # binding unchanged, or None outside one (and inside a nested interpretation).
        self.top: tuple[Any, Any] | None = None


# While an interpreter binds an equation unchanged, `UNSEEN.top` is (interpreter,
# equation): an effect that the interpreter handles and that is bound meanwhile (by
# Python code the primitive holds, such as a library primitive's function that it
# traces or runs) is one the interpreter never sees, and `lost_effect` says so.
UNSEEN = _Unseen()


@contextlib.contextmanager
def seen() -> Iterator[None]:
    """Inside an interpretation, effects are seen by its interpreter (a nested
    interpretation started by code that a re-bound primitive runs)."""
    previous, UNSEEN.top = UNSEEN.top, None
    try:
        yield
    finally:
        UNSEEN.top = previous


@contextlib.contextmanager
def watched(interpreter: Any, eqn: Any) -> Iterator[None]:
    """While active, an effect that `interpreter` handles and that is bound is
    one it never sees: code that `eqn` holds runs out of its sight (as when it
    binds `eqn` unchanged)."""
    previous, UNSEEN.top = UNSEEN.top, (interpreter, eqn)
    try:
        yield
    finally:
        UNSEEN.top = previous


class EffectPrimitive(Primitive):
    """A primitive made by `define_effect`; see there."""

    multiple_results = True

    def __init__(self, name: str):
        super().__init__(name)
        self.effect = effect_type(name)()
        EFFECT_NAMES.add(name)

    def __repr__(self) -> str:
        # Two effects may share a name; the id tells them apart in messages.
        return f"{self.name} (kups effect at {id(self):#x})"

    def bind(self, *args: Any, **params: Hashable) -> list[Any]:
        for key, value in params.items():
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"Effect {self!r} was bound with the unhashable static "
                    f"parameter {key}={value!r} of type {type(value).__name__}. "
                    "Static parameters must be hashable Python values (use a "
                    "tuple instead of a list, a frozenset instead of a set); "
                    "pass arrays as positional arguments instead."
                ) from None
        unseen = UNSEEN.top
        if unseen is not None and unseen[0].dispatcher.is_registered(self):
            unseen[0].lost_effect(self, unseen[1], params)
        return super().bind(*args, **params)


def is_effect(primitive: Any) -> bool:
    """Whether `primitive` was made by `define_effect`.

    An effect is an identity on arrays that only an interpreter gives a meaning
    to; it adds nothing to the compiled program. A cost model, say, counts
    nothing for it.

    **Example:**

    ```python
    import jax
    from kups.effects import define_effect, is_effect

    note = define_effect("note")
    assert is_effect(note) and not is_effect(jax.lax.sin_p)
    ```
    """
    return isinstance(primitive, EffectPrimitive)


def define_effect(name: str) -> Primitive:
    """Makes a new effect primitive: an identity on arrays that JAX never
    removes while an interpreter could still see it.

    The primitive is bound as `prim.bind(*arrays, **static_params)` and returns
    a list of the same arrays (same shapes, dtypes and varying manual axes).
    `static_params` are hashable Python values (strings, numbers, tuples,
    frozen dataclasses); they become the equation's `params`, where a handler
    reads them.

    Outside an interpreter the primitive is the identity, eagerly and under
    `jit`, `vmap`, `grad`/`jvp`/`vjp`, `scan`, `while_loop`, `cond`,
    `jax.checkpoint`, `custom_jvp`/`custom_vjp` and `shard_map` (also with
    `check_vma=True`). It carries an unordered JAX effect, so it survives
    dead-code elimination and partial evaluation even when its outputs are
    unused, yet adds nothing to the compiled program (its lowering returns its
    operands; no runtime tokens).

    Under differentiation the primitive is bound on the primal values only;
    tangents and cotangents pass through it unchanged and do not bind it, so
    `jax.grad` of a function equals, bit for bit, `jax.grad` of the same
    function without the effect. A handler sees each bind once, except where
    JAX computes the primal again: inside `jax.checkpoint` (and a `while_loop`
    body under differentiation), unless the policy saves the effect's outputs,
    it is bound in the recomputation too, as JAX binds `jax.debug.callback`
    there.

    Every call returns a distinct primitive, even for a name used before. A
    dispatcher keyed by name treats such primitives as one; key it by the
    primitive object to tell them apart.

    A jitted program that binds the primitive exports with `jax.export` and
    serializes; the process that deserializes it must have defined the same
    effects first (in the same order, for a name used twice), as importing the
    module that defines them does.

    **Arguments:**

    - `name`: the primitive's name, shown in jaxprs and used to register
      handlers by name.

    **Returns:**

    A `jax.extend.core.Primitive` with `multiple_results=True`.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.effects import define_effect

        log_p = define_effect("log")


        def f(x):
            y = jnp.sin(x)
            (y,) = log_p.bind(y, tag="activations", name="sin")
            return y * 2.0
        ```

        `f` computes `jnp.sin(x) * 2.0` as if `log_p` were not there, and
        `jax.make_jaxpr(f)` shows an equation `log[name=sin tag=activations]`.
        An interpreter built with a `Dispatcher` that has a handler registered
        for `"log"` (or for `log_p`) receives that equation with `invals` the
        value of `y`, reads `eqn.params["tag"]`, may record the value in its
        context, and returns `HandlerResult(ctx, invals)` to keep `f` unchanged.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"define_effect expects a non-empty string as the effect's name, got {name!r}."
        )
    primitive = EffectPrimitive(name)
    primitive.def_impl(_identity_impl)
    primitive.def_effectful_abstract_eval(partial(_abstract_eval, primitive.effect))
    batching.primitive_batchers[primitive] = partial(_batch_rule, primitive)
    ad.primitive_jvps[primitive] = partial(_jvp_rule, primitive)
    ad.primitive_transposes[primitive] = _transpose_rule
    mlir.register_lowering(primitive, _lowering)
    _compat.register_recompute_rule(primitive, _recompute_rule)
    return primitive


def _identity_impl(*args: Any, **params: Hashable) -> list[Any]:
    del params
    return list(args)


def _abstract_eval(
    effect: KupsEffect, *avals: Any, **params: Hashable
) -> tuple[list[Any], set[Effect]]:
    del params
    # The input avals are returned unchanged: this keeps shape, dtype, weak
    # type, sharding and, inside `shard_map`, the varying manual axes (`.mat`).
    return list(avals), {effect}


def _batch_rule(
    primitive: Primitive,
    batched_args: Sequence[Any],
    batch_dims: Sequence[int | None],
    **params: Hashable,
) -> tuple[list[Any], list[int | None]]:
    return primitive.bind(*batched_args, **params), list(batch_dims)


def _jvp_rule(
    primitive: Primitive,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    **params: Hashable,
) -> tuple[list[Any], list[Any]]:
    # Binding only the primals keeps the effect in the primal (known) part
    # under `jax.linearize`/`jax.grad`: binding tangents too would make the
    # primal outputs depend on unknowns and would show the effect twice.
    return primitive.bind(*primals, **params), list(tangents)


def _transpose_rule(cotangents: Sequence[Any], *args: Any, **params: Hashable) -> list[Any]:
    # Reached only when the primitive is applied to linear inputs directly
    # (e.g. under `jax.linear_transpose`); `jax.grad` never transposes it
    # because its JVP does not bind it on tangents.
    del params
    return [
        cotangent if ad.is_undefined_primal(arg) else None
        for cotangent, arg in zip(cotangents, args, strict=True)
    ]


def _recompute_rule(
    saveable: Any, unknowns: Sequence[bool], instantiated: Sequence[bool], eqn: Any
) -> tuple[Any, Any, list[bool], list[bool], list[Any]]:
    # How rematerialisation splits the effect. On unknown inputs it is staged
    # (recomputed), like any primitive. On known ones JAX's default would bind it
    # in the known part only and save its outputs, which a `while_loop` cannot
    # (it has no residuals: `jax.grad(jax.checkpoint(f))` of a loop that sows
    # failed). Unless the policy saves it, it is bound in both parts instead, as
    # JAX does with `jax.debug.callback`: an interpreter sees it wherever the
    # value is recomputed, and the compiled program is the same (it is an
    # identity).
    num_out = len(eqn.outvars)
    needed = [
        v
        for v, inst in zip(eqn.invars, instantiated, strict=True)
        if not inst and not _compat.is_literal(v)
    ]
    if any(unknowns):
        return None, eqn, [True] * num_out, [True] * num_out, needed
    if _compat.saved_by(saveable(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)):
        return eqn, None, [False] * num_out, [False] * num_out, []
    return eqn, eqn, [False] * num_out, [True] * num_out, needed


def _lowering(ctx: Any, *args: Any, **params: Hashable) -> list[Any]:
    del ctx, params
    return list(args)
