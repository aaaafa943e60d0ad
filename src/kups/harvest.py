"""Tagging intermediate values of a program, and reading (`reap`) or replacing
(`plant`) them from outside.

`sow(value, tag=..., name=...)` marks a value inside a program; it returns the
value unchanged and costs nothing when no interpreter looks at it. `reap(fn,
tag=...)` runs `fn` and also returns every value sown under `tag`, by name;
`plant(fn, tag=...)` runs `fn` with sown values replaced by given ones. Both are
interpreters built on the public surface of `kups.effects`, so they see through
`jit`, `scan`, `fori_loop`, `while_loop`, `cond`/`switch`, `jax.checkpoint`,
`custom_jvp`/`custom_vjp` and `shard_map`.

Rules, by control-flow primitive (`reap` checks them and names the user's
source lines when one is broken):

- A name has one mode for the whole call: `"strict"` (sown at most once),
  `"clobber"` (the last sow wins) or `"append"` (one value per `scan`
  iteration).
- `scan` (and `fori_loop` with static bounds, `lax.map`): an `"append"` name
  comes out stacked along the iterations, entry `i` belonging to `xs[i]`
  (also with `reverse=True`); nested scans stack once per scan, outermost
  first. A `"clobber"` name first sown inside the scan comes out as the value
  of the last iteration that ran; after a scan of length 0 it has no value and
  is left out of the result. A `"strict"` name cannot be sown inside a scan.
  Outside any scan, an `"append"` name is sown at most once, like a strict one.
- `while_loop` (and `fori_loop` with traced bounds): only `"clobber"` names
  that were already sown before the loop may be sown inside it. A loop may run
  zero times, and a name first sown inside it would then have no value; kups
  does not invent one, so sow an initial value before the loop.
- `cond`/`switch`: the taken branch's values are reaped. A name that did not
  exist before the `cond` must be sown by every branch, with the same shape
  and dtype in each.
- `shard_map`: a name sown inside the body comes out with a new leading axis
  with one entry per shard of the body's manual mesh axes, in mesh order
  (row-major over those axes). Values sown only outside keep their shape.

`reap` consumes the sows of its tag (an enclosing `reap` of the same tag sees
none of them); `plant` keeps them, with the planted values.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.sharding import PartitionSpec
from jax.tree_util import GetAttrKey

from kups.effects import (
    HandlerResult,
    Interpreter,
    ScanSemantics,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    define_effect,
    reinterpret,
    shard_map_axes,
    source_line,
    varying_axes,
)

__all__ = ["MODES", "plant", "reap", "sow"]

MODES = ("strict", "append", "clobber")
"""The modes `sow` accepts."""

# The primitive every `sow` binds. Its name is unique: dispatchers key by name.
_sow_p = define_effect("kups_sow")


# ---------------------------------------------------------------- sow


def sow(value: Any, *, tag: str, name: str, mode: str = "strict") -> Any:
    """Marks `value` as an intermediate that `reap` can read and `plant` replace.

    Outside `reap`/`plant` (or under another tag) it is the identity, also
    under `jit`, `vmap`, `grad` and every control-flow primitive; JAX keeps it
    in the program even when its result is unused.

    **Arguments:**

    - `value`: a pytree of arrays.
    - `tag`: the group this value belongs to; `reap` and `plant` act on one tag.
    - `name`: the value's name within the tag.
    - `mode`: `"strict"` (the name is sown at most once per call), `"clobber"`
      (the last sow wins) or `"append"` (inside `scan`: one value per
      iteration, stacked along the iterations like the scan's outputs).

    **Returns:**

    `value`, or under `plant` the planted value.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import reap, sow


        def f(x):
            y = sow(jnp.sin(x), tag="intermediates", name="y")
            return 2.0 * y


        out, sown = reap(f, tag="intermediates")(1.0)
        assert jnp.allclose(sown["y"], jnp.sin(1.0))
        assert jnp.allclose(out, 2.0 * jnp.sin(1.0))
        ```
    """
    _check_name("tag", tag)
    _check_name("name", name)
    if mode not in MODES:
        raise ValueError(
            f"sow(tag={tag!r}, name={name!r}) got mode={mode!r}; the modes are "
            f"{', '.join(map(repr, MODES))}."
        )
    leaves, treedef = jax.tree.flatten(value)
    for leaf in leaves:
        if not eqx.is_array_like(leaf):
            raise TypeError(
                f"sow(tag={tag!r}, name={name!r}) needs a pytree of arrays, but a leaf of "
                f"the value is a {type(leaf).__name__}: {leaf!r}."
            )
    out = _sow_p.bind(*leaves, tag=tag, name=name, mode=mode, tree=treedef)
    return jax.tree.unflatten(treedef, out)


def _check_name(what: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"The {what} of a sown value must be a non-empty string, got {value!r}.")


# ---------------------------------------------------------------- contexts


@dataclass(frozen=True)
class _NameKey:
    """The key of a sown name in a context's key paths; framework error messages
    print it as `ctx['name' (tag 'tag')]`."""

    tag: str
    name: str

    def __str__(self) -> str:
        return f"[{self.name!r} (tag {self.tag!r})]"


class _Reaped:
    """The context of `reap`: the values sown so far, by name, each with its mode.

    The modes are static (tree aux data), so loop handlers can read them from a
    context whose leaves are abstract.
    """

    def __init__(self, tag: str, values: Mapping[str, Any], modes: Mapping[str, str]):
        self.tag = tag
        self.values = dict(values)
        self.modes = dict(modes)

    def sown(self, name: str, value: Any, mode: str) -> _Reaped:
        return _Reaped(self.tag, {**self.values, name: value}, {**self.modes, name: mode})

    def replace(self, values: Mapping[str, Any]) -> _Reaped:
        """The same names and modes with other values (for example specs)."""
        return _Reaped(self.tag, values, {name: self.modes[name] for name in values})


def _flatten_reaped(ctx: _Reaped) -> tuple[list[tuple[Any, Any]], Any]:
    names = tuple(sorted(ctx.values))
    children = [(_NameKey(ctx.tag, name), ctx.values[name]) for name in names]
    return children, (ctx.tag, names, tuple(ctx.modes[name] for name in names))


def _unflatten_reaped(aux: Any, children: Iterable[Any]) -> _Reaped:
    tag, names, modes = aux
    return _Reaped(tag, dict(zip(names, children, strict=True)), dict(zip(names, modes)))


jax.tree_util.register_pytree_with_keys(_Reaped, _flatten_reaped, _unflatten_reaped)

# How `plant` gets from a planted value to the value one sow receives: the
# planted value's leading axes, outermost first, each either a shard_map's shard
# axes (`(_SHARD, number of manual axes)`: entry 0 of each, once the shard_map
# has split them) or a scan's iteration axis (the scan's level, an int: its
# iteration counter is `counters[level]`).
_SHARD = "shard"


class _Planted:
    """The context of `plant`: the planted values by name, how to index each for
    the sow at hand, and one iteration counter per enclosing scan."""

    def __init__(
        self,
        tag: str,
        values: Mapping[str, Any],
        pending: Mapping[str, tuple[Any, ...]],
        loops: tuple[tuple[int, bool], ...],
        counters: tuple[Any, ...],
    ):
        self.tag = tag
        self.values = dict(values)
        self.pending = {name: pending.get(name, ()) for name in self.values}
        self.loops = loops  # (length, reverse) of each enclosing scan, outermost first
        self.counters = counters

    def replace(
        self,
        *,
        values: Mapping[str, Any] | None = None,
        pending: Mapping[str, tuple[Any, ...]] | None = None,
        loops: tuple[tuple[int, bool], ...] | None = None,
        counters: tuple[Any, ...] | None = None,
    ) -> _Planted:
        return _Planted(
            self.tag,
            self.values if values is None else values,
            self.pending if pending is None else pending,
            self.loops if loops is None else loops,
            self.counters if counters is None else counters,
        )


def _flatten_planted(ctx: _Planted) -> tuple[list[tuple[Any, Any]], Any]:
    names = tuple(sorted(ctx.values))
    children = [(_NameKey(ctx.tag, name), ctx.values[name]) for name in names]
    children.append((GetAttrKey("counters"), ctx.counters))
    pending = tuple(ctx.pending[name] for name in names)
    return children, (ctx.tag, names, pending, ctx.loops)


def _unflatten_planted(aux: Any, children: Iterable[Any]) -> _Planted:
    tag, names, pending, loops = aux
    *values, counters = children
    return _Planted(
        tag, dict(zip(names, values, strict=True)), dict(zip(names, pending)), loops, counters
    )


jax.tree_util.register_pytree_with_keys(_Planted, _flatten_planted, _unflatten_planted)


# ---------------------------------------------------------------- the program, statically

_SOWS: weakref.WeakKeyDictionary[Jaxpr, tuple[JaxprEqn, ...]] = weakref.WeakKeyDictionary()


def _sows_in(jaxpr: Jaxpr | ClosedJaxpr) -> tuple[JaxprEqn, ...]:
    """Every `sow` equation of `jaxpr` and its sub-programs (any tag), cached."""
    open_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    found = _SOWS.get(open_jaxpr)
    if found is None:
        eqns: list[JaxprEqn] = []
        for eqn in open_jaxpr.eqns:
            if eqn.primitive is _sow_p:
                eqns.append(eqn)
            for sub in jaxprs_in_params(eqn.params):
                eqns.extend(_sows_in(sub))
        found = _SOWS[open_jaxpr] = tuple(eqns)
    return found


def _specs_like(value: Any, spec: tuple[Any, ...]) -> Any:
    """`PartitionSpec(*spec)` for every leaf of `value`."""
    return jax.tree.map(lambda _: PartitionSpec(*spec), value)


# ---------------------------------------------------------------- reap


class _Reaper:
    """The handlers of one `reap` call (one tag), and what they remember for
    error messages: where each name was first sown."""

    def __init__(self, tag: str):
        self.tag = tag
        self.first_sown: dict[str, str] = {}

    def sows(self, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        return [eqn for eqn in _sows_in(jaxpr) if eqn.params["tag"] == self.tag]

    def label(self, name: str) -> str:
        return f"kups.harvest: name {name!r} of tag {self.tag!r}"

    def interpreter(self) -> Interpreter:
        dispatcher = default_dispatcher()
        dispatcher.register_handler(_sow_p, self.sow)
        dispatcher.register_handler("scan", self.scan)
        dispatcher.register_handler("while", self.while_loop)
        dispatcher.register_handler("cond", self.cond)
        dispatcher.register_handler("shard_map", self.shard_map)
        return Interpreter(dispatcher, label=f"kups.harvest.reap(tag={self.tag!r})")

    def sow(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        params = eqn.params
        if params["tag"] != self.tag:
            # Another tag's sow stays in the program, for an enclosing reap/plant.
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        name, mode = params["name"], params["mode"]
        if name in ctx.modes:
            before = ctx.modes[name]
            first = self.first_sown.get(name, "unknown")
            if before != mode:
                raise ValueError(
                    f"{self.label(name)} is sown with mode={before!r} at {first} and with "
                    f"mode={mode!r} at {source_line(eqn)}; a name has one mode. Use the same "
                    f"mode for every sow of a name."
                )
            if mode == "strict":
                raise ValueError(
                    f"{self.label(name)} is sown twice with mode='strict': at {first} and "
                    f"again at {source_line(eqn)}. A strict name is sown at most once per call; "
                    f"use mode='clobber' to keep the last value, or another name."
                )
            if mode == "append":
                raise ValueError(
                    f"{self.label(name)} is sown twice with mode='append', at {first} and "
                    f"again at {source_line(eqn)}. 'append' stacks the values of one sow "
                    f"along the iterations of the scans around it; a second sow of the name "
                    f"(outside a scan, or in another scan) has nowhere to go. Use another "
                    f"name, or mode='clobber' to keep the last value."
                )
        else:
            self.first_sown.setdefault(name, source_line(eqn))
        value = jax.tree.unflatten(params["tree"], invals)
        return HandlerResult(ctx.sown(name, value, mode), list(invals))

    def scan(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        for sow_eqn in self.sows(eqn.params["jaxpr"]):
            if sow_eqn.params["mode"] == "strict":
                name = sow_eqn.params["name"]
                raise ValueError(
                    f"{self.label(name)} is sown with mode='strict' at {source_line(sow_eqn)}, "
                    f"inside the scan at {source_line(eqn)}, so it would be sown once per "
                    f"iteration. Use mode='append' to get one value per iteration, or "
                    f"mode='clobber' to get the last iteration's value."
                )
        # Names new in the body come back stacked along the iterations, entry i
        # belonging to xs[i]; names sown before the scan are carried.
        result = default_scan_handler(interpreter, ctx, eqn, invals, threading=ScanSemantics.RESULT)
        out: _Reaped = result.ctx
        length, reverse = eqn.params["length"], eqn.params["reverse"]
        # The last iteration to run is the last entry, or the first one when reversed.
        last = 0 if reverse else -1
        values = {}
        for name, value in out.values.items():
            if name in ctx.values or out.modes[name] != "clobber":
                values[name] = value
            elif length > 0:
                values[name] = jax.tree.map(lambda stacked: stacked[last], value)
            # A clobber name first sown in a scan that never runs has no value.
        return HandlerResult(out.replace(values), result.outvals)

    def while_loop(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        params = eqn.params
        in_condition = self.sows(params["cond_jaxpr"])
        for sow_eqn in [*in_condition, *self.sows(params["body_jaxpr"])]:
            name, mode = sow_eqn.params["name"], sow_eqn.params["mode"]
            where = f"at {source_line(sow_eqn)}, inside the while_loop at {source_line(eqn)}"
            if mode == "append":
                raise ValueError(
                    f"{self.label(name)} is sown with mode='append' {where}. A while loop "
                    f"has no static number of iterations to stack along: use a scan "
                    f"(or fori_loop with static bounds), or mode='clobber' for the last "
                    f"value."
                )
            if mode == "strict":
                raise ValueError(
                    f"{self.label(name)} is sown with mode='strict' {where}, so it would be "
                    f"sown once per iteration. Use mode='clobber' for the last value (and "
                    f"sow an initial value before the loop)."
                )
            if name not in ctx.values:
                raise ValueError(
                    f"{self.label(name)} is first sown {where}. The loop may run zero "
                    f"times, and then the name would have no value; kups does not invent "
                    f"one. Sow an initial value with mode='clobber' before the loop."
                )

        def initializer(ctx_before: Any, sentinel: Any) -> Any:
            del ctx_before, sentinel
            names = sorted({e.params["name"] for e in self.sows(params["body_jaxpr"])})
            raise ValueError(
                f"kups.harvest: the while_loop at {source_line(eqn)} sows {names} (tag "
                f"{self.tag!r}) with a shape or dtype other than the value sown before "
                f"the loop. A while loop carries these values, so each sow must keep the "
                f"shape and dtype of the first one."
            )

        return default_while_handler(
            interpreter,
            ctx,
            eqn,
            invals,
            initializer=initializer,
            thread_condition=bool(in_condition),
        )

    def cond(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        branches = eqn.params["branches"]
        sown = [{e.params["name"]: e for e in self.sows(branch)} for branch in branches]
        new_names = sorted({name for names in sown for name in names} - set(ctx.values))
        for name in new_names:
            with_it = [i for i, names in enumerate(sown) if name in names]
            without = [i for i, names in enumerate(sown) if name not in names]
            if without:
                where = ", ".join(f"{i} (at {source_line(sown[i][name])})" for i in with_it)
                raise ValueError(
                    f"{self.label(name)} is sown in branch {where} of the cond/switch at "
                    f"{source_line(eqn)} but not in branch {', '.join(map(str, without))} (the "
                    f"branches of lax.cond are 0: false_fun, 1: true_fun). The "
                    f"taken branch's value is reaped, so when a branch that does not sow "
                    f"it runs, the name has no value; kups does not invent one. Sow it in "
                    f"every branch (same shape and dtype), or sow an initial value with "
                    f"mode='clobber' before the cond."
                )
        return default_cond_handler(interpreter, ctx, eqn, invals)

    def shard_map(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        _, manual_axes = shard_map_axes(eqn)
        inside = {e.params["name"] for e in self.sows(eqn.params["jaxpr"])}

        def per_shard(ctx: _Reaped) -> _Reaped:
            # Each shard's value becomes its entry along a new leading axis.
            return ctx.replace(
                {
                    name: jax.tree.map(lambda leaf: leaf[None], value) if name in inside else value
                    for name, value in ctx.values.items()
                }
            )

        def out_specs(ctx_tree: _Reaped) -> _Reaped:
            return ctx_tree.replace(
                {
                    name: _specs_like(value, (manual_axes,) if name in inside else ())
                    for name, value in ctx_tree.values.items()
                }
            )

        return default_shard_map_handler(
            interpreter, ctx, eqn, invals, declare_ctx_out_specs=out_specs, reduce_ctx=per_shard
        )


def reap(fn: Callable[..., Any], *, tag: str) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps `fn` so that it also returns the values it sows under `tag`.

    Sows of other tags are left in the program (an enclosing `reap` of their
    tag sees them); sows of `tag` are consumed. See the module documentation for
    what `scan`, `while_loop`, `cond` and `shard_map` do to sown values, and
    `sow` for the modes.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static,
      as in equinox's filter transformations.
    - `tag`: which sows to collect.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, sown)`, where `out` is `fn(*args,
    **kwargs)` and `sown` a `dict` from each name sown under `tag` to its value.
    `wrapped` can be jitted, vmapped and differentiated.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from kups.harvest import reap, sow


        def f(xs):
            def step(total, x):
                total = total + x
                sow(total, tag="trace", name="running_total", mode="append")
                return total, None

            total, _ = jax.lax.scan(step, 0.0, xs)
            return total


        total, sown = jax.jit(reap(f, tag="trace"))(jnp.arange(4.0))
        assert jnp.allclose(sown["running_total"], jnp.array([0.0, 1.0, 3.0, 6.0]))
        ```
    """
    _check_name("tag", tag)
    if not callable(fn):
        raise TypeError(f"reap(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        reaper = _Reaper(tag)
        out, ctx = reinterpret(fn, reaper.interpreter())(_Reaped(tag, {}, {}), *args, **kwargs)
        # A sown constant reaches the handler as a Python scalar: return arrays.
        return out, jax.tree.map(jnp.asarray, ctx.values)

    return wrapped


# ---------------------------------------------------------------- plant


class _Planter:
    """The handlers of one `plant` call (one tag), and the names it saw sown."""

    def __init__(self, tag: str):
        self.tag = tag
        self.seen: set[str] = set()

    def planted_sows(self, ctx: _Planted, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        return [
            eqn
            for eqn in _sows_in(jaxpr)
            if eqn.params["tag"] == self.tag and eqn.params["name"] in ctx.values
        ]

    def interpreter(self) -> Interpreter:
        dispatcher = default_dispatcher()
        dispatcher.register_handler(_sow_p, self.sow)
        dispatcher.register_handler("scan", self.scan)
        dispatcher.register_handler("while", self.while_loop)
        dispatcher.register_handler("shard_map", self.shard_map)
        return Interpreter(dispatcher, label=f"kups.harvest.plant(tag={self.tag!r})")

    def sow(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        params = eqn.params
        name = params["name"]
        if params["tag"] != self.tag:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        self.seen.add(name)
        if name not in ctx.values:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        value = ctx.values[name]
        for op in ctx.pending[name]:
            value = jax.tree.map(functools.partial(_entry, ctx, op), value)
        leaves = _planted_leaves(self.tag, eqn, value, invals)
        # Bound again on the planted value: an enclosing reap of this tag sees it.
        return HandlerResult(ctx, list(_sow_p.bind(*leaves, **params)))

    def scan(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        appended = {
            e.params["name"]
            for e in self.planted_sows(ctx, eqn.params["jaxpr"])
            if e.params["mode"] == "append"
        }
        if not appended:
            return default_scan_handler(interpreter, ctx, eqn, invals)
        length, reverse = eqn.params["length"], eqn.params["reverse"]
        level = len(ctx.loops)
        for name in sorted(appended):
            _check_axis(self.tag, name, ctx, length, f"the scan at {source_line(eqn)}")
        inner = ctx.replace(
            pending={
                name: (*ops, level) if name in appended else ops
                for name, ops in ctx.pending.items()
            },
            loops=(*ctx.loops, (length, reverse)),
            counters=(*ctx.counters, jnp.zeros((), jnp.int32)),
        )

        def next_iteration(carried: _Planted, new: _Planted) -> _Planted:
            del carried
            counters = list(new.counters)
            counters[level] = counters[level] + 1
            return new.replace(counters=tuple(counters))

        result = default_scan_handler(interpreter, inner, eqn, invals, updater=next_iteration)
        # The planted values are carried unchanged: the context from before stands.
        return HandlerResult(ctx, result.outvals)

    def while_loop(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        params = eqn.params
        for sow_eqn in self.planted_sows(ctx, params["body_jaxpr"]):
            if sow_eqn.params["mode"] == "append":
                raise ValueError(
                    f"kups.harvest: name {sow_eqn.params['name']!r} of tag {self.tag!r} is "
                    f"planted and sown with mode='append' at {source_line(sow_eqn)}, inside the "
                    f"while_loop at {source_line(eqn)}: a while loop has no iterations to align "
                    f"a planted stack with. Use a scan, or mode='clobber'."
                )
        in_condition = bool(self.planted_sows(ctx, params["cond_jaxpr"]))
        return default_while_handler(interpreter, ctx, eqn, invals, thread_condition=in_condition)

    def shard_map(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        mesh, manual_axes = shard_map_axes(eqn)
        sows: dict[str, list[JaxprEqn]] = {}
        for sow_eqn in self.planted_sows(ctx, eqn.params["jaxpr"]):
            sows.setdefault(sow_eqn.params["name"], []).append(sow_eqn)
        if not sows:
            return default_shard_map_handler(interpreter, ctx, eqn, invals)
        num_shards = math.prod(mesh.shape[axis] for axis in manual_axes)
        where = f"the shard_map at {source_line(eqn)} (manual axes {manual_axes})"
        # A name sown inside the body was reaped with one entry per shard, along
        # the axis after those already pending. That axis is split into one axis
        # per manual mesh axis, and each shard receives its own entry along the
        # axes over which the sown value varies. Along the others the program
        # keeps the value replicated, so every shard receives the entry at index
        # 0 (a varying value there would break the program's replication).
        values, specs, pending = dict(ctx.values), {}, dict(ctx.pending)
        for name, value in ctx.values.items():
            if name not in sows:
                specs[name] = jax.tree.map(lambda _: PartitionSpec(), value)
                continue
            _check_axis(self.tag, name, ctx, num_shards, where)
            axis = _pending_axes(ctx.pending[name])
            varying = _varying_axes(sows[name], value, manual_axes, eqn.params["check_vma"])
            values[name] = jax.tree.map(
                functools.partial(
                    _split_axis, axis=axis, sizes=[mesh.shape[a] for a in manual_axes]
                ),
                value,
            )
            specs[name] = jax.tree.map(
                functools.partial(_shard_spec, axis=axis, manual_axes=manual_axes), value, varying
            )
            pending[name] = (*ctx.pending[name], (_SHARD, len(manual_axes)))

        def declare_specs(ctx_tree: _Planted) -> _Planted:
            return ctx_tree.replace(
                values=specs, counters=tuple(PartitionSpec() for _ in ctx_tree.counters)
            )

        inner = ctx.replace(values=values, pending=pending)
        result = default_shard_map_handler(
            interpreter,
            inner,
            eqn,
            invals,
            declare_ctx_in_specs=declare_specs,
            declare_ctx_out_specs=declare_specs,
        )
        return HandlerResult(ctx, result.outvals)


def _split_axis(leaf: Any, *, axis: int, sizes: list[int]) -> Any:
    """`leaf` with its axis `axis` split into axes of `sizes`."""
    shape = jnp.shape(leaf)
    return jnp.reshape(leaf, (*shape[:axis], *sizes, *shape[axis + 1 :]))


def _shard_spec(
    leaf: Any, varying: frozenset[Any], *, axis: int, manual_axes: tuple[Any, ...]
) -> PartitionSpec:
    """The in-spec of a planted leaf whose axes from `axis` on are the manual axes."""
    del leaf
    return PartitionSpec(*(None,) * axis, *(a if a in varying else None for a in manual_axes))


def _varying_axes(
    sows: list[JaxprEqn], value: Any, manual_axes: tuple[Any, ...], check_vma: bool
) -> Any:
    """For each leaf of a planted `value`, the manual axes over which the values
    sown into it (by `sows`, inside a shard_map body) vary.

    Without `check_vma`, JAX does not track them: every value may vary.
    """
    treedef = jax.tree.structure(value)
    everywhere = jax.tree.unflatten(treedef, [frozenset(manual_axes)] * treedef.num_leaves)
    if not check_vma or any(e.params["tree"] != treedef for e in sows):
        return everywhere
    per_leaf = [
        frozenset().union(*(varying_axes(e.invars[i].aval) for e in sows))
        for i in range(treedef.num_leaves)
    ]
    return jax.tree.unflatten(treedef, per_leaf)


def _check_axis(tag: str, name: str, ctx: _Planted, size: int, where: str) -> None:
    """The planted value of `name` has `size` entries along its next pending axis."""
    axis = _pending_axes(ctx.pending[name])
    for leaf in jax.tree.leaves(ctx.values[name]):
        shape = jnp.shape(leaf)
        if len(shape) <= axis or shape[axis] != size:
            raise ValueError(
                f"kups.harvest: the value planted for name {name!r} of tag {tag!r} has shape "
                f"{shape}, but {where} needs {size} entries along its axis {axis} (one per "
                f"iteration or shard, as reap returns it)."
            )


def _pending_axes(ops: tuple[Any, ...]) -> int:
    """How many leading axes of a planted value `ops` index away."""
    return sum(op[1] if isinstance(op, tuple) else 1 for op in ops)


def _entry(ctx: _Planted, op: Any, leaf: Any) -> Any:
    """The entry of `leaf` along its leading axis for the current shard or iteration."""
    if isinstance(op, tuple):  # (_SHARD, number of manual axes)
        return leaf[(0,) * op[1]]
    length, reverse = ctx.loops[op]
    if length == 0:
        # The body of a zero-length scan is traced but never runs: any value of the
        # entry's type will do. The (zero) sum over the empty axis keeps the leaf's
        # varying manual axes, which a scan carry inside shard_map must keep.
        return jnp.sum(leaf, axis=0, dtype=jnp.result_type(leaf))
    iteration = ctx.counters[op]
    index = length - 1 - iteration if reverse else iteration
    return jax.lax.dynamic_index_in_dim(leaf, index, axis=0, keepdims=False)


def _planted_leaves(tag: str, eqn: JaxprEqn, value: Any, invals: list[Any]) -> list[Any]:
    """The planted value's leaves, checked against what the sow at `eqn` sows."""
    params = eqn.params
    leaves, treedef = jax.tree.flatten(value)
    sown = jax.tree.unflatten(params["tree"], invals)

    def mismatch(detail: str) -> ValueError:
        return ValueError(
            f"kups.harvest: the value planted for name {params['name']!r} of tag {tag!r} "
            f"does not fit the sow at {source_line(eqn)}: {detail}. Plant a value of the form "
            f"reap returns for this name."
        )

    if treedef != params["tree"]:
        raise mismatch(f"its structure is {treedef}, the sown value's is {params['tree']}")
    out = []
    for leaf, inval in zip(leaves, invals, strict=True):
        leaf_type, sown_type = jax.typeof(leaf), jax.typeof(inval)
        if leaf_type.shape != sown_type.shape:
            raise mismatch(
                f"it has shape {leaf_type.shape} (per sow), the sown value "
                f"{jax.tree.map(jnp.shape, sown)}"
            )
        if leaf_type.dtype != sown_type.dtype:
            if not leaf_type.weak_type:
                raise mismatch(f"it has dtype {leaf_type.dtype}, the sown value {sown_type.dtype}")
            leaf = jax.lax.convert_element_type(leaf, sown_type.dtype)
        out.append(leaf)
    return out


def plant(fn: Callable[..., Any], *, tag: str) -> Callable[..., Any]:
    """Wraps `fn` so that the values it sows under `tag` are replaced by given ones.

    Every sow of a planted name returns the planted value instead of its own;
    names not given keep the program's own values. The planted value of a name
    has the form `reap` returns for it: for an `"append"` name sown in a scan,
    the stack whose entry `i` iteration `i` receives; for a name sown inside a
    `shard_map`, one entry per shard (along manual axes over which the program
    keeps the sown value replicated, such as after a `psum`, every shard
    receives the entry at index 0 of those axes, which keeps it replicated).
    Planted sows stay in the program with the planted value, so an enclosing
    `reap` of the same tag sees what was planted.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static.
    - `tag`: which sows to replace.

    **Returns:**

    `wrapped(values, *args, **kwargs) -> out`, where `values` is a `dict` from
    names to values. Planting a name that `fn` never sows under `tag` is a
    `ValueError` that lists the names it sows. `wrapped` can be jitted,
    vmapped and differentiated (also with respect to `values`).

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import plant, sow


        def f(x):
            y = sow(jnp.sin(x), tag="intermediates", name="y")
            return 2.0 * y


        out = plant(f, tag="intermediates")({"y": 3.0}, 1.0)
        assert jnp.allclose(out, 6.0)
        ```
    """
    _check_name("tag", tag)
    if not callable(fn):
        raise TypeError(f"plant(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")

    @functools.wraps(fn)
    def wrapped(values: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
            raise TypeError(
                f"plant(fn, tag={tag!r}) is called as wrapped(values, *args), with values a "
                f"dict from sown names to values; got {type(values).__name__}: {values!r}."
            )
        planter = _Planter(tag)
        ctx = _Planted(tag, values, {}, (), ())
        out, _ = reinterpret(fn, planter.interpreter())(ctx, *args, **kwargs)
        unknown = sorted(set(values) - set(planter.seen))
        if unknown:
            raise ValueError(
                f"kups.harvest: plant(tag={tag!r}) was given {unknown}, which the function "
                f"never sows under tag {tag!r}. The names it sows under that tag are: "
                f"{sorted(planter.seen) or 'none'}."
            )
        return out

    return wrapped
