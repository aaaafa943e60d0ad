"""Benchmark 5: peak memory of an eager (un-jitted) interpretation.

The program builds a 4096 x 4096 `float32` matrix (64 MiB) from a small vector,
keeps one 64 MiB value for the end (a skip connection) and runs a chain of
elementwise steps over the other, then reduces to a vector. Written in Python
the usual way (`y = jnp.sin(y) * 1.01`), eager JAX frees each intermediate as
its last Python reference goes. The interpretation must do as well: free each
value after its last use, not keep every intermediate of the jaxpr until the end.

Method: each variant runs in a fresh Python process (so that nothing another
variant allocated is still mapped), with the CPU client's asynchronous dispatch
off (`jax_cpu_enable_async_dispatch=False`): otherwise the queue of pending
primitives, not Python's references, decides when buffers die, and even a walker
that never frees a value measures like eager JAX (the full run shows JAX's
default, asynchronous dispatch too, without a target). The process runs the program once untimed
(eager JAX compiles one small executable per primitive and shape, and kups
traces the program), then measures a second run: a thread samples the
process's resident set size (`/proc/self/statm`) every 0.2 ms while the main
thread runs the program and waits for its result, and the figure is the peak
RSS above the RSS just before the run. The CPU client allocates each buffer of
this size with its own `mmap` and returns it on free, so RSS follows the live
device buffers (`tracemalloc` sees none of them; the CPU client has no
`memory_stats`). Each variant is measured in several processes; the figure
uses the median peak.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ._report import Section, Table, Target

BOUND = 1.1
SIZE = 4096
STEPS = 8
MiB = 2**20


def program(x: Any) -> Any:
    import jax.numpy as jnp

    y = jnp.outer(x, x)
    skip = jnp.cos(y)
    for _ in range(STEPS):
        y = jnp.sin(y) * 1.01
    y = y + skip
    return jnp.sum(y, axis=0)


def _variant(name: str) -> Callable[[Any], Any]:
    import jax
    import jax.core as jax_core
    from jax.extend.core import Literal

    from kups.effects import Interpreter, default_dispatcher, reinterpret

    if name == "eager":
        return program
    if name == "eval_jaxpr":

        def via_eval_jaxpr(x: Any) -> Any:
            closed = jax.make_jaxpr(program)(x)
            return jax_core.eval_jaxpr(closed.jaxpr, closed.consts, x)[0]

        return via_eval_jaxpr
    if name == "keeps every value":
        # A control: an eager walk of the jaxpr that never frees a value. It shows
        # that the measurement sees a walker that keeps intermediates alive.
        def keep_all(x: Any) -> Any:
            closed = jax.make_jaxpr(program)(x)
            env = dict(zip(closed.jaxpr.invars, [x], strict=True))
            for eqn in closed.jaxpr.eqns:
                invals = [v.val if type(v) is Literal else env[v] for v in eqn.invars]
                out = eqn.primitive.bind(*invals, **eqn.params)
                outs = out if eqn.primitive.multiple_results else [out]
                env.update(zip(eqn.outvars, outs, strict=True))
            return env[closed.jaxpr.outvars[0]]

        return keep_all
    if name == "kups":
        interpreted = reinterpret(program, Interpreter(default_dispatcher()))
        return lambda x: interpreted((), x)[0]
    raise ValueError(name)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(name: str, sync: bool) -> None:
    import gc

    import jax
    import jax.numpy as jnp

    # With asynchronous dispatch (JAX's default), Python returns before a
    # primitive has run and the pending computations hold their buffers; how long
    # Python keeps a value then barely shows (a walker that keeps every value
    # measured like eager JAX). Synchronous dispatch makes each buffer live
    # exactly as long as its Python references: the lifetimes this is about.
    jax.config.update("jax_cpu_enable_async_dispatch", not sync)
    fn = _variant(name)
    x = jnp.linspace(-1.0, 1.0, SIZE, dtype=jnp.float32)
    jax.block_until_ready(fn(x))
    gc.collect()
    sys.setswitchinterval(1e-4)  # let the sampler in often while Python runs
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(2e-4)

    before = _rss()
    peak[0] = before
    sampler = threading.Thread(target=sample)
    sampler.start()
    out = fn(x)
    jax.block_until_ready(out)
    done.set()
    sampler.join()
    print(json.dumps({"peak_mib": (peak[0] - before) / MiB, "before_mib": before / MiB}))


def _measure(name: str, sync: bool) -> float:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--child", name]
        + ([] if sync else ["--async"]),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"memory benchmark child {name!r} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    repeats = 1 if quick else 3
    names = ("eager", "kups") if quick else ("eager", "eval_jaxpr", "kups", "keeps every value")
    modes = (
        {"synchronous dispatch": True}
        if quick
        else {"synchronous dispatch": True, "asynchronous dispatch (JAX's default)": False}
    )
    tables, targets = [], []
    value_mib = SIZE * SIZE * 4 / MiB
    for mode, sync in modes.items():
        peaks: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                peaks[name].append(_measure(name, sync))
        medians = {name: statistics.median(values) for name, values in peaks.items()}
        ratio = medians["kups"] / medians["eager"]
        tables.append(
            Table(
                f"{mode}: peak RSS above the pre-run RSS (MiB; median of {repeats} "
                f"processes; one intermediate is {value_mib:.0f} MiB)",
                ["variant", "peak MiB", "runs (MiB)", "/ eager"],
                [
                    [
                        name,
                        medians[name],
                        ", ".join(f"{p:.0f}" for p in peaks[name]),
                        medians[name] / medians["eager"],
                    ]
                    for name in names
                ],
            )
        )
        if sync:
            # Under asynchronous dispatch the queue decides when buffers die: a walker
            # that never frees a value ("keeps every value") measures like eager JAX,
            # so the figure cannot judge freeing and has no target (see the method).
            targets.append(
                Target(
                    f"{mode}: eager kups / eager JAX, peak memory",
                    ratio,
                    f"<= {BOUND}",
                    ratio <= BOUND,
                )
            )
    return Section(
        name="memory",
        title="5. Peak memory of an eager interpretation",
        method=__doc__ or "",
        tables=tables,
        targets=targets,
        notes=[
            "`eval_jaxpr` is `jax.core.eval_jaxpr` on the traced program, eagerly: the "
            "floor for re-binding a jaxpr, which also frees values after their last use. "
            "`keeps every value` is a control: an eager walk of the same jaxpr that never "
            "frees; it shows what the measurement reports for an interpreter that keeps "
            "its intermediates."
        ],
        seconds=time.perf_counter() - start,
    )


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child(sys.argv[sys.argv.index("--child") + 1], sync="--async" not in sys.argv)
    else:
        from ._report import main

        main(run)
