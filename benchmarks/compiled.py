"""Benchmark 3: compiled runtime of an identity interpretation under `jax.jit`.

`jax.jit(reinterpret(f, Interpreter(default_dispatcher())))` against
`jax.jit(f)`, with an empty context `()`, on three programs:

- "MLP step": one SGD step of a 3-layer MLP (params donated, as a training loop
  does);
- "MLP step, scan + remat": the same with gradient accumulation over 4
  micro-batches in a `lax.scan` and every layer under `jax.checkpoint`;
- "shard_map step": a data-parallel step, `jax.shard_map` over 8 CPU devices,
  gradients `psum`-ed.

The runtime figure is the median over interleaved repeats of the per-repeat
ratio, each sample timing a batch of calls on the process's CPU clock (all
threads; see `benchmarks/_timing.py` for why not the wall clock, which is shown
too). The compiled programs are compared
by the op histogram of the optimized HLO (`jit(...).lower(...).compile().as_text()`)
and by XLA's memory analysis (argument, output, alias and temp bytes): the same
histogram and bytes mean XLA compiled the same program.
"""

from __future__ import annotations

import collections
import itertools
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kups.effects import Interpreter, default_dispatcher, reinterpret

from ._report import Section, Table, Target, main
from ._timing import paired, runtime_clock

RATIO_TOLERANCE = 0.03
LAYERS = (256, 512, 512, 10)
BATCH = 256

_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def op_histogram(hlo_text: str) -> collections.Counter[str]:
    """How many instructions of each opcode the HLO module holds (all computations)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in hlo_text.splitlines():
        match = _OPCODE.match(line)
        if match:
            counts[match.group(1)] += 1
    return counts


def normalized_hlo(hlo_text: str) -> str:
    """The HLO module text without what names it: the module and parameter names,
    instruction and computation names (renumbered in order of appearance), source
    metadata and the stack-frame tables. Equal texts are the same program."""
    lines, skipping = [], False
    for line in hlo_text.splitlines():
        if line.startswith(("FileNames", "FunctionNames", "FileLocations", "StackFrames")):
            skipping = True
        if skipping:
            skipping = bool(line.strip())
            continue
        if line.startswith("HloModule"):
            line = "HloModule" + (line[line.index(",") :] if "," in line else "")
        lines.append(re.sub(r",? metadata=\{[^}]*\}", "", line))
    text = re.sub(r"([(,] ?)[\w.\-]+: ", r"\1p: ", "\n".join(lines))
    names: dict[str, str] = {}
    return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"), text)


def init_params(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    params = []
    for n_in, n_out in itertools.pairwise(LAYERS):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (n_in, n_out)) / n_in**0.5, jnp.zeros(n_out)))
    return params


def mlp(params: Any, x: Any, remat: bool = False) -> Any:
    def layer(h: Any, w: Any, b: Any) -> Any:
        return jax.nn.relu(h @ w + b)

    if remat:
        layer = jax.checkpoint(layer)
    for w, b in params[:-1]:
        x = layer(x, w, b)
    w, b = params[-1]
    return x @ w + b


def loss(params: Any, x: Any, y: Any, remat: bool = False) -> Any:
    return jnp.mean((mlp(params, x, remat) - y) ** 2)


def sgd(params: Any, grads: Any) -> Any:
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def mlp_step(params: Any, x: Any, y: Any) -> tuple[Any, Any]:
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return sgd(params, grads), value


def mlp_scan_remat_step(params: Any, x: Any, y: Any) -> tuple[Any, Any]:
    micro_x = x.reshape(4, -1, x.shape[-1])
    micro_y = y.reshape(4, -1, y.shape[-1])

    def accumulate(grads: Any, batch: Any) -> tuple[Any, Any]:
        value, g = jax.value_and_grad(loss)(params, *batch, True)
        return jax.tree.map(jnp.add, grads, g), value

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, values = lax.scan(accumulate, zeros, (micro_x, micro_y))
    return sgd(params, jax.tree.map(lambda g: g / 4, grads)), jnp.mean(values)


def shard_map_step(mesh: jax.sharding.Mesh) -> Callable[..., tuple[Any, Any]]:
    def local_step(params: Any, x: Any, y: Any) -> tuple[Any, Any]:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        grads = lax.pmean(grads, "i")
        return sgd(params, grads), lax.pmean(value, "i")

    return jax.shard_map(
        local_step, mesh=mesh, in_specs=(P(), P("i"), P("i")), out_specs=(P(), P())
    )


def _compare(
    name: str,
    step: Callable[..., Any],
    params: Any,
    x: Any,
    y: Any,
    calls: int,
    repeats: int,
) -> tuple[list[Any], float, bool, bool, float]:
    identity = Interpreter(default_dispatcher())
    plain = jax.jit(step, donate_argnums=0)
    interpreted = jax.jit(reinterpret(step, identity), donate_argnums=1)

    plain_compiled = plain.lower(params, x, y).compile()
    kups_compiled = interpreted.lower((), params, x, y).compile()
    plain_ops = op_histogram(plain_compiled.as_text())
    kups_ops = op_histogram(kups_compiled.as_text())
    same_program = normalized_hlo(plain_compiled.as_text()) == normalized_hlo(
        kups_compiled.as_text()
    )
    same_ops = plain_ops == kups_ops
    plain_mem = plain_compiled.memory_analysis()
    kups_mem = kups_compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    fields += ("temp_size_in_bytes",)
    same_bytes = all(getattr(plain_mem, f) == getattr(kups_mem, f) for f in fields)

    # Each variant trains its own copy of the parameters (they are donated).
    state = {name: jax.tree.map(jnp.copy, params) for name in ("plain", "again", "kups")}
    # A second, separately jitted copy of `f`: the A/A control for the noise.
    again = jax.jit(lambda *args: step(*args), donate_argnums=0)

    def plain_runner(name: str, fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            p = state[name]
            for _ in range(calls):
                p, value = fn(p, x, y)
            jax.block_until_ready((p, value))
            state[name] = p

        return run

    def run_kups() -> None:
        p = state["kups"]
        for _ in range(calls):
            (p, value), _ = interpreted((), p, x, y)
        jax.block_until_ready((p, value))
        state["kups"] = p

    timings = paired(
        {
            "jit(f)": plain_runner("plain", plain),
            "kups": run_kups,
            "jit(f) again": plain_runner("again", again),
        },
        repeats,
        warmup=2,
        clock=runtime_clock,
    )
    ratio = timings.ratio("kups", "jit(f)")
    histogram = ", ".join(f"{op} {n}" for op, n in sorted(plain_ops.items()))
    diff = (
        ""
        if same_ops
        else f"; kups: {dict(kups_ops - plain_ops)} more, {dict(plain_ops - kups_ops)} fewer"
    )
    row = [
        name,
        1e3 * timings.median("jit(f)") / calls,
        1e3 * timings.median("kups") / calls,
        ratio,
        timings.ratio("kups", "jit(f)", wall=True),
        timings.ratio("jit(f) again", "jit(f)"),
        sum(plain_ops.values()),
        sum(kups_ops.values()),
        same_ops,
        same_bytes,
        same_program,
        f"{histogram}{diff}",
    ]
    return (
        row,
        ratio,
        same_ops and same_bytes,
        same_program,
        timings.ratio("jit(f) again", "jit(f)"),
    )


def _runtime_notes(unresolved: list[tuple[str, float, float, bool]]) -> list[str]:
    notes = []
    for name, ratio, control, same_program in unresolved:
        if same_program:
            notes.append(
                f"**{name}: runtime ratio {ratio:.3f} is outside 1.00 +/- "
                f"{RATIO_TOLERANCE}**, with the same compiled program on both sides (A/A "
                f"control in the same run: {control:.3f}). On this machine (two shared "
                "cores, other jobs running) the per-repeat CPU time of one program varies "
                "by tens of percent, and the median of the paired ratios still moves by "
                "several percent between runs, as the A/A control shows: the target is "
                "below what this machine can resolve, not a cost kups adds."
            )
        else:
            notes.append(
                f"**{name}: runtime ratio {ratio:.3f} is outside 1.00 +/- "
                f"{RATIO_TOLERANCE}, and the compiled programs differ**: see the histogram."
            )
    return notes


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    calls, repeats = (3, 3) if quick else (10, 101)
    key = jax.random.key(0)
    params = init_params(key)
    x = jax.random.normal(jax.random.key(1), (BATCH, LAYERS[0]))
    y = jax.random.normal(jax.random.key(2), (BATCH, LAYERS[-1]))
    mesh = jax.make_mesh((8,), ("i",))
    sharded = NamedSharding(mesh, P("i"))
    programs = [
        ("MLP step", mlp_step, x, y),
        ("MLP step, scan + remat", mlp_scan_remat_step, x, y),
        (
            "shard_map step",
            shard_map_step(mesh),
            jax.device_put(x, sharded),
            jax.device_put(y, sharded),
        ),
    ]
    if quick:  # the smoke run skips the slowest program to compile
        programs = [p for p in programs if "scan" not in p[0]]
    rows, targets = [], []
    unresolved: list[tuple[str, float, float, bool]] = []
    for name, step, xs, ys in programs:
        row, ratio, same, same_program, control = _compare(
            name, step, params, xs, ys, calls, repeats
        )
        within = abs(ratio - 1) <= RATIO_TOLERANCE
        if not within:
            unresolved.append((name, ratio, control, same_program))
        rows.append(row)
        targets.append(
            Target(
                f"{name}: runtime kups / jit(f)",
                ratio,
                f"1.00 +/- {RATIO_TOLERANCE}",
                within,
                f"A/A control: {control:.3f}",
            )
        )
        targets.append(
            Target(
                f"{name}: same optimized HLO op histogram and memory bytes",
                float(same),
                "identical",
                same,
                "normalized HLO text identical too" if same_program else "",
            )
        )
    table = Table(
        f"Compiled runtime (median CPU ms per call; {repeats} repeats of {calls} calls)",
        [
            "program",
            "jit(f) ms",
            "kups ms",
            "ratio",
            "ratio (wall clock)",
            "A/A: jit(f) / jit(f)",
            "HLO ops, jit(f)",
            "HLO ops, kups",
            "same histogram",
            "same bytes",
            "same HLO text",
            "histogram",
        ],
        rows,
    )
    return Section(
        name="compiled",
        title="3. Compiled runtime of an identity interpretation",
        method=__doc__ or "",
        tables=[table],
        targets=targets,
        notes=[
            "`same HLO text`: the optimized HLO modules are equal once names, source "
            "metadata and stack-frame tables are removed (`normalized_hlo`): XLA "
            "compiled the same program, so the runtimes can only differ by noise. "
            "`A/A` times a second, separately jitted copy of `f` against the first: "
            "how far noise alone moves a ratio in this run.",
            *_runtime_notes(unresolved),
        ],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    main(run)
