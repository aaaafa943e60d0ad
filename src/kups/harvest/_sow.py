"""The `sow` primitive and the function that binds it."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching

from kups.effects import define_effect

from ._names import Tag, check_name, check_tag

MODES = ("strict", "append", "clobber")
"""The modes `sow` accepts."""

# The primitive every `sow` binds. Its name is unique: dispatchers key by name.
# Params: `tag`, `name`, `mode`, `tree` (of the value), `scope` (the scopes of
# the enclosing `nest` calls, outermost first), `init` (a number or None) and
# `conditional` (a `sow_cond`: its first operand is the predicate) and `in_rule`
# (bound while a `custom_jvp` rule is traced under `reap`). Under `jax.vmap`
# (see `_batch_sow`) also `batched`: how many leading axes of each operand are
# batch axes.
sow_p = define_effect("kups_sow")


def _batch_sow(
    operands: list[Any], dims: list[int | None], **params: Any
) -> tuple[list[Any], list[int | None]]:
    """`sow` under `jax.vmap`: each batched operand's batch axis moved to the
    front, and counted in the `batched` param (one more under each `vmap`).

    JAX binds a `sow` whose operands are all unbatched outside the batch, on the
    unbatched values: `reap(jax.vmap(f))` sees one name with both shapes (a value
    sown before a loop on unbatched data, then in the batched loop). `batched`
    tells which leading axes the batch added, so that `reap` can carry the
    unbatched value, the same for every batch element, broadcast along them."""
    before = params.get("batched") or (0,) * len(operands)
    moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims, strict=True)]
    batched = tuple(k + (d is not None) for k, d in zip(before, dims, strict=True))
    out = sow_p.bind(*moved, **{**params, "batched": batched})
    return out, [None if d is None else 0 for d in dims]


batching.primitive_batchers[sow_p] = _batch_sow

# Predicates on a sow's params: while one holds, JAX differentiates that sow as a
# constant (see `constant_sows`).
_CONSTANT: list[Callable[[Mapping[str, Any]], bool]] = []
_effect_jvp = ad.primitive_jvps[sow_p]


@contextlib.contextmanager
def constant_sows(planted: Callable[[Mapping[str, Any]], bool]) -> Iterator[None]:
    """While active, the tangent of a sow for which `planted(params)` holds is
    zero (where a `sow_cond`'s predicate holds): `plant` replaces its value by one
    the differentiated inputs do not change, in a custom derivative rule that it
    traces (`default_custom_jvp_handler(..., tracing_rule=...)`)."""
    _CONSTANT.append(planted)
    try:
        yield
    finally:
        _CONSTANT.remove(planted)


def _jvp_sow(primals: Any, tangents: Any, **params: Any) -> tuple[list[Any], list[Any]]:
    out, out_tangents = _effect_jvp(primals, tangents, **params)
    if not any(planted(params) for planted in _CONSTANT):
        return out, out_tangents
    if not params["conditional"]:
        return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
    pred = primals[0]
    return out, [
        out_tangents[0],
        *(
            t if isinstance(t, ad.Zero) else jnp.where(pred, jnp.zeros_like(t), t)
            for t in out_tangents[1:]
        ),
    ]


ad.primitive_jvps[sow_p] = _jvp_sow

# ---------------------------------------------------------------- sow


def sow(
    value: Any,
    *,
    tag: Tag,
    name: str,
    mode: str = "strict",
    init: bool | int | float | complex | None = None,
) -> Any:
    """Marks `value` as an intermediate that `reap` can read and `plant` replace.

    Outside `reap`/`plant` (or under another tag) it is the identity, also
    under `jit`, `vmap`, `grad` and every control-flow primitive; JAX keeps it
    in the program even when its result is unused.

    **Arguments:**

    - `value`: a pytree of arrays.
    - `tag`: the group this value belongs to; `reap` and `plant` act on one tag.
      Any hashable value (a string, a number, a tuple, an `Enum` member) other
      than `None` and `""`, compared with `==`, as in Oryx.
    - `name`: the value's name within the tag.
    - `mode`: `"strict"` (the name is sown at most once per call), `"clobber"`
      (the last sow wins) or `"append"` (inside `scan`: one value per
      iteration, stacked along the iterations like the scan's outputs).
    - `init`: only with `mode="clobber"`, for a sow inside a loop or a `cond`
      branch. A number: what `reap` returns for the name when the `while_loop`
      (or `scan`) in which it is first sown runs zero times, or when a branch
      that does not sow it runs (inside a loop, such a branch leaves the value
      sown by an earlier iteration, and the init only before any), filled into
      the shape and dtype of the sown value (every leaf). Without it, a name
      first sown inside a `while_loop` or in only some branches of a `cond` is
      an error, and one first sown in a zero-length `scan` is left out. A value
      sown before takes precedence.

    **Returns:**

    `value`, or under `plant` the planted value.

    !!! Example

        ```python
        import jax.numpy as jnp
        from jax import lax
        from kups.harvest import reap, sow


        def f(x):
            y = sow(jnp.sin(x), tag="intermediates", name="y")
            return 2.0 * y


        out, sown = reap(f, tag="intermediates")(1.0)
        assert jnp.allclose(sown["y"], jnp.sin(1.0))
        assert jnp.allclose(out, 2.0 * jnp.sin(1.0))


        def halve_until_small(x):
            def body(x):
                return sow(x / 2, tag="intermediates", name="last", mode="clobber", init=-1.0)

            return lax.while_loop(lambda x: x > 1.0, body, x)


        # The loop runs zero times: "last" is the init.
        assert reap(halve_until_small, tag="intermediates")(0.5)[1]["last"] == -1.0
        assert reap(halve_until_small, tag="intermediates")(3.0)[1]["last"] == 0.75
        ```
    """
    _check_mode_and_init("sow", tag, name, mode, init)
    return _bind("sow", value, None, tag=tag, name=name, mode=mode, init=init)


def sow_cond(
    value: Any,
    pred: Any,
    *,
    tag: Tag,
    name: str,
    init: bool | int | float | complex | None = None,
) -> Any:
    """Sows `value` where `pred` holds: Oryx's `sow_cond`.

    The name behaves as a `"clobber"` one whose sows count only where `pred`
    (a boolean scalar, traced or not) is true: in a loop, `reap` returns the
    value of the last iteration in which `pred` held. `init` says what the name
    holds while `pred` never held; without it the name needs a value sown
    before (with `sow(..., mode="clobber")`), since kups does not invent one.
    Under `plant`, the sow returns the planted value where `pred` holds and
    `value` elsewhere.

    **Arguments:**

    - `value`: a pytree of arrays.
    - `pred`: a boolean scalar.
    - `tag`, `name`: as for `sow`.
    - `init`: a number, filled into the shape and dtype of every leaf: the
      value of the name until a sow with `pred` true.

    **Returns:**

    `value`, or under `plant` the planted value where `pred` holds.

    !!! Example

        ```python
        import jax.numpy as jnp
        from jax import lax
        from kups.harvest import reap, sow_cond


        def last_negative(xs):
            def step(carry, x):
                sow_cond(x, x < 0, tag="t", name="last_negative", init=0.0)
                return carry, None

            return lax.scan(step, 0.0, xs)[0]


        _, sown = reap(last_negative, tag="t")(jnp.array([-1.0, 2.0, -3.0, 4.0]))
        assert sown["last_negative"] == -3.0
        _, sown = reap(last_negative, tag="t")(jnp.array([1.0, 2.0]))
        assert sown["last_negative"] == 0.0  # pred never held: the init
        ```
    """
    _check_mode_and_init("sow_cond", tag, name, "clobber", init)
    if jnp.shape(pred) != () or not jnp.issubdtype(jnp.result_type(pred), jnp.bool_):
        raise TypeError(
            f"sow_cond(value, pred, tag={tag!r}, name={name!r}) needs pred a boolean scalar, "
            f"got {jax.typeof(pred).str_short() if eqx.is_array(pred) else repr(pred)}. Reduce "
            f"it first, for example with jnp.any(...) or jnp.all(...)."
        )
    return _bind("sow_cond", value, pred, tag=tag, name=name, mode="clobber", init=init)


def _check_mode_and_init(caller: str, tag: Any, name: Any, mode: str, init: Any) -> None:
    check_tag(f"{caller}(...)", tag)
    check_name("name", name)
    if mode not in MODES:
        raise ValueError(
            f"{caller}(tag={tag!r}, name={name!r}) got mode={mode!r}; the modes are "
            f"{', '.join(map(repr, MODES))}."
        )
    if init is not None:
        if mode != "clobber":
            raise ValueError(
                f"{caller}(tag={tag!r}, name={name!r}, mode={mode!r}) got init={init!r}; init "
                f"is what a loop that runs zero times yields for a mode='clobber' name. Use "
                f"mode='clobber', or leave init out."
            )
        if not isinstance(init, numbers.Number):
            raise TypeError(
                f"{caller}(tag={tag!r}, name={name!r}) got init of type "
                f"{type(init).__name__}; init is a number (such as 0.0 or float('nan')), filled "
                f"into the shape and dtype of the sown value."
            )


# Watchers of the sows bound while a `custom_jvp` rule is traced under `reap`
# (JAX runs the rule when a jvp or grad applied outside `reap` meets the
# function); such sows are bound with `in_rule=True`.
_WATCHERS: list[Callable[[dict[str, Any]], None]] = []


@contextlib.contextmanager
def watching(watcher: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """While active, every `sow` calls `watcher(params)` and is bound with
    `in_rule=True`."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def _bind(caller: str, value: Any, pred: Any, *, tag: Any, name: str, mode: str, init: Any) -> Any:
    leaves, treedef = jax.tree.flatten(value)
    for leaf in leaves:
        if not eqx.is_array_like(leaf):
            raise TypeError(
                f"{caller}(tag={tag!r}, name={name!r}) needs a pytree of arrays, but a leaf of "
                f"the value is a {type(leaf).__name__}: {leaf!r}."
            )
    operands = leaves if pred is None else [pred, *leaves]
    params = dict(
        tag=tag,
        name=name,
        mode=mode,
        tree=treedef,
        scope=(),
        init=init,
        conditional=pred is not None,
        in_rule=bool(_WATCHERS),
    )
    for watcher in _WATCHERS:
        watcher(params)
    out = sow_p.bind(*operands, **params)
    return jax.tree.unflatten(treedef, out[1:] if pred is not None else out)


def split_operands(params: dict[str, Any], operands: list[Any]) -> tuple[Any, list[Any]]:
    """The predicate of a `sow_cond` (`None` for a `sow`) and the sown leaves."""
    if params["conditional"]:
        return operands[0], list(operands[1:])
    return None, list(operands)
