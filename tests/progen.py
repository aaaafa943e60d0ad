"""A seeded random generator of JAX programs, for differential fuzzing of kups.

`generate(seed)` composes elementwise ops, reductions, sorts and cumulative ops
with `scan`, `fori_loop` (its scan and its while form), `while_loop`, `cond`,
`switch` (2 to 4 branches), `checkpoint`, `jit`, `custom_jvp`/`custom_vjp`
wrappers and `shard_map` on a 4x2 mesh (full and partial manual, `check_vma` on
and off) with `psum`, `pmax`, `all_gather`, `ppermute` and `axis_index`,
nested up to three deep. With `effects=True` it also sprinkles `sow`s (every
mode, where the contract allows them) and `check`s.

About a fifth of the programs are *explicit*: their arguments are placed on the
same 4x2 mesh with Explicit axes (sharding in types, replicated), each
`shard_map` runs on that mesh with its operands `reshard`ed to its `in_specs`
first (JAX checks them against the operands' shardings) and its result
resharded back to replicated, and they may also hold `reshard` round trips
through a sharded layout and `auto_axes` regions (whose bodies close over
nothing and hold no shard_map). The threaded twin runs the same program on the
Auto mesh, where shardings change nothing it counts or threads.

Every program exists twice, as Python source:

- `Program.source`, the program as a user writes it (`program(a, b)`), which is
  what the fuzzer runs through kups and what a reproducer prints;
- `Program.threaded_source`, a plain-JAX twin (`program_threaded(a, b)`) that
  threads a state by hand, without kups: how many times each tracked op family
  ran (loop trip counts, taken branches and shards included), the values each
  `sow` would reap, and the first failing `check`. It is the oracle for
  `count_primitives`, `reap` and `checked`.

Collectives never run under a per-shard predicate (that deadlocks the CPU
runtime): inside `shard_map`, a `cond`/`switch`/`while` whose subtree holds a
collective gets a predicate computed from a `psum` (replicated); one with a
per-shard predicate gets a collective-free subtree.

Counts are compared on op *families* (`FAMILIES`): the primitives the generator
emits itself, never the ones JAX inserts for its own bookkeeping (`add` for loop
indices, `lt` in loop conditions, `pvary`, `convert_element_type`, ...). A
family may have several primitive names (`psum` binds `psum_invariant` under
`check_vma=True`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import random
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Only effective before JAX is imported (tests/conftest.py does the same).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

TAG = "fuzz"
N = 16  # length of the program's vectors, outside shard_map
DMAX = 4  # loop depth bound of the threaded error record
SMAX = 2  # shard-axis bound of the threaded error record
MESH_SHAPE = {"x": 4, "y": 2}

# Op family -> the primitive names it binds.
FAMILIES: dict[str, tuple[str, ...]] = {
    "sin": ("sin",),
    "cos": ("cos",),
    "tanh": ("tanh",),
    "exp": ("exp",),
    "abs": ("abs",),
    "neg": ("neg",),
    "mul": ("mul",),
    "sub": ("sub",),
    "max": ("max",),
    "reduce_sum": ("reduce_sum",),
    "reduce_max": ("reduce_max",),
    "sort": ("sort",),
    "cumsum": ("cumsum",),
    "cummax": ("cummax",),
    "psum": ("psum", "psum_invariant"),
    "pmax": ("pmax",),
    "all_gather": ("all_gather",),
    "ppermute": ("ppermute",),
    "axis_index": ("axis_index",),
}


def family_counts(counts: dict[str, Any]) -> dict[str, int]:
    """Primitive counts (as `count_primitives` returns them) summed by family."""
    return {fam: sum(int(counts.get(name, 0)) for name in names) for fam, names in FAMILIES.items()}


# An op: (arity, source template, families it counts). `{0}`, `{1}` are
# operands; `{AX}` the manual axes of the enclosing shard_map, `{A1}` one of them,
# `{PERM}` a cyclic permutation along `{A1}`.
OPS: dict[str, tuple[int, str, tuple[str, ...]]] = {
    "sin": (1, "jnp.sin({0})", ("sin",)),
    "cos": (1, "jnp.cos({0})", ("cos",)),
    "tanh": (1, "jnp.tanh({0})", ("tanh",)),
    "expna": (1, "jnp.exp(-jnp.abs({0}))", ("abs", "neg", "exp")),
    "scale": (1, "{0} * 0.75", ("mul",)),
    "mul": (2, "{0} * {1}", ("mul",)),
    "sub": (2, "{0} - {1}", ("sub",)),
    "add": (2, "{0} + {1}", ()),
    "max": (2, "jnp.maximum({0}, {1})", ("max",)),
    "sum": (2, "{0} + jnp.sum({1}) * 0.125", ("reduce_sum", "mul")),
    "maxred": (2, "{0} - jnp.max({1})", ("reduce_max", "sub")),
    "sort": (1, "jnp.sort({0})", ("sort",)),
    "cumsum": (1, "jnp.cumsum({0}) * 0.25", ("cumsum", "mul")),
    "cummax": (1, "lax.cummax({0})", ("cummax",)),
}
SHARD_OPS: dict[str, tuple[int, str, tuple[str, ...]]] = {
    "axis_index": (1, "{0} * lax.axis_index({A1}).astype(jnp.float32)", ("axis_index", "mul")),
}
COLLECTIVE_OPS: dict[str, tuple[int, str, tuple[str, ...]]] = {
    "psum": (2, "{0} + lax.psum(jnp.sum({1}), {AX}) * 0.125", ("reduce_sum", "psum", "mul")),
    "pmax": (2, "{0} - lax.pmax(jnp.max({1}), {AX})", ("reduce_max", "pmax", "sub")),
    "all_gather": (
        2,
        "{0} + jnp.sum(lax.all_gather({1}, {A1}), axis=0) * 0.25",
        ("all_gather", "reduce_sum", "mul"),
    ),
    "ppermute": (1, "lax.ppermute({0}, {A1}, {PERM})", ("ppermute",)),
}
BOUNDED = ("sin", "cos", "tanh")


# ---------------------------------------------------------------------------
# The program tree.
# ---------------------------------------------------------------------------


@dataclass
class Shard:
    axes: tuple[str, ...]  # this shard_map's manual axes, mesh order
    all_axes: tuple[str, ...]  # every manual axis in scope (for check coordinates)
    check_vma: bool

    @property
    def size(self) -> int:
        return int(np.prod([MESH_SHAPE[a] for a in self.axes]))


@dataclass
class Op:
    out: str
    kind: str
    args: tuple[str, ...]
    template: str
    families: tuple[str, ...]


@dataclass
class Pcast:  # plain only: make a replicated input vary over the manual axes
    var: str
    axes: tuple[str, ...]


@dataclass
class Pred:
    out: str
    src: str
    kind: str  # "cond", "switch", "trip"
    axes: tuple[str, ...] | None  # psum over these first (replicated), or None
    num_branches: int = 2
    clamp: bool = False
    trips: tuple[int, int] = (0, 0)  # "trip": (low, high)

    @property
    def families(self) -> tuple[str, ...]:
        fams = ["reduce_sum"]
        if self.axes is not None:
            fams.append("psum")
        if self.kind == "switch":
            fams += ["abs", "mul"]
        return tuple(fams)


@dataclass
class Block:
    name: str
    params: list[str]  # vector params (a fori/while body also gets the index)
    stmts: list[Any]
    result: str
    n: int
    index_param: bool = False  # a fori body: `(i, c)`


@dataclass
class Scan:
    out: str
    init: str
    xsrc: str | None
    length: int
    reverse: bool
    unroll: int
    body: Block


@dataclass
class Fori:
    out: str
    init: str
    trips: int | str  # static (scan form) or a Pred var (while form)
    body: Block


@dataclass
class While:
    out: str
    init: str
    trips: str  # a Pred var
    cond_sin: bool  # a tracked op in the condition too
    body: Block


@dataclass
class Cond:
    out: str
    pred: str
    operands: tuple[str, ...]
    branches: list[Block]
    switch: bool


@dataclass
class Wrap:
    out: str
    kind: str  # jit, checkpoint, custom_jvp, custom_vjp
    operands: tuple[str, ...]
    body: Block
    policy: str | None = None


@dataclass
class ShardMap:
    out: str
    operands: tuple[str, ...]
    shard: Shard
    replicated: bool  # in_specs/out_specs P() rather than sharded
    jit: bool
    body: Block
    explicit: bool = False  # on the Explicit mesh, operands resharded to in_specs


@dataclass
class Reshard:  # explicit programs: sin of `src` in a sharded layout, then back
    out: str
    src: str
    axes: tuple[str, ...]


@dataclass
class Sow:
    out: str
    src: str
    name: str
    mode: str
    n: int


@dataclass
class Check:
    site: int
    src: str
    threshold: float
    depth: int  # enclosing loops
    shard_axes: tuple[str, ...]
    line: int = 0  # filled in when the plain source is emitted


@dataclass
class Scope:
    n: int
    visible: list[str]
    depth: int
    shard: Shard | None = None
    collectives: bool = False
    loops: tuple[str, ...] = ()  # "scan" / "while", outermost first
    under_cond: bool = False
    # Whether this code runs eagerly when the program is called: the top level, and
    # the bodies JAX runs as they are (custom_jvp/custom_vjp, an unjitted shard_map).
    eager: bool = True
    in_auto: bool = False  # inside an auto_axes region: no shard_map, no reshard

    def free_sow_modes(self) -> tuple[str, ...]:
        if self.under_cond or "while" in self.loops:
            return ()
        if self.loops:
            return ("append", "clobber")
        return ("strict", "clobber", "append")


# ---------------------------------------------------------------------------
# Generation.
# ---------------------------------------------------------------------------

CONTROL_FLOW = (
    "scan",
    "scan_noxs",
    "fori",
    "fori_traced",
    "while",
    "cond",
    "switch",
    "jit",
    "checkpoint",
    "custom_jvp",
    "custom_vjp",
    "shard_map",
)
POLICIES = (
    None,
    "jax.checkpoint_policies.nothing_saveable",
    "jax.checkpoint_policies.everything_saveable",
)


class Generator:
    def __init__(
        self,
        seed: int,
        *,
        effects: bool = False,
        explicit: bool = False,
        max_depth: int = 3,
        budget: int = 3,
    ) -> None:
        self.rng = random.Random(seed)
        self.effects = effects
        self.explicit = explicit
        self.max_depth = max_depth
        self.budget = budget  # control-flow nodes left
        self.counter = 0
        self.sites: list[Check] = []
        self.concrete: set[str] = set()  # variables that hold concrete arrays eagerly
        self.features: set[str] = set()

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    # -- blocks ---------------------------------------------------------------

    def block(
        self,
        params: list[str],
        scope: Scope,
        *,
        prefix: list[Any] | None = None,
        final_sow: tuple[str, str] | None = None,
        index_param: bool = False,
        size: tuple[int, int] = (1, 3),
    ) -> Block:
        rng = self.rng
        name = self.fresh("f")
        stmts: list[Any] = list(prefix or [])
        local = list(params)
        if index_param:
            # Mix the fori index into the carry (params: [i, c]).
            out = self.fresh("v")
            stmts.append(
                Op(
                    out,
                    "index",
                    (local[0],),
                    "{0} * (i.astype(jnp.float32) * 0.25 + 1.0)",
                    ("mul", "mul"),
                )
            )
            local.append(out)
        inner = dataclasses.replace(scope, visible=[*scope.visible, *local])
        if scope.eager:
            self.concrete.update(local)
        last = local[-1]
        for _ in range(rng.randint(*size)):
            stmts.extend(self.statement(inner))
            if not isinstance(stmts[-1], Check):
                last = stmts[-1].out
                inner.visible.append(last)
                if scope.eager:
                    self.concrete.add(last)
        result = self.fresh("v")
        kind = rng.choice(BOUNDED)
        stmts.append(Op(result, kind, (last,), OPS[kind][1], OPS[kind][2]))
        if final_sow is not None:
            sown = self.fresh("v")
            stmts.append(Sow(sown, result, final_sow[0], final_sow[1], scope.n))
            result = sown
        return Block(name, params, stmts, result, scope.n, index_param)

    # -- statements -----------------------------------------------------------

    def statement(self, scope: Scope) -> list[Any]:
        rng = self.rng
        if scope.depth < self.max_depth and self.budget > 0 and rng.random() < 0.45:
            return self.control_flow(scope)
        if self.explicit and self.layout_free(scope) and rng.random() < 0.15:
            self.features.add("reshard")
            axes = rng.choice((("x", "y"), ("x",), ("y",)))
            return [Reshard(self.fresh("v"), rng.choice(scope.visible), axes)]
        if self.effects:
            modes = scope.free_sow_modes()
            roll = rng.random()
            if modes and roll < 0.2:
                self.features.add("sow")
                src = rng.choice(scope.visible)
                return [Sow(self.fresh("v"), src, self.fresh("s"), rng.choice(modes), scope.n)]
            if roll < 0.35:
                return [self.check(scope)]
        return [self.op(scope)]

    def layout_free(self, scope: Scope) -> bool:
        """Whether values here have a sharding type of their own (explicit programs,
        outside shard_map bodies and auto_axes regions)."""
        return scope.shard is None and not scope.in_auto

    def check(self, scope: Scope) -> Check:
        self.features.add("check")
        site = Check(
            site=len(self.sites),
            src=self.rng.choice(scope.visible),
            threshold=self.rng.choice((0.0, 0.3, 0.6, 0.9, 0.99, 1.5)),
            depth=len(scope.loops),
            shard_axes=scope.shard.all_axes if scope.shard else (),
        )
        self.sites.append(site)
        return site

    def op(self, scope: Scope) -> Op:
        rng = self.rng
        table = dict(OPS)
        if scope.shard is not None:
            table.update(SHARD_OPS)
            if scope.collectives:
                table.update(COLLECTIVE_OPS)
                # Collectives often, so that shard_map bodies exercise them.
                if rng.random() < 0.5:
                    table = dict(COLLECTIVE_OPS)
        kind = rng.choice(sorted(table))
        arity, template, families = table[kind]
        args = tuple(rng.choice(scope.visible) for _ in range(arity))
        if scope.shard is not None:
            axes = scope.shard.axes
            one = rng.choice(axes)
            perm = [(i, (i + 1) % MESH_SHAPE[one]) for i in range(MESH_SHAPE[one])]
            many = rng.choice([axes, (one,)])
            template = template.replace("{AX}", repr(many)).replace("{A1}", repr(one))
            template = template.replace("{PERM}", repr(perm))
            if kind in COLLECTIVE_OPS or kind == "axis_index":
                self.features.add(kind)
        return Op(self.fresh("v"), kind, args, template, families)

    def pred(self, scope: Scope, kind: str, *, replicated: bool, **kwargs: Any) -> Pred:
        axes = scope.shard.axes if (replicated and scope.shard is not None) else None
        return Pred(self.fresh("p"), self.rng.choice(scope.visible), kind, axes, **kwargs)

    def subscope(self, scope: Scope, *, per_shard_pred: bool = False, **changes: Any) -> Scope:
        changes.setdefault("depth", scope.depth + 1)
        changes.setdefault("eager", False)
        if per_shard_pred:
            changes["collectives"] = False
        return dataclasses.replace(scope, **changes)

    def control_flow(self, scope: Scope) -> list[Any]:
        rng = self.rng
        self.budget -= 1
        kinds = [
            k
            for k in CONTROL_FLOW
            if k != "shard_map" or (scope.shard is None and not scope.in_auto)
        ]
        if self.explicit and self.layout_free(scope):
            kinds.append("auto_axes")
        kind = rng.choice(kinds)
        if self.explicit and "shard_map" in kinds and rng.random() < 0.3:
            kind = "shard_map"  # what explicit programs are most about
        elif "auto_axes" in kinds and rng.random() < 0.2:
            kind = "auto_axes"
        self.features.add(kind)
        out = self.fresh("v")
        pick = lambda: rng.choice(scope.visible)  # noqa: E731
        # Inside shard_map with collectives allowed: replicated predicate, or a
        # per-shard one with a collective-free subtree.
        replicated = scope.collectives and rng.random() < 0.6
        per_shard = scope.shard is not None and not replicated
        if kind in ("scan", "scan_noxs"):
            length = rng.choice((0, 1, 2, 3))
            inner = self.subscope(scope, loops=(*scope.loops, "scan"))
            params = ["c", "x"] if kind == "scan" else ["c"]
            body = self.block(params, inner)
            xsrc = pick() if kind == "scan" else None
            return [Scan(out, pick(), xsrc, length, rng.random() < 0.3, rng.choice((1, 2)), body)]
        if kind == "fori":
            inner = self.subscope(scope, loops=(*scope.loops, "scan"))
            body = self.block(["c"], inner, index_param=True)
            return [Fori(out, pick(), rng.choice((0, 1, 2, 3)), body)]
        if kind in ("fori_traced", "while"):
            self.features.add("while_form")
            trips = self.pred(
                scope, "trip", replicated=replicated, trips=(rng.randint(0, 2), rng.randint(0, 2))
            )
            inner = self.subscope(scope, per_shard_pred=per_shard, loops=(*scope.loops, "while"))
            pre: list[Any] = [trips]
            final_sow = None
            init = pick()
            sows_here = self.effects and "clobber" in scope.free_sow_modes()
            if kind == "while" and sows_here and rng.random() < 0.5:
                # A clobber name sown before the loop and in its body.
                self.features.add("sow")
                name = self.fresh("s")
                sown = self.fresh("v")
                pre.append(Sow(sown, init, name, "clobber", scope.n))
                init, final_sow = sown, (name, "clobber")
            if kind == "fori_traced":
                body = self.block(["c"], inner, index_param=True)
                return [*pre, Fori(out, init, trips.out, body)]
            body = self.block(["c"], inner, final_sow=final_sow)
            return [*pre, While(out, init, trips.out, rng.random() < 0.5, body)]
        if kind in ("cond", "switch"):
            num = 2 if kind == "cond" else rng.randint(2, 4)
            pred = self.pred(
                scope,
                kind,
                replicated=replicated,
                num_branches=num,
                clamp=rng.random() < 0.3,
            )
            operands = tuple(pick() for _ in range(rng.randint(1, 2)))
            params = [self.fresh("a") for _ in operands]
            final_sow = None
            modes = scope.free_sow_modes() if self.effects else ()
            if modes and rng.random() < 0.5:
                self.features.add("sow")
                final_sow = (self.fresh("s"), rng.choice(modes))
            inner = self.subscope(scope, per_shard_pred=per_shard, under_cond=True)
            branches = [self.block(params, inner, final_sow=final_sow) for _ in range(num)]
            return [pred, Cond(out, pred.out, operands, branches, kind == "switch")]
        if kind in ("jit", "checkpoint"):
            operands = tuple(pick() for _ in range(rng.randint(1, 2)))
            params = [self.fresh("a") for _ in operands]
            # Called eagerly, a jit closing over concrete arrays compiles them in as
            # constants, and XLA folds ops on them with other rounding than at run
            # time: eager and traced runs of such a program differ in the last bit.
            # Only closures over traced values (jaxpr inputs) are exact. (Whether
            # JAX folds a closure traced under a cond depends even on
            # JAX_CHECK_TRACER_LEAKS.)
            closure = [v for v in scope.visible if v not in self.concrete]
            body = self.block(params, self.subscope(scope, visible=closure))
            policy = rng.choice(POLICIES) if kind == "checkpoint" else None
            return [Wrap(out, kind, operands, body, policy)]
        if kind == "auto_axes":
            # No closure: values from outside are typed on the Explicit mesh, and
            # the region's ops run with the axes Auto.
            operands = tuple(pick() for _ in range(rng.randint(1, 2)))
            params = [self.fresh("a") for _ in operands]
            inner = self.subscope(scope, visible=[], eager=scope.eager, in_auto=True)
            return [Wrap(out, kind, operands, self.block(params, inner))]
        if kind in ("custom_jvp", "custom_vjp"):
            # No closure: custom derivative rules must not close over tracers.
            operands = tuple(pick() for _ in range(rng.randint(1, 2)))
            params = [self.fresh("a") for _ in operands]
            inner = self.subscope(scope, visible=[], eager=scope.eager)  # run as they are
            body = self.block(params, inner)
            return [Wrap(out, kind, operands, body)]
        assert kind == "shard_map"
        axes = rng.choice((("x", "y"), ("x", "y"), ("x",), ("y",)))
        shard = Shard(axes, axes, check_vma=rng.random() < 0.7)
        if len(axes) < 2:
            self.features.add("partial_manual")
        is_replicated = rng.random() < 0.3
        n_local = scope.n if is_replicated else scope.n // shard.size
        operands = tuple(pick() for _ in range(rng.randint(1, 2)))
        params = [self.fresh("a") for _ in operands]
        # Called eagerly, JAX runs a shard_map body op by op (a compile per op):
        # jit most of them to keep the fuzzer fast.
        jit = (len(axes) < 2 and not shard.check_vma) or rng.random() < 0.8
        inner = Scope(
            n=n_local,
            visible=[],
            depth=scope.depth + 1,
            shard=shard,
            collectives=True,
            loops=scope.loops,
            under_cond=scope.under_cond,
            eager=scope.eager and not jit,
        )
        prefix: list[Any] = []
        if is_replicated and shard.check_vma:
            prefix = [Pcast(p, axes) for p in params]
        body = self.block(params, inner, prefix=prefix, size=(2, 4))
        if is_replicated:
            # A replicated (P()) output: sum over the shards.
            final = self.fresh("v")
            body.stmts.append(
                Op(final, "psum_out", (body.result,), f"lax.psum({{0}}, {axes!r}) * 0.125", ())
            )
            body.stmts[-1].families = ("psum", "mul")
            body.result = final
        return [ShardMap(out, operands, shard, is_replicated, jit, body, self.explicit)]


# ---------------------------------------------------------------------------
# Emission: the plain program and its hand-threaded twin.
# ---------------------------------------------------------------------------


def _spec(shard: Shard, replicated: bool) -> str:
    if replicated:
        return "P()"
    return f"P({shard.axes!r})" if len(shard.axes) > 1 else f"P({shard.axes[0]!r})"


def sown_names(block: Block) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (mode, shape) of every name sown in `block`, as seen after it ran."""
    names: dict[str, tuple[str, tuple[int, ...]]] = {}
    for stmt in block.stmts:
        names.update(_sown_by(stmt))
    return names


def _sown_by(stmt: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    if isinstance(stmt, Sow):
        return {stmt.name: (stmt.mode, (stmt.n,))}
    if isinstance(stmt, Scan) or (isinstance(stmt, Fori) and isinstance(stmt.trips, int)):
        length = stmt.length if isinstance(stmt, Scan) else stmt.trips
        out = {}
        for name, (mode, shape) in sown_names(stmt.body).items():
            if mode == "append":
                out[name] = (mode, (length, *shape))
            elif length > 0:  # a clobber name first sown in a zero-length scan: absent
                out[name] = (mode, shape)
        return out
    if isinstance(stmt, Fori | While | Wrap):
        return sown_names(stmt.body)
    if isinstance(stmt, Cond):
        return sown_names(stmt.branches[0])
    if isinstance(stmt, ShardMap):
        size = stmt.shard.size
        return {k: (m, (size, *s)) for k, (m, s) in sown_names(stmt.body).items()}
    return {}


def _carried_sows(block: Block) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The names a loop body sows that a loop carries (every non-append name)."""
    return {k: v for k, v in sown_names(block).items() if v[0] != "append"}


class Emitter:
    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self.lines: list[str] = []
        self.indent = 0

    def line(self, text: str) -> int:
        self.lines.append("    " * self.indent + text)
        return len(self.lines)

    def count(self, families: tuple[str, ...]) -> None:
        if self.threaded and families:
            self.line(f"st = _count(st, {families!r})")

    def block_def(self, block: Block, shard: Shard | None) -> None:
        params = ["i", *block.params] if block.index_param else list(block.params)
        if self.threaded:
            params.append("st")
        self.line(f"def {block.name}({', '.join(params)}):")
        self.indent += 1
        for stmt in block.stmts:
            self.stmt(stmt, shard)
        self.line(f"return {block.result}, st" if self.threaded else f"return {block.result}")
        self.indent -= 1

    def stmt(self, stmt: Any, shard: Shard | None) -> None:
        getattr(self, "emit_" + type(stmt).__name__.lower())(stmt, shard)

    def emit_op(self, op: Op, shard: Shard | None) -> None:
        self.line(f"{op.out} = " + op.template.format(*op.args))
        self.count(op.families)

    def emit_pcast(self, op: Pcast, shard: Shard | None) -> None:
        if not self.threaded:
            self.line(f"{op.var} = lax.pcast({op.var}, {op.axes!r}, to='varying')")

    def emit_pred(self, pred: Pred, shard: Shard | None) -> None:
        total = f"jnp.sum({pred.src})"
        if pred.axes is not None:
            total = f"lax.psum({total}, {pred.axes!r})"
        if pred.kind == "cond":
            expr = f"{total} > 0.0"
        elif pred.kind == "switch":
            expr = f"(jnp.abs({total}) * 3.0).astype(jnp.int32)"
            if not pred.clamp:
                expr = f"{expr} % {pred.num_branches}"
        else:
            low, extra = pred.trips
            expr = f"jnp.where({total} > 0.0, jnp.int32({low + extra}), jnp.int32({low}))"
        self.line(f"{pred.out} = {expr}")
        self.count(pred.families)

    def emit_reshard(self, op: Reshard, shard: Shard | None) -> None:
        if self.threaded:  # a layout changes no value
            self.line(f"{op.out} = jnp.sin({op.src})")
        else:
            spec = repr(op.axes) if len(op.axes) > 1 else repr(op.axes[0])
            self.line(f"{op.out} = jax.sharding.reshard({op.src}, ON({spec}))")
            self.line(f"{op.out} = jax.sharding.reshard(jnp.sin({op.out}), ON())")
        self.count(("sin",))

    def emit_sow(self, sow: Sow, shard: Shard | None) -> None:
        if self.threaded:
            self.line(f"{sow.out} = {sow.src}")
            self.line(f"st = _sow(st, {sow.name!r}, {sow.out})")
        else:
            self.line(f"{sow.out} = sow({sow.src}, tag=TAG, name={sow.name!r}, mode={sow.mode!r})")

    def emit_check(self, check: Check, shard: Shard | None) -> None:
        pred = f"jnp.all({check.src} < {check.threshold})"
        value = f"jnp.sum({check.src} >= {check.threshold})"
        if self.threaded:
            self.line(f"st = _check(st, {check.site}, {pred}, {value}, {check.shard_axes!r})")
        else:
            check.line = self.line(f"check({pred}, 'c{check.site}: {{}} bad', {value})")

    def emit_scan(self, scan: Scan, shard: Shard | None) -> None:
        body = scan.body
        self.block_def(body, shard)
        xs = self.line_xs(scan)
        step = "sb" + scan.out
        if not self.threaded:
            args = "c, x" if scan.xsrc else "c, _"
            call = f"{body.name}(c, x)" if scan.xsrc else f"{body.name}(c)"
            self.line(f"def {step}({args}):")
            self.line(f"    r = {call}")
            self.line("    return r, r")
            xs_arg = xs if scan.xsrc else f"None, length={scan.length}"
            self.line(
                f"c_{scan.out}, ys_{scan.out} = lax.scan({step}, {scan.init}, {xs_arg}, "
                f"reverse={scan.reverse}, unroll={scan.unroll})"
            )
        else:
            carried = _carried_sows(body)
            appended = sorted(k for k, v in sown_names(body).items() if v[0] == "append")
            call = f"{body.name}(c, x, st)" if scan.xsrc else f"{body.name}(c, st)"
            self.line(f"def {step}(carry, xk):")
            self.line("    c, st = carry")
            self.line("    x, k = xk" if scan.xsrc else "    k = xk")
            self.line("    st = _push(st, k)")
            self.line(f"    r, st = {call}")
            self.line("    st = _pop(st)")
            self.line(f"    st, ys_sow = _split_sows(st, {appended!r})")
            self.line("    return (r, st), (r, ys_sow)")
            self.line(f"st = _init_sows(st, {_shapes(carried)!r})")
            index = f"jnp.arange({scan.length}, dtype=jnp.int32)"
            xs_arg = f"({xs}, {index})" if scan.xsrc else index
            self.line(
                f"(c_{scan.out}, st), (ys_{scan.out}, ys_sow) = lax.scan({step}, "
                f"({scan.init}, st), {xs_arg}, reverse={scan.reverse})"
            )
            self.line("st = _join_sows(st, ys_sow)")
            if scan.length == 0:
                self.line(f"st = _drop_sows(st, {sorted(carried)!r})")
        self.line(f"{scan.out} = c_{scan.out} + jnp.sum(ys_{scan.out}, axis=0) * 0.5")
        self.count(("reduce_sum", "mul"))

    def line_xs(self, scan: Scan) -> str:
        if scan.xsrc is None:
            return ""
        xs = f"xs_{scan.out}"
        self.line(
            f"{xs} = jnp.arange(1.0, {scan.length + 1}.0)[:, None] * {scan.xsrc}[None, :] * 0.5"
        )
        self.count(("mul", "mul"))
        return xs

    def emit_fori(self, fori: Fori, shard: Shard | None) -> None:
        body = fori.body
        self.block_def(body, shard)
        if not self.threaded:
            self.line(f"{fori.out} = lax.fori_loop(0, {fori.trips}, {body.name}, {fori.init})")
            return
        if isinstance(fori.trips, int):
            self.emit_threaded_scan_loop(fori.out, fori.init, fori.trips, body)
        else:
            self.emit_threaded_while(fori.out, fori.init, fori.trips, body, index=True)

    def emit_threaded_scan_loop(self, out: str, init: str, length: int, body: Block) -> None:
        carried = _carried_sows(body)
        appended = sorted(k for k, v in sown_names(body).items() if v[0] == "append")
        step = "sb" + out
        self.line(f"def {step}(carry, k):")
        self.line("    c, st = carry")
        self.line("    st = _push(st, k)")
        self.line(f"    r, st = {body.name}(k, c, st)")
        self.line("    st = _pop(st)")
        self.line(f"    st, ys_sow = _split_sows(st, {appended!r})")
        self.line("    return (r, st), ys_sow")
        self.line(f"st = _init_sows(st, {_shapes(carried)!r})")
        self.line(
            f"({out}, st), ys_sow = lax.scan({step}, ({init}, st), "
            f"jnp.arange({length}, dtype=jnp.int32))"
        )
        self.line("st = _join_sows(st, ys_sow)")
        if length == 0:
            self.line(f"st = _drop_sows(st, {sorted(carried)!r})")

    def emit_threaded_while(
        self,
        out: str,
        init: str,
        trips: str,
        body: Block,
        *,
        index: bool,
        cond_families: tuple[str, ...] = (),
    ) -> None:
        step = "wb" + out
        call = f"{body.name}(i, c, st)" if index else f"{body.name}(c, st)"
        self.line(f"def {step}(state):")
        self.line("    i, c, st = state")
        self.line("    st = _push(st, i)")
        self.line(f"    r, st = {call}")
        self.line("    st = _pop(st)")
        if cond_families:
            self.line(f"    st = _count(st, {cond_families!r})")
        self.line("    return i + 1, r, st")
        self.count(cond_families)  # the condition's first evaluation
        self.line(
            f"_, {out}, st = lax.while_loop(lambda s: s[0] < {trips}, {step}, "
            f"(jnp.int32(0), {init}, st))"
        )

    def emit_while(self, loop: While, shard: Shard | None) -> None:
        body = loop.body
        self.block_def(body, shard)
        if self.threaded:
            cond_families = ("sin",) if loop.cond_sin else ()
            self.emit_threaded_while(
                loop.out, loop.init, loop.trips, body, index=False, cond_families=cond_families
            )
            return
        cond = f"s[0] < {loop.trips}"
        if loop.cond_sin:
            cond = f"jnp.logical_and({cond}, jnp.sin(s[0].astype(jnp.float32)) < 2.0)"
        self.line(
            f"_, {loop.out} = lax.while_loop(lambda s: {cond}, "
            f"lambda s: (s[0] + 1, {body.name}(s[1])), (jnp.int32(0), {loop.init}))"
        )

    def emit_cond(self, cond: Cond, shard: Shard | None) -> None:
        for branch in cond.branches:
            self.block_def(branch, shard)
        operands = list(cond.operands) + (["st"] if self.threaded else [])
        names = [b.name for b in cond.branches]
        target = f"{cond.out}, st" if self.threaded else cond.out
        if cond.switch:
            self.line(
                f"{target} = lax.switch({cond.pred}, [{', '.join(names)}], {', '.join(operands)})"
            )
        else:
            self.line(
                f"{target} = lax.cond({cond.pred}, {names[1]}, {names[0]}, {', '.join(operands)})"
            )

    def emit_wrap(self, wrap: Wrap, shard: Shard | None) -> None:
        body = wrap.body
        self.block_def(body, shard)
        operands = ", ".join(wrap.operands)
        if self.threaded:  # wrappers are transparent: call the body
            self.line(f"{wrap.out}, st = {body.name}({operands}, st)")
            return
        if wrap.kind == "jit":
            self.line(f"{wrap.out} = jax.jit({body.name})({operands})")
        elif wrap.kind == "auto_axes":
            region = f"jax.sharding.auto_axes({body.name}, out_sharding=ON())"
            self.line(f"{wrap.out} = {region}({operands})")
        elif wrap.kind == "checkpoint":
            self.line(f"{wrap.out} = jax.checkpoint({body.name}, policy={wrap.policy})({operands})")
        elif wrap.kind == "custom_jvp":
            g = "g" + wrap.out
            self.line(f"{g} = jax.custom_jvp({body.name})")
            self.line("")
            self.line(f"@{g}.defjvp")
            self.line(f"def {g}_jvp(primals, tangents):")
            self.line(f"    out, tangent = jax.jvp({body.name}, primals, tangents)")
            self.line("    return out, tangent * 0.5")
            self.line("")
            self.line(f"{wrap.out} = {g}({operands})")
        else:
            g = "g" + wrap.out
            self.line(f"{g} = jax.custom_vjp({body.name})")
            self.line(f"def {g}_fwd(*args):")
            self.line(f"    return {body.name}(*args), args")
            self.line(f"def {g}_bwd(args, cotangent):")
            self.line(f"    _, pullback = jax.vjp({body.name}, *args)")
            self.line("    return tuple(t * 0.5 for t in pullback(cotangent))")
            self.line(f"{g}.defvjp({g}_fwd, {g}_bwd)")
            self.line(f"{wrap.out} = {g}({operands})")

    def emit_shardmap(self, sm: ShardMap, shard: Shard | None) -> None:
        body = sm.body
        self.block_def(body, sm.shard)
        spec = _spec(sm.shard, sm.replicated)
        in_specs = "(" + "".join(f"{spec}, " for _ in sm.operands) + ")"
        operands = ", ".join(sm.operands)
        if self.threaded:
            names = sorted(sown_names(body))
            self.line(
                f"{sm.out}, st = _smap({body.name}, {in_specs}, {spec}, {sm.shard.axes!r}, "
                f"{names!r})({operands}, st)"
            )
            return
        extra = f", axis_names={set(sm.shard.axes)!r}" if len(sm.shard.axes) < 2 else ""
        mesh = "MESH_E" if sm.explicit else "MESH"
        call = (
            f"jax.shard_map({body.name}, mesh={mesh}, in_specs={in_specs}, out_specs={spec}"
            f"{extra}, check_vma={sm.shard.check_vma})"
        )
        if sm.jit:
            call = f"jax.jit({call})"
        if not sm.explicit:
            self.line(f"{sm.out} = {call}({operands})")
            return
        # On an Explicit mesh, shard_map checks in_specs against the operands'
        # shardings: reshard them first, and the result back to replicated.
        layout = spec.replace("P(", "ON(", 1)
        operands = ", ".join(f"jax.sharding.reshard({op}, {layout})" for op in sm.operands)
        self.line(f"{sm.out} = jax.sharding.reshard({call}({operands}), ON())")


def _shapes(names: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    return {k: shape for k, (_, shape) in sorted(names.items())}


# ---------------------------------------------------------------------------
# The threaded twin's runtime (plain JAX, no kups).
# ---------------------------------------------------------------------------


def _state(families: tuple[str, ...]) -> dict[str, Any]:
    return {
        "n": {fam: jnp.int32(0) for fam in families},
        "sow": {},
        "err": {
            "failed": jnp.bool_(False),
            "site": jnp.int32(-1),
            "value": jnp.int32(0),
            "it": jnp.zeros((DMAX,), jnp.int32),
            "shard": jnp.zeros((SMAX,), jnp.int32),
        },
        "loops": (),
    }


def _count(st: dict[str, Any], families: tuple[str, ...]) -> dict[str, Any]:
    counts = dict(st["n"])
    for fam in families:
        counts[fam] = counts[fam] + 1
    return {**st, "n": counts}


def _push(st: dict[str, Any], k: Any) -> dict[str, Any]:
    return {**st, "loops": (*st["loops"], jnp.asarray(k, jnp.int32))}


def _pop(st: dict[str, Any]) -> dict[str, Any]:
    return {**st, "loops": st["loops"][:-1]}


def _sow(st: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    return {**st, "sow": {**st["sow"], name: value}}


def _init_sows(st: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    new = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items() if k not in st["sow"]}
    return {**st, "sow": {**st["sow"], **new}}


def _split_sows(st: dict[str, Any], names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    kept = {k: v for k, v in st["sow"].items() if k not in names}
    return {**st, "sow": kept}, {k: st["sow"][k] for k in names}


def _join_sows(st: dict[str, Any], sows: dict[str, Any]) -> dict[str, Any]:
    return {**st, "sow": {**st["sow"], **sows}}


def _drop_sows(st: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {**st, "sow": {k: v for k, v in st["sow"].items() if k not in names}}


def _check(
    st: dict[str, Any], site: int, pred: Any, value: Any, axes: tuple[str, ...]
) -> dict[str, Any]:
    err = st["err"]
    fails = jnp.logical_and(jnp.logical_not(pred), jnp.logical_not(err["failed"]))
    loops = list(st["loops"])
    it = jnp.stack([*loops, *[jnp.int32(0)] * (DMAX - len(loops))])
    coords = [lax.axis_index(axis) for axis in axes]
    shard = jnp.stack([*coords, *[jnp.int32(0)] * (SMAX - len(coords))])
    new = {
        "failed": jnp.logical_or(err["failed"], fails),
        "site": jnp.where(fails, jnp.int32(site), err["site"]),
        "value": jnp.where(fails, value.astype(jnp.int32), err["value"]),
        "it": jnp.where(fails, it, err["it"]),
        "shard": jnp.where(fails, shard, err["shard"]),
    }
    return {**st, "err": new}


def _smap(
    fn: Callable[..., Any],
    in_specs: tuple[Any, ...],
    out_spec: Any,
    axes: tuple[str, ...],
    sow_names: list[str],
) -> Callable[..., Any]:
    """A threaded shard_map: counts summed over the shards, values sown inside
    stacked along a new leading shard axis, the first failing shard's error."""

    def body(st: dict[str, Any], *args: Any) -> Any:
        st0 = st
        out, st = fn(*args, st)
        counts = {k: st0["n"][k] + lax.psum(st["n"][k] - st0["n"][k], axes) for k in st["n"]}
        new = {k: st["sow"][k][None] for k in sow_names}
        old = {k: v for k, v in st["sow"].items() if k not in sow_names}
        first = jnp.argmax(lax.all_gather(st["err"]["failed"], axes))
        err = {k: lax.all_gather(v, axes)[first] for k, v in st["err"].items()}
        return out, {"n": counts, "sow": old, "err": err, "loops": st["loops"]}, new

    spec = P(axes) if len(axes) > 1 else P(axes[0])

    def run(*args_st: Any) -> Any:
        *args, st = args_st
        mapped = jax.shard_map(
            body,
            mesh=mesh(),
            in_specs=(P(), *in_specs),
            out_specs=(out_spec, P(), spec),
            axis_names=set(axes),
            check_vma=False,
        )
        out, st, new = jax.jit(mapped)(st, *args)
        return out, {**st, "sow": {**st["sow"], **new}}

    return run


_RUNTIME = (_state, _count, _push, _pop, _sow, _init_sows, _split_sows, _join_sows)
_RUNTIME += (_drop_sows, _check, _smap)


# ---------------------------------------------------------------------------
# Programs.
# ---------------------------------------------------------------------------

_MESH: list[Any] = []


def mesh() -> Any:
    if not _MESH:
        _MESH.append(jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2))
    return _MESH[0]


_MESH_E: list[Any] = []


def explicit_mesh() -> Any:
    """The same devices as `mesh()`, with Explicit axes."""
    if not _MESH_E:
        _MESH_E.append(jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2))
    return _MESH_E[0]


def on(*spec: Any) -> NamedSharding:
    """`NamedSharding(explicit_mesh(), P(*spec))`: `ON` in a program's source."""
    return NamedSharding(explicit_mesh(), P(*spec))


HEADER = """\
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from kups.checks import check, checked
from kups.debug import find_nans, nan_sites
from kups.effects import Interpreter, default_dispatcher, reinterpret
from kups.harvest import plant, reap, sow
from kups.instrument import count_primitives

MESH = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
MESH_E = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
TAG = "fuzz"


def ON(*spec):
    return NamedSharding(MESH_E, P(*spec))
"""


@dataclass
class Program:
    seed: int
    effects: bool
    source: str
    threaded_source: str
    args: tuple[jax.Array, ...]
    sites: dict[int, Check]
    features: set[str]
    families: tuple[str, ...]
    fn: Callable[..., Any] = field(repr=False)
    threaded: Callable[..., Any] = field(repr=False)
    body: Block = field(repr=False)
    other: str = ""
    explicit: bool = False
    threaded_args: tuple[jax.Array, ...] = ()  # the args, unplaced: the twin's mesh is Auto
    # An explicit program is called under `jax.set_mesh` of its mesh, unless this
    # is False: then the mesh is only its arguments' (as `jax.jit(f)(*placed)`).
    set_mesh: bool = True

    @property
    def filename(self) -> str:
        return program_filename(self.seed, self.effects)

    @property
    def differentiable(self) -> bool:
        """Reverse-mode differentiable in plain JAX: no while loop."""
        return "while_form" not in self.features

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Where to call the program: an explicit program under `jax.set_mesh` of its
        Explicit mesh (plain JAX cannot even differentiate some of them without it:
        "Please enter your `jit` into a mesh context")."""
        if self.explicit and self.set_mesh:
            return jax.set_mesh(explicit_mesh())
        return contextlib.nullcontext()

    def run_threaded(self) -> Any:
        """The threaded twin's `((out, other), state)`, jitted, on the Auto mesh (also
        inside an explicit program's context)."""
        with jax.set_mesh(mesh()):
            return jax.jit(self.threaded)(*self.threaded_args)

    def expected_message(self, err: dict[str, Any]) -> str | None:
        """The message `checked` should give for the threaded error record."""
        if not bool(err["failed"]):
            return None
        site = self.sites[int(err["site"])]
        text = f"c{site.site}: {int(err['value'])} bad"
        iterations = [int(i) for i in np.asarray(err["it"])[: site.depth]]
        if len(iterations) == 1:
            text += f" at iteration {iterations[0]}"
        elif iterations:
            text += f" at iterations {', '.join(map(str, iterations))} (outermost loop first)"
        if site.shard_axes:
            coords = np.asarray(err["shard"])[: len(site.shard_axes)]
            text += " on shard " + ", ".join(
                f"{axis}={int(c)}" for axis, c in zip(site.shard_axes, coords)
            )
        return f"{text} ({self.filename}:{site.line})"

    def reproducer(self, check_code: str, *, threaded: bool = False) -> str:
        """Standalone Python source that rebuilds the program and runs `check_code`."""
        args = ", ".join(f"jnp.array({np.asarray(a).tolist()!r}, jnp.float32)" for a in self.args)
        if self.explicit:
            placed = "args = tuple(jax.device_put(a, ON()) for a in threaded_args)"
            args_code = f"threaded_args = ({args},)\n{placed}"
        else:
            args_code = f"args = ({args},)\nthreaded_args = args"
        parts = [
            f"# kups fuzz reproducer: seed {self.seed}, effects={self.effects}",
            f"# (rerun the fuzzer on it: KUPS_FUZZ_SEED={self.seed} KUPS_FUZZ_N=1)",
            HEADER,
            self.source,
        ]
        if threaded:
            parts.append("# The hand-threaded oracle (plain JAX, no kups).")
            parts.append("from collections.abc import Callable\nfrom typing import Any")
            parts.append(f"DMAX, SMAX = {DMAX}, {SMAX}")
            parts.append("def mesh():\n    return MESH")
            parts += [inspect.getsource(f) for f in _RUNTIME]
            parts.append(self.threaded_source)
            parts.append(
                "def run_threaded():\n    with jax.set_mesh(MESH):\n"
                "        return jax.jit(program_threaded)(*threaded_args)"
            )
        parts.append(args_code)
        check_code = textwrap.dedent(check_code).strip()
        if self.explicit and self.set_mesh:
            check_code = "with jax.set_mesh(MESH_E):\n" + textwrap.indent(check_code, "    ")
        parts.append(check_code)
        return "\n\n".join(parts) + "\n"


def program_filename(seed: int, effects: bool) -> str:
    """The file name the program's source is compiled under (and `check` reports)."""
    return f"progen_{seed}{'_fx' if effects else ''}.py"


def _namespace() -> dict[str, Any]:
    from kups.checks import check
    from kups.harvest import sow

    ns: dict[str, Any] = {
        "jax": jax,
        "jnp": jnp,
        "lax": lax,
        "np": np,
        "P": P,
        "MESH": mesh(),
        "MESH_E": explicit_mesh(),
        "ON": on,
        "TAG": TAG,
        "sow": sow,
        "check": check,
    }
    ns.update({f.__name__: f for f in _RUNTIME})
    return ns


EXPLICIT_SHARE = 0.2  # of the programs, explicit (see the module docstring)


def is_explicit(seed: int, *, effects: bool = False) -> bool:
    """Whether the program of `seed` is explicit, without generating it."""
    # A separate stream decides, so the other programs stay what they were.
    return random.Random(f"explicit {seed} {effects}").random() < EXPLICIT_SHARE


def generate(seed: int, *, effects: bool = False) -> Program:
    """The program of `seed` (`effects=True`: with sows and checks)."""
    explicit = is_explicit(seed, effects=effects)
    gen = Generator(seed * 2 + int(effects), effects=effects, explicit=explicit)
    if explicit:
        gen.features.add("explicit")
    top = Scope(n=N, visible=[], depth=0)
    body = gen.block(["a", "b"], top, size=(2, 4))
    other = gen.rng.choice(["a", "b", *[s.out for s in body.stmts[:-1] if hasattr(s, "out")]])
    if isinstance(body.stmts[-1], Sow):
        other = body.stmts[-1].out
    return build(seed, effects, body, other, gen.features, explicit)


def _checks_in(block: Block) -> list[Check]:
    found = []
    for stmt in block.stmts:
        if isinstance(stmt, Check):
            found.append(stmt)
        for inner in _blocks_of(stmt):
            found += _checks_in(inner)
    return found


def build(
    seed: int, effects: bool, body: Block, other: str, features: set[str], explicit: bool = False
) -> Program:
    """The `Program` of a program tree: its two sources, compiled."""
    plain = Emitter(threaded=False)
    plain.line("def program(a, b):")
    plain.indent = 1
    for stmt in body.stmts:
        plain.stmt(stmt, None)
    plain.line(f"return {body.result}, {other}")
    source = "\n".join(plain.lines) + "\n"

    families = tuple(sorted(FAMILIES))
    threaded = Emitter(threaded=True)
    threaded.line("def program_threaded(a, b):")
    threaded.indent = 1
    threaded.line(f"st = _state({families!r})")
    for stmt in body.stmts:
        threaded.stmt(stmt, None)
    threaded.line(f"return ({body.result}, {other}), st")
    threaded_source = "\n".join(threaded.lines) + "\n"

    rng = np.random.RandomState(seed % (2**32))
    threaded_args = tuple(
        jnp.asarray(rng.uniform(-1.0, 1.0, (N,)).astype(np.float32)) for _ in range(2)
    )
    # An explicit program's arguments live on the Explicit mesh (replicated).
    args = tuple(jax.device_put(a, on()) for a in threaded_args) if explicit else threaded_args
    ns = _namespace()
    filename = program_filename(seed, effects)
    exec(compile(source, filename, "exec"), ns)
    exec(compile(threaded_source, filename.replace(".py", "_threaded.py"), "exec"), ns)
    return Program(
        seed=seed,
        effects=effects,
        source=source,
        threaded_source=threaded_source,
        args=args,
        sites={site.site: site for site in _checks_in(body)},
        features=features,
        families=families,
        fn=ns["program"],
        threaded=ns["program_threaded"],
        body=body,
        other=other,
        explicit=explicit,
        threaded_args=threaded_args,
    )


# ---------------------------------------------------------------------------
# Shrinking a failing program.
# ---------------------------------------------------------------------------


def _blocks_of(stmt: Any) -> list[Block]:
    if isinstance(stmt, Cond):
        return list(stmt.branches)
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, Block) else []


def _simpler(stmt: Any) -> Any | None:
    """A statement defining the same variable with less in it (a copy of one of its
    inputs), the statement itself when nothing is simpler, `None` to drop it."""
    if isinstance(stmt, Check):
        return None
    if isinstance(stmt, Pred | Pcast) or (isinstance(stmt, Op) and stmt.kind == "copy"):
        return stmt
    if isinstance(stmt, ShardMap) and not stmt.replicated:
        return stmt  # the body sees other shapes: keep it, shrink its body
    if isinstance(stmt, Op):
        src = stmt.args[0]
    elif isinstance(stmt, Sow | Reshard):
        src = stmt.src
    elif isinstance(stmt, Scan | Fori | While):
        src = stmt.init
    else:
        src = stmt.operands[0]
    return Op(stmt.out, "copy", (src,), "{0}", ())


def shrink(program: Program, fails: Callable[[Program], bool], *, budget: int = 200) -> Program:
    """A smaller program that still `fails`: statements are replaced, outermost
    first, by copies of their inputs while the failure persists."""

    def rebuild(body: Block) -> Program:
        smaller = build(
            program.seed,
            program.effects,
            body,
            program.other,
            program.features,
            program.explicit,
        )
        # Called as the failing program was: with or without `jax.set_mesh`.
        return dataclasses.replace(smaller, set_mesh=program.set_mesh)

    best = program
    changed = True
    while changed and budget > 0:
        changed = False
        body = copy.deepcopy(best.body)
        todo: list[tuple[Block, int]] = [(body, i) for i in range(len(body.stmts))]
        while todo and budget > 0:
            block, index = todo.pop(0)
            stmt = block.stmts[index]
            simpler = _simpler(stmt)
            if simpler is not stmt:
                trial = copy.deepcopy(body)
                trial_block = _find_block(trial, body, block)
                if simpler is None:
                    del trial_block.stmts[index]
                else:
                    trial_block.stmts[index] = simpler
                budget -= 1
                candidate = rebuild(trial)
                if _fails_safely(fails, candidate):
                    best, changed = candidate, True
                    break
            todo.extend((inner, i) for inner in _blocks_of(stmt) for i in range(len(inner.stmts)))
    return best


def _find_block(trial: Block, original: Block, target: Block) -> Block:
    """The block of `trial` at the position `target` has in `original`."""
    if original is target:
        return trial
    for t_stmt, o_stmt in zip(trial.stmts, original.stmts):
        for t_block, o_block in zip(_blocks_of(t_stmt), _blocks_of(o_stmt)):
            found = _find_block(t_block, o_block, target)
            if found is not None:
                return found
    return None  # type: ignore[return-value]


def _fails_safely(fails: Callable[[Program], bool], program: Program) -> bool:
    try:
        return fails(program)
    except Exception:  # noqa: BLE001 - a shrunk program that breaks differently is not kept
        return False
