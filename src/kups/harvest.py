"""Tagging intermediate values of a program, and reading (`reap`) or replacing
(`plant`) them from outside.

`sow(value, tag=..., name=...)` marks a value inside a program; it returns the
value unchanged and costs nothing when no interpreter looks at it. `reap(fn,
tag=...)` runs `fn` and also returns every value sown under `tag`, by name;
`plant(fn, tag=...)` runs `fn` with sown values replaced by given ones, and
`harvest(fn, tag=...)` does both in one call. `nest(fn, scope=...)` puts the
names `fn` sows under a scope: they come out as `reaped[scope][name]`. All are
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
  of the last iteration that ran; after a scan of length 0 it has the value of
  the sow's `init` if it has one, else no value and it is left out of the
  result. A `"strict"` name cannot be sown inside a scan. Outside any scan, an
  `"append"` name is sown at most once, like a strict one.
- `while_loop` (and `fori_loop` with traced bounds): only `"clobber"` names may
  be sown inside it. A loop may run zero times, and a name first sown inside it
  would then have no value; kups does not invent one. Either sow an initial
  value before the loop, or say what a zero-trip loop yields with
  `sow(..., mode="clobber", init=value)`.
- `cond`/`switch`: the taken branch's values are reaped. A name that did not
  exist before the `cond` must be sown by every branch, with the same shape
  and dtype in each.
- `shard_map`: a name sown inside the body comes out with a new leading axis
  with one entry per shard of the body's manual mesh axes, in mesh order
  (row-major over those axes). Values sown only outside keep their shape.

Which sows a call acts on: those of its `tag` whose names pass `allowlist` and
`blocklist`. `reap` consumes them (an enclosing `reap` of the same tag sees
none of them); `plant` keeps them, with the planted values; `harvest` consumes
them. Sows a call does not act on stay in the program for an enclosing call,
except that with `exclusive=True` the sows of other tags are removed.
"""

from __future__ import annotations

import functools
import math
import numbers
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
    Handler,
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    ScanSemantics,
    check_policy,
    default_cond_handler,
    default_dispatcher,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    define_effect,
    reinterpret,
    shard_map_axes,
    skip_when_untouched,
    source_line,
    varying_axes,
    wraps_with_leading,
)

__all__ = ["MODES", "harvest", "nest", "plant", "reap", "sow"]

MODES = ("strict", "append", "clobber")
"""The modes `sow` accepts."""

# The primitive every `sow` binds. Its name is unique: dispatchers key by name.
# Params: `tag`, `name`, `mode`, `tree` (of the value), `scope` (the scopes of
# the enclosing `nest` calls, outermost first) and `init` (a number or None).
_sow_p = define_effect("kups_sow")

# Where a sown value goes in the result: its scopes, then its name.
_Path = tuple[str, ...]


# ---------------------------------------------------------------- sow


def sow(
    value: Any,
    *,
    tag: str,
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
    - `name`: the value's name within the tag.
    - `mode`: `"strict"` (the name is sown at most once per call), `"clobber"`
      (the last sow wins) or `"append"` (inside `scan`: one value per
      iteration, stacked along the iterations like the scan's outputs).
    - `init`: only with `mode="clobber"`, for a sow inside a loop. A number:
      what `reap` returns for the name when the `while_loop` (or `scan`) in
      which it is first sown runs zero times, filled into the shape and dtype
      of the sown value (every leaf). Without it, a name first sown inside a
      `while_loop` is an error, and one first sown in a zero-length `scan` is
      left out. A value sown before the loop takes precedence.

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
    _check_name("tag", tag)
    _check_name("name", name)
    if mode not in MODES:
        raise ValueError(
            f"sow(tag={tag!r}, name={name!r}) got mode={mode!r}; the modes are "
            f"{', '.join(map(repr, MODES))}."
        )
    if init is not None:
        if mode != "clobber":
            raise ValueError(
                f"sow(tag={tag!r}, name={name!r}, mode={mode!r}) got init={init!r}; init is "
                f"what a loop that runs zero times yields for a mode='clobber' name. Use "
                f"mode='clobber', or leave init out."
            )
        if not isinstance(init, numbers.Number):
            raise TypeError(
                f"sow(tag={tag!r}, name={name!r}) got init of type {type(init).__name__}; "
                f"init is a number (such as 0.0 or float('nan')), filled into the shape and "
                f"dtype of the sown value."
            )
    leaves, treedef = jax.tree.flatten(value)
    for leaf in leaves:
        if not eqx.is_array_like(leaf):
            raise TypeError(
                f"sow(tag={tag!r}, name={name!r}) needs a pytree of arrays, but a leaf of "
                f"the value is a {type(leaf).__name__}: {leaf!r}."
            )
    out = _sow_p.bind(*leaves, tag=tag, name=name, mode=mode, tree=treedef, scope=(), init=init)
    return jax.tree.unflatten(treedef, out)


def _check_name(what: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"The {what} of a sown value must be a non-empty string, got {value!r}.")


def _path_of(eqn: JaxprEqn) -> _Path:
    return (*eqn.params["scope"], eqn.params["name"])


def _show(path: _Path) -> str:
    """A path as users write it in messages: `"scope/name"`."""
    return "/".join(path)


def _named(path: _Path) -> str:
    """`name 'x'`, or `name 'x' in scope 'a'` inside `nest`."""
    name, scope = path[-1], path[:-1]
    return f"name {name!r} in scope {_show(scope)!r}" if scope else f"name {name!r}"


def _describe(tag: str, path: _Path) -> str:
    return f"kups.harvest: {_named(path)} of tag {tag!r}"


# ---------------------------------------------------------------- which sows a call takes


def _entries(caller: str, what: str, entries: Any) -> frozenset[_Path] | None:
    """`allowlist`/`blocklist` as a set of paths (a name is a path of length 1)."""
    if entries is None:
        return None
    if isinstance(entries, str | bytes):
        raise TypeError(
            f"{caller}({what}={entries!r}) takes an iterable of names, not a single string "
            f"(which would be read as its characters). Write {what}=[{entries!r}]."
        )
    if not isinstance(entries, Iterable):
        raise TypeError(
            f"{caller}({what}=...) takes an iterable of names, such as a list of strings; got "
            f"{type(entries).__name__}: {entries!r}."
        )
    paths = set()
    for entry in entries:
        if isinstance(entry, str) and entry:
            paths.add((entry,))
        elif (
            isinstance(entry, tuple)
            and entry
            and all(isinstance(part, str) and part for part in entry)
        ):
            paths.add(entry)
        else:
            raise TypeError(
                f"{caller}({what}=...) got the entry {entry!r}; an entry is a name (a non-empty "
                f"string) or, for names inside nest scopes, a tuple of scopes and name such "
                f"as ('scope', 'name')."
            )
    return frozenset(paths)


@dataclass(frozen=True)
class _Selection:
    """Which sows a `reap`, `plant` or `harvest` call acts on."""

    tag: str
    allowlist: frozenset[_Path] | None
    blocklist: frozenset[_Path]
    exclusive: bool

    @classmethod
    def of(
        cls, caller: str, tag: str, allowlist: Any, blocklist: Any, exclusive: Any
    ) -> _Selection:
        _check_name("tag", tag)
        allowed = _entries(caller, "allowlist", allowlist)
        blocked = _entries(caller, "blocklist", blocklist) or frozenset()
        both = sorted(blocked & allowed) if allowed is not None else []
        if both:
            raise ValueError(
                f"{caller}(tag={tag!r}) has {[_show(path) for path in both]} in both allowlist "
                f"and blocklist; say once whether a name is taken. Remove it from one of them."
            )
        if not isinstance(exclusive, bool):
            raise TypeError(
                f"{caller}(tag={tag!r}) got exclusive={exclusive!r}; it is True or False."
            )
        return cls(tag, allowed, blocked, exclusive)

    def takes(self, path: _Path) -> bool:
        """Whether a sow of this tag at `path` passes the allowlist and blocklist.
        An entry covers the names it is a prefix of (a scope covers its names)."""

        def listed(entries: frozenset[_Path]) -> bool:
            return any(path[: len(entry)] == entry for entry in entries)

        if self.allowlist is not None and not listed(self.allowlist):
            return False
        return not listed(self.blocklist)

    def selects(self, eqn: JaxprEqn) -> bool:
        return eqn.params["tag"] == self.tag and self.takes(_path_of(eqn))

    def __str__(self) -> str:
        parts = [f"tag={self.tag!r}"]
        if self.allowlist is not None:
            parts.append(f"allowlist={sorted(map(_show, self.allowlist))}")
        if self.blocklist:
            parts.append(f"blocklist={sorted(map(_show, self.blocklist))}")
        if self.exclusive:
            parts.append("exclusive=True")
        return ", ".join(parts)


def _untaken(
    selection: _Selection, interpreter: Interpreter, ctx: Any, eqn: JaxprEqn, invals: list[Any]
) -> HandlerResult | None:
    """What becomes of a sow the call does not act on, or `None` if it acts on it."""
    if eqn.params["tag"] != selection.tag:
        if selection.exclusive:
            # Removed: no enclosing reap or plant sees it.
            return HandlerResult(ctx, list(invals))
        return default_primitive_handler(interpreter, ctx, eqn, invals)
    if not selection.takes(_path_of(eqn)):
        # Left in the program as it is, for an enclosing call of this tag.
        return default_primitive_handler(interpreter, ctx, eqn, invals)
    return None


# ---------------------------------------------------------------- contexts


@dataclass(frozen=True)
class _NameKey:
    """The key of a sown name in a context's key paths; framework error messages
    print it as `ctx['name' (tag 'tag')]` (`'scope/name'` inside `nest`)."""

    tag: str
    path: _Path

    def __str__(self) -> str:
        return f"[{_show(self.path)!r} (tag {self.tag!r})]"


class _Reaped:
    """The context of `reap`: the values sown so far, by path, each with its mode.

    The modes are static (tree aux data), so loop handlers can read them from a
    context whose leaves are abstract.
    """

    def __init__(self, tag: str, values: Mapping[_Path, Any], modes: Mapping[_Path, str]):
        self.tag = tag
        self.values = dict(values)
        self.modes = dict(modes)

    def sown(self, path: _Path, value: Any, mode: str) -> _Reaped:
        return _Reaped(self.tag, {**self.values, path: value}, {**self.modes, path: mode})

    def replace(self, values: Mapping[_Path, Any]) -> _Reaped:
        """The same paths and modes with other values (for example specs)."""
        return _Reaped(self.tag, values, {path: self.modes[path] for path in values})


def _flatten_reaped(ctx: _Reaped) -> tuple[list[tuple[Any, Any]], Any]:
    paths = tuple(sorted(ctx.values))
    children = [(_NameKey(ctx.tag, path), ctx.values[path]) for path in paths]
    return children, (ctx.tag, paths, tuple(ctx.modes[path] for path in paths))


def _unflatten_reaped(aux: Any, children: Iterable[Any]) -> _Reaped:
    tag, paths, modes = aux
    return _Reaped(tag, dict(zip(paths, children, strict=True)), dict(zip(paths, modes)))


jax.tree_util.register_pytree_with_keys(_Reaped, _flatten_reaped, _unflatten_reaped)

# How `plant` gets from a planted value to the value one sow receives: the
# planted value's leading axes, outermost first, each either a shard_map's shard
# axes (`(_SHARD, number of manual axes)`: entry 0 of each, once the shard_map
# has split them) or a scan's iteration axis (the scan's level, an int: its
# iteration counter is `counters[level]`).
_SHARD = "shard"


class _Planted:
    """The context of `plant`: the planted values as the user gave them (scopes
    are nested dicts), how to index the value at each path for the sow at hand,
    and one iteration counter per enclosing scan."""

    def __init__(
        self,
        tag: str,
        values: Mapping[str, Any],
        pending: Mapping[_Path, tuple[Any, ...]],
        loops: tuple[tuple[int, bool], ...],
        counters: tuple[Any, ...],
    ):
        self.tag = tag
        self.values = dict(values)
        self.pending = {path: ops for path, ops in pending.items() if ops}
        self.loops = loops  # (length, reverse) of each enclosing scan, outermost first
        self.counters = counters

    def ops(self, path: _Path) -> tuple[Any, ...]:
        return self.pending.get(path, ())

    def replace(
        self,
        *,
        values: Mapping[str, Any] | None = None,
        pending: Mapping[_Path, tuple[Any, ...]] | None = None,
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
    children = [(_NameKey(ctx.tag, (name,)), ctx.values[name]) for name in names]
    children.append((GetAttrKey("counters"), ctx.counters))
    return children, (ctx.tag, names, tuple(sorted(ctx.pending.items())), ctx.loops)


def _unflatten_planted(aux: Any, children: Iterable[Any]) -> _Planted:
    tag, names, pending, loops = aux
    *values, counters = children
    return _Planted(tag, dict(zip(names, values, strict=True)), dict(pending), loops, counters)


jax.tree_util.register_pytree_with_keys(_Planted, _flatten_planted, _unflatten_planted)

_MISSING = object()


def _lookup(tag: str, values: Mapping[str, Any], path: _Path, eqn: JaxprEqn) -> Any:
    """The planted value at `path` (scopes are nested dicts), or `_MISSING`."""
    node: Any = values
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping):
            raise TypeError(
                f"{_describe(tag, path)} is sown at {source_line(eqn)}, inside scope "
                f"{_show(path[:depth])!r}, but the value planted for {_show(path[:depth])!r} is "
                f"a {type(node).__name__}, not a dict. Plant the names of a scope as a dict: "
                f"values[scope][name], as reap returns them."
            )
        if key not in node:
            return _MISSING
        node = node[key]
    return node


def _replace_at(tree: Any, path: _Path, new: Any) -> Any:
    """`tree` (nested dicts) with the entry at `path` replaced by `new`."""
    if not path:
        return new
    return {**tree, path[0]: _replace_at(tree[path[0]], path[1:], new)}


def _unused(values: Mapping[str, Any], used: set[_Path], prefix: _Path = ()) -> list[_Path]:
    """The paths of `values` that no sow used (a scope counts as a dict of names)."""
    unused = []
    for key, value in values.items():
        path = (*prefix, key)
        if path in used:
            continue
        inside = any(p[: len(path)] == path for p in used)
        if inside and isinstance(value, Mapping):
            unused.extend(_unused(value, used, path))
        else:
            unused.append(path)
    return unused


def _nested(values: Mapping[_Path, Any]) -> dict[str, Any]:
    """Values by path as nested dicts: `{("a", "x"): v}` becomes `{"a": {"x": v}}`."""
    out: dict[str, Any] = {}
    for path in sorted(values):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = values[path]
    return out


def _same_number(a: Any, b: Any) -> bool:
    return bool(a == b or (a != a and b != b))  # NaN is NaN


def _init_of(tag: str, path: _Path, sows: list[JaxprEqn]) -> JaxprEqn | None:
    """The sow among `sows` that gives `path` its `init`, or `None`."""
    given = [e for e in sows if _path_of(e) == path and e.params["init"] is not None]
    for other in given[1:]:
        if not _same_number(other.params["init"], given[0].params["init"]):
            raise ValueError(
                f"{_describe(tag, path)} is sown with init={given[0].params['init']!r} at "
                f"{source_line(given[0])} and with init={other.params['init']!r} at "
                f"{source_line(other)}, in the same loop. Give the same init to both, or to one."
            )
    return given[0] if given else None


def _filled(tag: str, sow_eqn: JaxprEqn, like: Any) -> Any:
    """An array of `like`'s shape and dtype filled with the `init` of `sow_eqn`,
    which that dtype must hold (an integer leaf cannot hold NaN or 0.5; JAX
    would convert it silently)."""
    dtype, init = like.dtype, sow_eqn.params["init"]
    value = complex(init)
    if jnp.issubdtype(dtype, jnp.bool_):
        fits = value in (0, 1)
    elif jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        fits = (
            not value.imag
            and math.isfinite(value.real)
            and value.real == int(value.real)
            and info.min <= int(value.real) <= info.max
        )
    elif jnp.issubdtype(dtype, jnp.floating):
        fits = not value.imag
    else:
        fits = True
    if not fits:
        raise ValueError(
            f"{_describe(tag, _path_of(sow_eqn))} is sown at {source_line(sow_eqn)} with "
            f"init={init!r}, which a leaf of dtype {jnp.dtype(dtype).name} of the sown value "
            f"cannot hold. init fills every leaf: give one that each leaf's dtype holds "
            f"exactly, or sow an initial value before the loop."
        )
    return jnp.full(
        like.shape, init if jnp.issubdtype(dtype, jnp.complexfloating) else value.real, dtype
    )


# ---------------------------------------------------------------- the program, statically

_SOWS: weakref.WeakKeyDictionary[Jaxpr, tuple[JaxprEqn, ...]] = weakref.WeakKeyDictionary()


@functools.cache
def _interpreted() -> frozenset[str]:
    """The control-flow primitives whose sub-programs the interpreters walk: those
    of JAX. Any other (a library's own) runs unchanged under `policy=IGNORE` or
    `WARN`, so the sows inside it are not seen."""
    return frozenset(default_dispatcher().handlers)


def _sows_in(jaxpr: Jaxpr | ClosedJaxpr) -> tuple[JaxprEqn, ...]:
    """Every `sow` equation of `jaxpr` and its sub-programs (any tag) that the
    interpreters see, cached."""
    open_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    found = _SOWS.get(open_jaxpr)
    if found is None:
        eqns: list[JaxprEqn] = []
        for eqn in open_jaxpr.eqns:
            if eqn.primitive is _sow_p:
                eqns.append(eqn)
            elif eqn.primitive.name in _interpreted():
                for sub in jaxprs_in_params(eqn.params):
                    eqns.extend(_sows_in(sub))
        found = _SOWS[open_jaxpr] = tuple(eqns)
    return found


def _specs_like(value: Any, spec: tuple[Any, ...]) -> Any:
    """`PartitionSpec(*spec)` for every leaf of `value`."""
    return jax.tree.map(lambda _: PartitionSpec(*spec), value)


# ---------------------------------------------------------------- reap


def _interpreter(
    selection: _Selection,
    caller: str,
    policy: InterpreterPolicy,
    sow: Handler,
    loops: dict[str, Handler],
) -> Interpreter:
    """The interpreter of a reap or plant: `sow` for the sow primitive, and the
    `loops` handlers, which act only when a sow is inside (so control flow with
    none is re-bound whole)."""
    dispatcher = default_dispatcher().register_handler(_sow_p, sow)
    for name, handler in loops.items():
        dispatcher.register_handler(name, skip_when_untouched(handler))

    def acts_on(effect: Any, params: Mapping[str, Any]) -> bool:
        # Whether a sow bound with `params` is one this call takes.
        return effect is not _sow_p or (
            params["tag"] == selection.tag and selection.takes((*params["scope"], params["name"]))
        )

    return Interpreter(
        dispatcher,
        policy=policy,
        label=f"kups.harvest.{caller}({selection})",
        policy_hint=f"{caller}(fn, policy=...)",
        acts_on=acts_on,
    )


class _Reaper:
    """The handlers of one `reap` call (one tag), and what they remember for
    error messages: where each name was first sown."""

    def __init__(self, selection: _Selection):
        self.selection = selection
        self.tag = selection.tag
        self.first_sown: dict[_Path, str] = {}

    def sows(self, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        return [eqn for eqn in _sows_in(jaxpr) if self.selection.selects(eqn)]

    def label(self, path: _Path) -> str:
        return _describe(self.tag, path)

    def interpreter(self, caller: str, policy: InterpreterPolicy) -> Interpreter:
        loops = {
            "scan": self.scan,
            "while": self.while_loop,
            "cond": self.cond,
            "shard_map": self.shard_map,
        }
        return _interpreter(self.selection, caller, policy, self.sow, loops)

    def result(self, ctx: _Reaped) -> dict[str, Any]:
        """The reaped values as nested dicts (a scope is a dict of its names)."""
        scopes = {path[:depth]: path for path in self.first_sown for depth in range(1, len(path))}
        for path in sorted(set(scopes) & set(self.first_sown)):
            inner = scopes[path]
            raise ValueError(
                f"{self.label(path)} is sown at {self.first_sown[path]}, and "
                f"{_show(path)!r} is also the scope of {_show(inner)!r}, sown at "
                f"{self.first_sown[inner]}: the result cannot hold both a value and a dict of "
                f"names under one key. Rename the name or the nest scope."
            )
        # A sown constant reaches the handler as a Python scalar: return arrays.
        return _nested(jax.tree.map(jnp.asarray, ctx.values))

    def sow(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        untaken = _untaken(self.selection, interpreter, ctx, eqn, invals)
        if untaken is not None:
            return untaken
        params = eqn.params
        path, mode = _path_of(eqn), params["mode"]
        if path in ctx.modes:
            before = ctx.modes[path]
            first = self.first_sown.get(path, "unknown")
            if before != mode:
                raise ValueError(
                    f"{self.label(path)} is sown with mode={before!r} at {first} and with "
                    f"mode={mode!r} at {source_line(eqn)}; a name has one mode. Use the same "
                    f"mode for every sow of a name."
                )
            if mode == "strict":
                raise ValueError(
                    f"{self.label(path)} is sown twice with mode='strict': at {first} and "
                    f"again at {source_line(eqn)}. A strict name is sown at most once per call; "
                    f"use mode='clobber' to keep the last value, or another name."
                )
            if mode == "append":
                raise ValueError(
                    f"{self.label(path)} is sown twice with mode='append', at {first} and "
                    f"again at {source_line(eqn)}. 'append' stacks the values of one sow "
                    f"along the iterations of the scans around it; a second sow of the name "
                    f"(outside a scan, or in another scan) has nowhere to go. Use another "
                    f"name, or mode='clobber' to keep the last value."
                )
        else:
            self.first_sown.setdefault(path, source_line(eqn))
        value = jax.tree.unflatten(params["tree"], invals)
        return HandlerResult(ctx.sown(path, value, mode), list(invals))

    def scan(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        in_body = self.sows(eqn.params["jaxpr"])
        for sow_eqn in in_body:
            if sow_eqn.params["mode"] == "strict":
                raise ValueError(
                    f"{self.label(_path_of(sow_eqn))} is sown with mode='strict' at "
                    f"{source_line(sow_eqn)}, inside the scan at {source_line(eqn)}, so it would "
                    f"be sown once per iteration. Use mode='append' to get one value per "
                    f"iteration, or mode='clobber' to get the last iteration's value."
                )
        # Names new in the body come back stacked along the iterations, entry i
        # belonging to xs[i]; names sown before the scan are carried.
        result = default_scan_handler(interpreter, ctx, eqn, invals, threading=ScanSemantics.RESULT)
        out: _Reaped = result.ctx
        length, reverse = eqn.params["length"], eqn.params["reverse"]
        # The last iteration to run is the last entry, or the first one when reversed.
        last = 0 if reverse else -1
        values = {}
        for path, value in out.values.items():
            if path in ctx.values or out.modes[path] != "clobber":
                values[path] = value
            elif length > 0:
                values[path] = jax.tree.map(lambda stacked: stacked[last], value)
            else:
                # A clobber name first sown in a scan that never runs has no value,
                # unless its sow says what a zero-trip loop yields.
                init = _init_of(self.tag, path, in_body)
                if init is not None:
                    values[path] = jax.tree.map(
                        lambda stacked, init=init: _filled(
                            self.tag, init, jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype)
                        ),
                        value,
                    )
        return HandlerResult(out.replace(values), result.outvals)

    def while_loop(
        self, interpreter: Interpreter, ctx: _Reaped, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        params = eqn.params
        in_condition = self.sows(params["cond_jaxpr"])
        in_loop = [*in_condition, *self.sows(params["body_jaxpr"])]
        inits: dict[_Path, JaxprEqn] = {}
        for sow_eqn in in_loop:
            path, mode = _path_of(sow_eqn), sow_eqn.params["mode"]
            where = f"at {source_line(sow_eqn)}, inside the while_loop at {source_line(eqn)}"
            if mode == "append":
                raise ValueError(
                    f"{self.label(path)} is sown with mode='append' {where}. A while loop "
                    f"has no static number of iterations to stack along: use a scan "
                    f"(or fori_loop with static bounds), or mode='clobber' for the last "
                    f"value."
                )
            if mode == "strict":
                raise ValueError(
                    f"{self.label(path)} is sown with mode='strict' {where}, so it would be "
                    f"sown once per iteration. Use mode='clobber' for the last value (and "
                    f"sow an initial value before the loop, or give the sow init=)."
                )
            if path not in ctx.values:
                init = _init_of(self.tag, path, in_loop)
                if init is None:
                    raise ValueError(
                        f"{self.label(path)} is first sown {where}. The loop may run zero "
                        f"times, and then the name would have no value; kups does not invent "
                        f"one. Sow an initial value with mode='clobber' before the loop, or "
                        f"say what a zero-trip loop yields with "
                        f"sow(..., mode='clobber', init=<number>)."
                    )
                inits[path] = init

        def initializer(ctx_before: _Reaped, sentinel: _Reaped) -> _Reaped:
            new = [path for path in sentinel.values if path not in ctx_before.values]
            if not new:
                names = sorted({_show(_path_of(e)) for e in in_loop})
                raise ValueError(
                    f"kups.harvest: the while_loop at {source_line(eqn)} sows {names} (tag "
                    f"{self.tag!r}) with a shape or dtype other than the value sown before "
                    f"the loop. A while loop carries these values, so each sow must keep the "
                    f"shape and dtype of the first one."
                )
            values = dict(sentinel.values)
            for path in new:
                values[path] = jax.tree.map(
                    functools.partial(_filled, self.tag, inits[path]),
                    sentinel.values[path],
                )
            return sentinel.replace(values)

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
        sown = [{_path_of(e): e for e in self.sows(branch)} for branch in branches]
        new_paths = sorted({path for paths in sown for path in paths} - set(ctx.values))
        for path in new_paths:
            with_it = [i for i, paths in enumerate(sown) if path in paths]
            without = [i for i, paths in enumerate(sown) if path not in paths]
            if without:
                where = ", ".join(f"{i} (at {source_line(sown[i][path])})" for i in with_it)
                raise ValueError(
                    f"{self.label(path)} is sown in branch {where} of the cond/switch at "
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
        inside = {_path_of(e) for e in self.sows(eqn.params["jaxpr"])}

        def per_shard(ctx: _Reaped) -> _Reaped:
            # Each shard's value becomes its entry along a new leading axis.
            return ctx.replace(
                {
                    path: jax.tree.map(lambda leaf: leaf[None], value) if path in inside else value
                    for path, value in ctx.values.items()
                }
            )

        def out_specs(ctx_tree: _Reaped) -> _Reaped:
            return ctx_tree.replace(
                {
                    path: _specs_like(value, (manual_axes,) if path in inside else ())
                    for path, value in ctx_tree.values.items()
                }
            )

        return default_shard_map_handler(
            interpreter, ctx, eqn, invals, declare_ctx_out_specs=out_specs, reduce_ctx=per_shard
        )


def reap(
    fn: Callable[..., Any],
    *,
    tag: str,
    allowlist: Iterable[str | tuple[str, ...]] | None = None,
    blocklist: Iterable[str | tuple[str, ...]] | None = None,
    exclusive: bool = False,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps `fn` so that it also returns the values it sows under `tag`.

    Sows of other tags, and sows that `allowlist`/`blocklist` leave out, stay in
    the program as they are (an enclosing `reap` or `plant` sees them); the sows
    `reap` takes are consumed. See the module documentation for what `scan`,
    `while_loop`, `cond` and `shard_map` do to sown values, and `sow` for the
    modes.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static,
      as in equinox's filter transformations.
    - `tag`: which sows to collect.
    - `allowlist`: if given, an iterable of names: only these are collected. An
      entry is a name as it appears in the result: a top-level name, or a
      `nest` scope (all the names in it); a tuple `("scope", "name")` picks a
      name inside a scope.
    - `blocklist`: an iterable of names (as for `allowlist`) not to collect.
      A name in both lists is an error.
    - `exclusive`: if `True`, sows of other tags are removed while `fn` runs,
      so no enclosing `reap` or `plant` sees them.
    - `policy`: what to do with a control-flow primitive kups has no handler
      for (a library's own, such as lineax's `linear_solve`) when a sow is
      inside it: `InterpreterPolicy.RAISE` (the default) raises
      `NotImplementedError` naming the primitive, since the sow would be lost;
      `WARN` warns and runs it unchanged; `IGNORE` runs it unchanged. A sow
      inside a primitive run unchanged is not reaped (nor planted). Such a
      primitive with no sow inside always runs unchanged.

    **Returns:**

    `wrapped(*args, **kwargs) -> (out, sown)`, where `out` is `fn(*args,
    **kwargs)` and `sown` a `dict` from each name sown under `tag` to its value
    (names sown inside `nest(..., scope=s)` under `sown[s]`, a `dict` of
    them). `wrapped` can be jitted, vmapped and differentiated.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from kups.harvest import reap, sow


        def f(xs):
            def step(total, x):
                total = total + x
                sow(total, tag="trace", name="running_total", mode="append")
                sow(x * x, tag="trace", name="square", mode="append")
                return total, None

            total, _ = jax.lax.scan(step, 0.0, xs)
            return total


        total, sown = jax.jit(reap(f, tag="trace"))(jnp.arange(4.0))
        assert jnp.allclose(sown["running_total"], jnp.array([0.0, 1.0, 3.0, 6.0]))
        _, only_totals = reap(f, tag="trace", allowlist=["running_total"])(jnp.arange(4.0))
        assert list(only_totals) == ["running_total"]
        ```
    """
    selection = _Selection.of("reap", tag, allowlist, blocklist, exclusive)
    if not callable(fn):
        raise TypeError(f"reap(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "reap(fn, policy=...)")

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        reaper = _Reaper(selection)
        interpreter = reaper.interpreter("reap", policy)
        out, ctx = reinterpret(fn, interpreter)(_Reaped(tag, {}, {}), *args, **kwargs)
        return out, reaper.result(ctx)

    return wrapped


# ---------------------------------------------------------------- plant


class _Planter:
    """The handlers of one `plant` call (one tag), and the names it saw sown.

    With `consume`, a planted sow is removed from the program (as `harvest`
    does) instead of being bound again on the planted value."""

    def __init__(self, selection: _Selection, *, consume: bool = False):
        self.selection = selection
        self.tag = selection.tag
        self.consume = consume
        self.seen: set[_Path] = set()  # the paths of the sows it acts on
        self.left_out: set[_Path] = set()  # sows of its tag that allowlist/blocklist leave out

    def planted_sows(self, ctx: _Planted, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        return [
            eqn
            for eqn in _sows_in(jaxpr)
            if self.selection.selects(eqn)
            and _lookup(self.tag, ctx.values, _path_of(eqn), eqn) is not _MISSING
        ]

    def interpreter(self, caller: str, policy: InterpreterPolicy) -> Interpreter:
        loops = {"scan": self.scan, "while": self.while_loop, "shard_map": self.shard_map}
        return _interpreter(self.selection, caller, policy, self.sow, loops)

    def check_all_used(self, caller: str, values: Mapping[str, Any]) -> None:
        unused = sorted(_unused(values, self.seen))
        if not unused:
            return
        left_out = [
            _show(path)
            for path in unused
            if any(sown[: len(path)] == path for sown in self.left_out)
        ]
        note = (
            f" The function sows {left_out}, but allowlist/blocklist leave them out."
            if left_out
            else ""
        )
        raise ValueError(
            f"kups.harvest: {caller}(tag={self.tag!r}) was given {[_show(p) for p in unused]}, "
            f"which the function never sows under tag {self.tag!r}.{note} The names it sows "
            f"under that tag are: {sorted(map(_show, self.seen)) or 'none'}."
        )

    def sow(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        path = _path_of(eqn)
        untaken = _untaken(self.selection, interpreter, ctx, eqn, invals)
        if untaken is not None:
            if eqn.params["tag"] == self.tag:
                self.left_out.add(path)
            return untaken
        self.seen.add(path)
        value = _lookup(self.tag, ctx.values, path, eqn)
        if value is _MISSING:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        for op in ctx.ops(path):
            value = jax.tree.map(functools.partial(_entry, ctx, op), value)
        leaves = _planted_leaves(self.tag, eqn, value, invals)
        if self.consume:
            return HandlerResult(ctx, leaves)
        # Bound again on the planted value: an enclosing reap of this tag sees it.
        return HandlerResult(ctx, list(_sow_p.bind(*leaves, **eqn.params)))

    def scan(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        appended = {
            _path_of(e)
            for e in self.planted_sows(ctx, eqn.params["jaxpr"])
            if e.params["mode"] == "append"
        }
        if not appended:
            return default_scan_handler(interpreter, ctx, eqn, invals)
        length, reverse = eqn.params["length"], eqn.params["reverse"]
        level = len(ctx.loops)
        for path in sorted(appended):
            _check_axis(self.tag, path, ctx, length, f"the scan at {source_line(eqn)}", eqn)
        inner = ctx.replace(
            pending={
                **ctx.pending,
                **{path: (*ctx.ops(path), level) for path in appended},
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
                    f"{_describe(self.tag, _path_of(sow_eqn))} is planted and sown with "
                    f"mode='append' at {source_line(sow_eqn)}, inside the while_loop at "
                    f"{source_line(eqn)}: a while loop has no iterations to align a planted "
                    f"stack with. Use a scan, or mode='clobber'."
                )
        in_condition = bool(self.planted_sows(ctx, params["cond_jaxpr"]))
        return default_while_handler(interpreter, ctx, eqn, invals, thread_condition=in_condition)

    def shard_map(
        self, interpreter: Interpreter, ctx: _Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        mesh, manual_axes = shard_map_axes(eqn)
        sows: dict[_Path, list[JaxprEqn]] = {}
        for sow_eqn in self.planted_sows(ctx, eqn.params["jaxpr"]):
            sows.setdefault(_path_of(sow_eqn), []).append(sow_eqn)
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
        values: Any = ctx.values
        specs: Any = jax.tree.map(lambda _: PartitionSpec(), ctx.values)
        pending = dict(ctx.pending)
        for path, path_sows in sorted(sows.items()):
            _check_axis(self.tag, path, ctx, num_shards, where, path_sows[0])
            value = _lookup(self.tag, ctx.values, path, path_sows[0])
            axis = _pending_axes(ctx.ops(path))
            varying = _varying_axes(path_sows, value, manual_axes, eqn.params["check_vma"])
            split = functools.partial(
                _split_axis, axis=axis, sizes=[mesh.shape[a] for a in manual_axes]
            )
            values = _replace_at(values, path, jax.tree.map(split, value))
            spec = functools.partial(_shard_spec, axis=axis, manual_axes=manual_axes)
            specs = _replace_at(specs, path, jax.tree.map(spec, value, varying))
            pending[path] = (*ctx.ops(path), (_SHARD, len(manual_axes)))

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


def _check_axis(tag: str, path: _Path, ctx: _Planted, size: int, where: str, eqn: JaxprEqn) -> None:
    """The planted value at `path` has `size` entries along its next pending axis."""
    axis = _pending_axes(ctx.ops(path))
    for leaf in jax.tree.leaves(_lookup(tag, ctx.values, path, eqn)):
        shape = jnp.shape(leaf)
        if len(shape) <= axis or shape[axis] != size:
            raise ValueError(
                f"kups.harvest: the value planted for {_named(path)} of tag {tag!r} "
                f"has shape {shape}, but {where} needs {size} entries along its axis {axis} (one "
                f"per iteration or shard, as reap returns it)."
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
            f"kups.harvest: the value planted for {_named(_path_of(eqn))} of tag {tag!r} "
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


def _check_values(caller: str, tag: str, values: Any) -> None:
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(
            f"{caller}(fn, tag={tag!r}) is called as wrapped(values, *args), with values a "
            f"dict from sown names to values; got {type(values).__name__}: {values!r}."
        )


def _planted_call(
    fn: Callable[..., Any],
    selection: _Selection,
    caller: str,
    consume: bool,
    policy: InterpreterPolicy,
    values: Mapping[str, Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    planter = _Planter(selection, consume=consume)
    ctx = _Planted(selection.tag, values, {}, (), ())
    out, _ = reinterpret(fn, planter.interpreter(caller, policy))(ctx, *args, **kwargs)
    planter.check_all_used(caller, values)
    return out


def plant(
    fn: Callable[..., Any],
    *,
    tag: str,
    allowlist: Iterable[str | tuple[str, ...]] | None = None,
    blocklist: Iterable[str | tuple[str, ...]] | None = None,
    exclusive: bool = False,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., Any]:
    """Wraps `fn` so that the values it sows under `tag` are replaced by given ones.

    Every sow of a planted name returns the planted value instead of its own;
    names not given keep the program's own values. The planted value of a name
    has the form `reap` returns for it: for an `"append"` name sown in a scan,
    the stack whose entry `i` iteration `i` receives; for a name sown inside a
    `shard_map`, one entry per shard (along manual axes over which the program
    keeps the sown value replicated, such as after a `psum`, every shard
    receives the entry at index 0 of those axes, which keeps it replicated);
    for names sown inside `nest(..., scope=s)`, a `dict` of them under `s`.
    Planted sows stay in the program with the planted value, so an enclosing
    `reap` of the same tag sees what was planted.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static.
    - `tag`: which sows to replace.
    - `allowlist`, `blocklist`: which names to replace, as for `reap`. Sows
      they leave out keep their values and stay in the program.
    - `exclusive`: if `True`, sows of other tags are removed while `fn` runs,
      so no enclosing `reap` or `plant` sees them.
    - `policy`: for a control-flow primitive kups has no handler for, with a
      sow inside, as for `reap`.

    **Returns:**

    `wrapped(values, *args, **kwargs) -> out`, where `values` is a `dict` from
    names to values. Planting a name that `fn` never sows under `tag` (or that
    `allowlist`/`blocklist` leave out) is a `ValueError` that lists the names
    it sows. `wrapped` can be jitted, vmapped and differentiated (also with
    respect to `values`).

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
    selection = _Selection.of("plant", tag, allowlist, blocklist, exclusive)
    if not callable(fn):
        raise TypeError(f"plant(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "plant(fn, policy=...)")

    @wraps_with_leading(fn, "values")
    def wrapped(values: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        _check_values("plant", tag, values)
        return _planted_call(fn, selection, "plant", False, policy, values, *args, **kwargs)

    return wrapped


# ---------------------------------------------------------------- harvest


def harvest(
    fn: Callable[..., Any],
    *,
    tag: str,
    allowlist: Iterable[str | tuple[str, ...]] | None = None,
    blocklist: Iterable[str | tuple[str, ...]] | None = None,
    exclusive: bool = False,
    policy: InterpreterPolicy = InterpreterPolicy.RAISE,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps `fn` so that it plants given values and reaps the others, in one call.

    As in Oryx, the sows of `tag` are split in two: those whose names are in
    `values` are planted (the program sees the planted value), all the others
    are reaped. A planted name is therefore not in the reaped `dict`: its value
    is the one you passed (`{**values, **reaped}` holds every name). Every sow
    `harvest` acts on is consumed: an enclosing `reap` or `plant` of the same tag
    sees none of them. `harvest(fn, tag=t)({}, *args)` is `reap(fn, tag=t)(*args)`.

    **Arguments:**

    - `fn`: the function to run. Its arguments that are not arrays are static.
    - `tag`: which sows to act on.
    - `allowlist`, `blocklist`, `exclusive`, `policy`: as for `reap`; they
      apply to planting and reaping alike.

    **Returns:**

    `wrapped(values, *args, **kwargs) -> (out, reaped)`, with `values` as for
    `plant` and `reaped` as `reap` returns it. `fn` is traced once; planting
    and reaping are two interpretation passes over that one trace (the
    planter's per-iteration scan counters need a loop updater, which the
    stacking that reaping uses does not take). `wrapped` can be jitted, vmapped
    and differentiated.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import harvest, sow


        def f(x):
            y = sow(x + 1.0, tag="intermediate", name="y")
            z = sow(y * 2.0, tag="intermediate", name="z")
            return z + 1.0


        out, reaped = harvest(f, tag="intermediate")({"y": 0.0}, 1.0)
        assert out == 1.0 and list(reaped) == ["z"] and reaped["z"] == 0.0
        out, reaped = harvest(f, tag="intermediate")({}, 1.0)
        assert out == 5.0 and reaped["y"] == 2.0 and reaped["z"] == 4.0
        ```
    """
    selection = _Selection.of("harvest", tag, allowlist, blocklist, exclusive)
    if not callable(fn):
        raise TypeError(f"harvest(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "harvest(fn, policy=...)")
    planted = functools.partial(_planted_call, fn, selection, "harvest", True, policy)

    @wraps_with_leading(fn, "values")
    def wrapped(values: Mapping[str, Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        _check_values("harvest", tag, values)
        reaper = _Reaper(selection)
        interpreter = reaper.interpreter("harvest", policy)
        out, ctx = reinterpret(planted, interpreter)(_Reaped(tag, {}, {}), values, *args, **kwargs)
        return out, reaper.result(ctx)

    return wrapped


# ---------------------------------------------------------------- nest


def nest(
    fn: Callable[..., Any], *, scope: str, policy: InterpreterPolicy = InterpreterPolicy.RAISE
) -> Callable[..., Any]:
    """Wraps `fn` so that the names it sows (of every tag) live in `scope`.

    `reap` returns them as `reaped[scope][name]` and `plant` takes them as
    `values[scope][name]`, so two calls of one function can sow the same names
    without clashing. Nesting composes: `nest(nest(f, scope="a"), scope="b")`
    sows into `reaped["b"]["a"]`. Outside `reap`/`plant`, the wrapped function
    is `fn`; it works through every control-flow primitive like `sow` itself.

    **Arguments:**

    - `fn`: the function whose sows to scope. Its arguments that are not arrays
      are static.
    - `scope`: a non-empty string, the key of the scope in the result. It must
      not also be a name sown next to it.
    - `policy`: for a control-flow primitive kups has no handler for, with a
      sow inside, as for `reap` (a sow inside one run unchanged keeps its
      unscoped name).

    **Returns:**

    `wrapped(*args, **kwargs) -> out`, the same output as `fn`.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import nest, plant, reap, sow


        def layer(x):
            return sow(jnp.tanh(x), tag="activations", name="out")


        def model(x):
            return nest(layer, scope="second")(nest(layer, scope="first")(x))


        out, sown = reap(model, tag="activations")(0.5)
        assert sown["first"]["out"] == jnp.tanh(0.5)
        assert sown["second"]["out"] == out
        assert plant(model, tag="activations")({"second": {"out": 7.0}}, 0.5) == 7.0
        ```
    """
    if not isinstance(scope, str) or not scope:
        raise TypeError(f"nest(fn, scope=...) needs a non-empty string scope, got {scope!r}.")
    if not callable(fn):
        raise TypeError(f"nest(fn, scope=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "nest(fn, policy=...)")

    def rescope(
        interpreter: Interpreter, ctx: Any, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        del interpreter
        params = eqn.params
        return HandlerResult(
            ctx, list(_sow_p.bind(*invals, **{**params, "scope": (scope, *params["scope"])}))
        )

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        dispatcher = default_dispatcher().register_handler(_sow_p, rescope)
        interpreter = Interpreter(
            dispatcher, policy=policy, label=f"kups.harvest.nest(scope={scope!r})"
        )
        interpreter.policy_hint = "nest(fn, policy=...)"
        out, _ = reinterpret(fn, interpreter)((), *args, **kwargs)
        return out

    return wrapped
