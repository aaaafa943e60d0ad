"""`plant`: replacing the values a program sows under a tag."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn
from jax.sharding import PartitionSpec

from kups.effects import (
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    check_policy,
    default_cond_handler,
    default_custom_jvp_handler,
    default_custom_vjp_handler,
    default_library_primitive_handler,
    default_primitive_handler,
    default_scan_handler,
    default_shard_map_handler,
    default_while_handler,
    reinterpret,
    shard_map_axes,
    source_line,
    stage_eagerly,
    wraps_with_leading,
)

from ._names import SowPath, Tag, path_of, show_path
from ._planted import (
    MISSING,
    SHARD,
    Planted,
    check_axis,
    entry_for,
    lookup,
    pending_axes,
    planted_leaves,
    replace_at,
    shard_spec,
    split_axis,
    unused_paths,
    varying_axes_of,
)
from ._rules import check_cond, check_scan, check_while, given_by_init
from ._selection import Selection, pass_through, selective_interpreter, sows_in
from ._sow import constant_sows, sow_p, split_operands

# The handlers whose derivative rules run the user's code again: `plant` has
# them interpret those rules (see `Planter.custom_derivative`).
_DERIVATIVE_HANDLERS = {
    "custom_jvp_call": default_custom_jvp_handler,
    "custom_vjp_call": default_custom_vjp_handler,
    "linear_solve": default_library_primitive_handler,
    "vprim": default_library_primitive_handler,
}


class Planter:
    """The handlers of one `plant` call (one tag), and the names it saw sown.

    With `consume`, a planted sow is removed from the program (as `harvest`
    does) instead of being bound again on the planted value. With `add`, the
    planted value is added to the sown one instead of replacing it (how
    `reap_grads` perturbs sown values)."""

    def __init__(self, selection: Selection, *, consume: bool = False, add: bool = False):
        self.selection = selection
        self.tag = selection.tag
        self.consume = consume
        self.add = add
        self.seen: set[SowPath] = set()  # the paths of the sows it acts on
        self.left_out: set[SowPath] = set()  # sows of its tag that allowlist/blocklist leave out

    def planted_sows(self, ctx: Planted, jaxpr: Jaxpr | ClosedJaxpr) -> list[JaxprEqn]:
        return [
            eqn
            for eqn in sows_in(jaxpr)
            if self.selection.selects(eqn)
            and lookup(self.tag, ctx.values, path_of(eqn), eqn) is not MISSING
        ]

    def interpreter(self, caller: str, policy: InterpreterPolicy) -> Interpreter:
        loops = {
            "scan": self.scan,
            "while": self.while_loop,
            "cond": self.cond,
            "shard_map": self.shard_map,
        }
        # The sows in the rules of custom_jvp and custom_vjp functions, and of
        # library primitives (lineax's tangent solves), are planted too, whenever
        # JAX runs them (see `custom_derivative`).
        always = dict.fromkeys(_DERIVATIVE_HANDLERS, self.custom_derivative)
        return selective_interpreter(self.selection, caller, policy, self.sow, loops, always)

    def check_all_used(self, caller: str, values: Mapping[str, Any]) -> None:
        unused = sorted(unused_paths(values, self.seen))
        if not unused:
            return

        def left_out(path: SowPath) -> bool:
            return any(sown[: len(path)] == path for sown in self.left_out)

        never = [show_path(path) for path in unused if not left_out(path)]
        filtered = [show_path(path) for path in unused if left_out(path)]
        given = []
        if never:
            given.append(f"{never}, which the function never sows under tag {self.tag!r}")
        if filtered:
            given.append(
                f"{filtered}, which the function sows under tag {self.tag!r} but "
                f"allowlist/blocklist leave out"
            )
        raise ValueError(
            f"kups.harvest: {caller}({self.selection}) was given {'; and '.join(given)}. The "
            f"names it sows under tag {self.tag!r} that this call acts on are: "
            f"{sorted(map(show_path, self.seen)) or 'none'}. Plant only those, or change "
            f"allowlist/blocklist."
        )

    def sow(
        self, interpreter: Interpreter, ctx: Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        path = path_of(eqn)
        untaken = pass_through(self.selection, interpreter, ctx, eqn, invals)
        if untaken is not None:
            if eqn.params["tag"] == self.tag:
                self.left_out.add(path)
            return untaken
        self.seen.add(path)
        value = lookup(self.tag, ctx.values, path, eqn)
        if value is MISSING:
            return default_primitive_handler(interpreter, ctx, eqn, invals)
        for op in ctx.ops(path):
            value = jax.tree.map(functools.partial(entry_for, ctx, op), value)
        pred, own = split_operands(eqn.params, invals)
        leaves = planted_leaves(self.tag, eqn, value, own)
        if self.add:
            leaves = [old + new for new, old in zip(leaves, own, strict=True)]
        if pred is not None:  # a sow_cond: planted where pred holds
            leaves = [jnp.where(pred, new, old) for new, old in zip(leaves, own, strict=True)]
        operands = leaves if pred is None else [pred, *leaves]
        if self.consume:
            return HandlerResult(ctx, operands)
        # Bound again on the planted value: an enclosing reap of this tag sees it.
        return HandlerResult(ctx, list(sow_p.bind(*operands, **eqn.params)))

    def custom_derivative(
        self, interpreter: Interpreter, ctx: Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        # JAX runs the rules when it differentiates the function: their sows are
        # planted too (equinox's checkpointed loops and diffrax's adjoints run
        # the user's code again in their rules).
        result = _DERIVATIVE_HANDLERS[eqn.primitive.name](
            interpreter, ctx, eqn, invals, interpret_rule=self.changes, tracing_rule=self.constant
        )
        # The planted values go on as they came, with their derivatives (the
        # context a custom derivative returns has none).
        return HandlerResult(ctx, result.outvals)

    def constant(self, ctx: Planted) -> contextlib.AbstractContextManager[None]:
        """While a derivative rule is traced: a sow whose value this call plants
        (and does not add to) has a zero tangent, as it has outside the rule,
        where JAX differentiates the planted program."""

        return constant_sows(lambda params: not self.add and self.plants(ctx, params))

    def changes(self, ctx: Planted, eqn: JaxprEqn) -> bool:
        """Whether `eqn`, in a derivative rule, is a sow that this call plants."""
        return eqn.primitive is sow_p and self.plants(ctx, eqn.params)

    def plants(self, ctx: Planted, params: Mapping[str, Any]) -> bool:
        path = (*params["scope"], params["name"])
        return (
            params["tag"] == self.tag
            and self.selection.takes(path)
            and _lookup_path(ctx.values, path) is not MISSING
        )

    def scan(
        self, interpreter: Interpreter, ctx: Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        planted = self.planted_sows(ctx, eqn.params["jaxpr"])
        check_scan(self.tag, planted, eqn)
        appended = {path_of(e) for e in planted if e.params["mode"] == "append"}
        if not appended:
            return default_scan_handler(interpreter, ctx, eqn, invals)
        length, reverse = eqn.params["length"], eqn.params["reverse"]
        level = len(ctx.loops)
        for path in sorted(appended):
            check_axis(self.tag, path, ctx, length, f"the scan at {source_line(eqn)}", eqn)
        inner = ctx.replace(
            pending={
                **ctx.pending,
                **{path: (*ctx.ops(path), level) for path in appended},
            },
            loops=(*ctx.loops, (length, reverse)),
            counters=(*ctx.counters, jnp.zeros((), jnp.int32)),
        )

        def next_iteration(carried: Planted, new: Planted) -> Planted:
            del carried
            counters = list(new.counters)
            counters[level] = counters[level] + 1
            return new.replace(counters=tuple(counters))

        result = default_scan_handler(interpreter, inner, eqn, invals, updater=next_iteration)
        # The planted values are carried unchanged: the context from before stands.
        return HandlerResult(ctx, result.outvals)

    def while_loop(
        self, interpreter: Interpreter, ctx: Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        params = eqn.params
        in_condition = self.planted_sows(ctx, params["cond_jaxpr"])
        check_while(self.tag, [*in_condition, *self.planted_sows(ctx, params["body_jaxpr"])], eqn)
        return default_while_handler(
            interpreter, ctx, eqn, invals, thread_condition=bool(in_condition)
        )

    def cond(
        self, interpreter: Interpreter, ctx: Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        branches = [self.planted_sows(ctx, branch) for branch in eqn.params["branches"]]
        sown = [{path_of(e): e for e in sows} for sows in branches]
        # As in `reap`: a name that a branch does not sow may have its `init` then.
        given = {path for path, _ in given_by_init(self.tag, branches, self.seen)}
        check_cond(self.tag, sown, eqn, self.seen | given)
        return default_cond_handler(interpreter, ctx, eqn, invals)

    def shard_map(
        self, interpreter: Interpreter, ctx: Planted, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        mesh, manual_axes = shard_map_axes(eqn)
        sows: dict[SowPath, list[JaxprEqn]] = {}
        for sow_eqn in self.planted_sows(ctx, eqn.params["jaxpr"]):
            sows.setdefault(path_of(sow_eqn), []).append(sow_eqn)
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
            check_axis(self.tag, path, ctx, num_shards, where, path_sows[0])
            value = lookup(self.tag, ctx.values, path, path_sows[0])
            axis = pending_axes(ctx.ops(path))
            varying = varying_axes_of(path_sows, value, manual_axes, eqn.params["check_vma"])
            split = functools.partial(
                split_axis, axis=axis, sizes=[mesh.shape[a] for a in manual_axes]
            )
            values = replace_at(values, path, jax.tree.map(split, value))
            spec = functools.partial(shard_spec, axis=axis, manual_axes=manual_axes)
            specs = replace_at(specs, path, jax.tree.map(spec, value, varying))
            pending[path] = (*ctx.ops(path), (SHARD, len(manual_axes)))

        def declare_specs(ctx_tree: Planted) -> Planted:
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


def _lookup_path(values: Mapping[str, Any], path: SowPath) -> Any:
    node: Any = values
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return MISSING
        node = node[key]
    return node


def check_values(caller: str, tag: Tag, values: Any) -> None:
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(
            f"{caller}(fn, tag={tag!r}) is called as wrapped(values, *args), with values a "
            f"dict from sown names to values; got {type(values).__name__}: {values!r}."
        )


def planted_call(
    fn: Callable[..., Any],
    selection: Selection,
    caller: str,
    consume: bool,
    policy: InterpreterPolicy,
    values: Mapping[str, Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    planter = Planter(selection, consume=consume)
    ctx = Planted(selection.tag, values, {}, (), ())
    out, _ = reinterpret(fn, planter.interpreter(caller, policy))(ctx, *args, **kwargs)
    planter.check_all_used(caller, values)
    return out


def plant(
    fn: Callable[..., Any],
    *,
    tag: Tag,
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
    selection = Selection.of("plant", tag, allowlist, blocklist, exclusive)
    if not callable(fn):
        raise TypeError(f"plant(fn, tag=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "plant(fn, policy=...)")

    @wraps_with_leading(fn, "values")
    def wrapped(values: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        check_values("plant", tag, values)
        return planted_call(fn, selection, "plant", False, policy, values, *args, **kwargs)

    return stage_eagerly(wrapped)
