"""Benchmark 6: trace time of effects that handle one primitive ("pay only for
what you handle").

Two interpretations, each traced end to end under `jax.make_jaxpr` and set
against tracing `f` alone (`jax.make_jaxpr(f)`) in the same repeat:

- reap: `kups.harvest.reap(f, tag=...)`, `f` sowing twice under the tag.
- one handler: `reinterpret(f, Interpreter(dispatcher))`, where the dispatcher
  is `default_dispatcher()` plus one handler, for `cumsum`, which `f` binds once
  (the handler re-binds it and adds one to an `int32` context).

On two kinds of program (`benchmarks/_programs.py`):

- jnp model (`jnp_model`): `jnp` code in stages, each a user `jax.jit` around a
  `lax.scan` and a `lax.fori_loop` whose bodies call `jnp` functions that are
  jits themselves (`clip`, `linalg.norm`, `silu`, `var`, `where`), then more
  `jnp` code. The first stage's scan body sows (in the `append` mode) and calls
  `jnp.cumsum`; one more sow sits at the top level. The user's functions are
  fresh closures at each trace (JAX's caches never hit for them; those of the
  `jnp` functions hit, as in any program).
- straight-line `lax` (`straight_line_handled`): one raw `lax` call per
  equation, with the `cumsum` and the sow at the top level. Here the top level
  must be walked, so the floor of an interpreter that re-binds every equation is
  shown beside it: tracing `f` and then re-binding its jaxpr with
  `jax.core.eval_jaxpr` (which re-binds a control-flow equation whole, without
  walking its body: on the jnp model it is the cost of an interpreter that walks
  only the top level).

`eqns` counts the equations into every sub-program (`count_eqns`). A peer
column measures Oryx's harvest (`oryx.core.reap` on the same programs, sowing
with `oryx.core.sow`) when Oryx can be imported.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.core as jax_core
import jax.numpy as jnp

from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    reinterpret,
)
from kups.harvest import reap, sow

from ._programs import (
    SOW_TAG,
    count_eqns,
    jnp_model,
    model_inputs,
    small_inputs,
    straight_line_handled,
)
from ._report import Section, Table, Target, main
from ._timing import paired, trace_clock

MODEL_BOUND = 1.3  # jnp model, 16k equations: end-to-end / tracing f alone
STRAIGHT_BOUND = 1.5  # straight-line lax, 16k equations: the same
HANDLED = "cumsum"

Builder = Callable[..., Callable[[Any, Any], Any]]


def _oryx() -> tuple[Any, str]:
    """Oryx's `(reap, sow)` and `""`, or `None` and why it cannot be measured."""
    try:
        from oryx.core import reap as oryx_reap
        from oryx.core import sow as oryx_sow
    except ModuleNotFoundError as err:
        if err.name == "oryx":
            return None, "not installed"
        return None, f"cannot import: {type(err).__name__}: {err}"
    except (ImportError, AttributeError) as err:
        # Oryx imports TensorFlow Probability's JAX substrate, which reaches into
        # JAX internals that newer JAX releases removed.
        return None, f"cannot import: {type(err).__name__}: {err}"
    return (oryx_reap, oryx_sow), ""


def _count_handler(interpreter: Any, ctx: Any, eqn: Any, invals: list[Any]) -> HandlerResult:
    outvals = default_primitive_handler(interpreter, ctx, eqn, invals).outvals
    return HandlerResult(ctx + 1, outvals)


def _variants(
    builder: Builder, size: int, inputs: tuple[Any, Any], oryx: Any
) -> dict[str, Callable[[], object]]:
    x, w = inputs
    one_handler = Interpreter(default_dispatcher().register_handler(HANDLED, _count_handler))
    ctx = jnp.zeros((), jnp.int32)

    # `builder(...)` makes new functions at each call, so each run traces from scratch.
    def trace_only() -> object:
        return jax.make_jaxpr(builder(size, sow))(x, w)

    def eval_jaxpr_floor() -> object:
        traced = jax.make_jaxpr(builder(size, sow))(x, w)
        return jax.make_jaxpr(functools.partial(jax_core.eval_jaxpr, traced.jaxpr, traced.consts))(
            x, w
        )

    def kups_reap() -> object:
        return jax.make_jaxpr(reap(builder(size, sow), tag=SOW_TAG))(x, w)

    def kups_one_handler() -> object:
        return jax.make_jaxpr(reinterpret(builder(size, sow), one_handler))(ctx, x, w)

    variants = {
        "trace f": trace_only,
        "eval_jaxpr floor": eval_jaxpr_floor,
        "reap": kups_reap,
        "one handler": kups_one_handler,
    }
    if oryx is not None:
        oryx_reap, oryx_sow = oryx

        def peer_reap() -> object:
            return jax.make_jaxpr(oryx_reap(builder(size, oryx_sow), tag=SOW_TAG))(x, w)

        variants["oryx reap"] = peer_reap
    return variants


def _check(
    builder: Builder, size: int, inputs: tuple[Any, Any], reaped: set[str]
) -> tuple[int, int]:
    """Runs both interpretations once and checks what they did: `reap` returns the
    `reaped` names, the handler is called once per trace. Returns the equations
    (into every sub-program) and those at the top level."""
    x, w = inputs
    closed = jax.make_jaxpr(builder(size, sow))(x, w)
    _, sown = reap(builder(size, sow), tag=SOW_TAG)(x, w)
    if set(sown) != reaped:
        raise AssertionError(f"reap returned {sorted(sown)}, expected {sorted(reaped)}")
    visits = []

    def counted(interpreter: Any, ctx: Any, eqn: Any, invals: list[Any]) -> HandlerResult:
        visits.append(eqn)
        return _count_handler(interpreter, ctx, eqn, invals)

    one_handler = Interpreter(default_dispatcher().register_handler(HANDLED, counted))
    jax.make_jaxpr(reinterpret(builder(size, sow), one_handler))(jnp.zeros((), jnp.int32), x, w)
    if len(visits) != 1:
        raise AssertionError(f"the {HANDLED} handler ran {len(visits)} times, expected 1")
    return count_eqns(closed), len(closed.jaxpr.eqns)


def run(quick: bool = False) -> Section:
    start = time.perf_counter()
    sizes = (500, 1000) if quick else (1000, 4000, 16000)
    repeats = dict.fromkeys(sizes, 2) if quick else {1000: 11, 4000: 7, 16000: 5}
    largest = sizes[-1]
    oryx, oryx_status = _oryx()
    # Each program: its builder, inputs, bound and the names `reap` returns.
    programs: dict[str, tuple[Builder, tuple[Any, Any], float, set[str]]] = {
        "jnp model": (jnp_model, model_inputs(), MODEL_BOUND, {"inner", "top"}),
        "straight-line lax": (straight_line_handled, small_inputs(), STRAIGHT_BOUND, {"top"}),
    }
    rows, ms_rows, targets = [], [], []
    for program, (builder, inputs, bound, reaped) in programs.items():
        for size in sizes:
            num_eqns, top_level = _check(builder, size, inputs, reaped)
            variants = _variants(builder, size, inputs, oryx)
            timings = paired(variants, repeats[size], clock=trace_clock)

            def ratio(name: str, timings: Any = timings) -> float:
                return timings.ratio(name, "trace f")

            peer: Any = ratio("oryx reap") if oryx is not None else oryx_status.split(":")[0]
            rows.append(
                [
                    program,
                    num_eqns,
                    top_level,
                    ratio("reap"),
                    ratio("one handler"),
                    ratio("eval_jaxpr floor"),
                    peer,
                    repeats[size],
                ]
            )
            ms_rows.append([program, num_eqns, *(1e3 * timings.median(name) for name in variants)])
            if size != largest:
                continue
            floor = ratio("eval_jaxpr floor")
            for figure in ("reap", "one handler"):
                value = ratio(figure)
                targets.append(
                    Target(
                        f"{program}, {num_eqns} eqns: {figure} / trace f, end-to-end",
                        value,
                        f"<= {bound}",
                        value <= bound,
                        f"eval_jaxpr floor: {floor:.2f}" if program == "straight-line lax" else "",
                    )
                )
    ms_columns = ["trace f", "eval_jaxpr floor", "reap", "one handler"]
    if oryx is not None:
        ms_columns.append("oryx reap")
    tables = [
        Table(
            "End-to-end trace time / tracing `f` alone (medians of per-repeat ratios, "
            "thread CPU time)",
            [
                "program",
                "eqns",
                "top-level eqns",
                "reap",
                f"one handler ({HANDLED})",
                "eval_jaxpr floor",
                "Oryx reap",
                "repeats",
            ],
            rows,
        ),
        Table(
            "Trace time (median ms of thread CPU time)",
            ["program", "eqns", *ms_columns],
            ms_rows,
        ),
    ]
    return Section(
        name="effects_trace",
        title="6. Trace time when one primitive is handled",
        method=__doc__ or "",
        tables=tables,
        targets=targets,
        notes=_notes(oryx_status),
        seconds=time.perf_counter() - start,
    )


def _notes(oryx_status: str) -> list[str]:
    return [
        "**What bounds the straight-line rows.** With the handled primitive at the "
        "top level, the top-level jaxpr must be walked. Re-binding each of its "
        "equations through JAX's `bind` is what the `eval_jaxpr floor` column "
        "measures: above 2x tracing `f`, since re-binding an equation costs more than "
        "the `lax` call that staged it (the same staging, plus the equation's "
        "source-info and context managers and its bind parameters). kups does not "
        "re-bind them one by one: while staging, each run of at least 16 equations "
        "that no handler touches is bound as one `jit` call holding the traced "
        "equations (`kups_untouched`; `untouched_runs` in "
        "`src/kups/effects/_untouched.py`), so the walk costs a few binds. What is left "
        "above tracing `f` is kups' own passes over the equations (the walking plan, "
        "the split into runs and building each run's jaxpr, and, for `reap`, the check "
        "for library primitives holding Python functions), linear in the equations. "
        "The compiled program is unchanged: XLA inlines the calls "
        "(`tests/test_interpreter.py` compares the optimized HLO).",
        "**What reap walks on the jnp model.** An equation is re-bound whole, "
        "without walking its body, when nothing inside goes to a handler other than "
        "a default control-flow one or one marked `skip_when_untouched` "
        "(`src/kups/effects/_untouched.py`). `reap` registers handlers of its own for "
        "`scan`, `while`, `cond` and `shard_map` (they check the sow modes and stack "
        "appended values), marked so: with no sow inside they leave the context as "
        "the default handlers would. So reap walks only the path down to its sows, "
        "as the one-handler row walks only the path down to the `cumsum`. (Before "
        "they were marked, every loop body and every `jit` around a loop was walked: "
        "1.6-1.9 x tracing `f` at 16k equations.)",
        f"**Oryx** ({oryx_status or 'installed and measured'}, in this run). In a "
        "throwaway venv (`python3.11 -m venv /tmp/oryxenv && /tmp/oryxenv/bin/pip "
        "install oryx jax==0.10.2 jaxlib==0.10.2 -e .`), pip installs oryx 0.2.9 "
        "and tensorflow-probability 0.25.0, but `import oryx.core` fails on JAX "
        "0.10.2: `oryx/__init__.py` imports `oryx.bijectors`, which loads TFP's JAX "
        "substrate, and that stops at `AttributeError: module 'jax.interpreters.xla' "
        "has no attribute 'pytype_aval_mappings'` "
        "(`tensorflow_probability/python/internal/backend/jax/ops.py`, line 681). "
        "Loading Oryx's harvest module alone, past the package's `__init__`, fails "
        "too: `oryx/core/interpreters/harvest.py`, line 153, `from jax import util "
        "as jax_util` raises `ImportError: cannot import name 'util' from 'jax'`. "
        "So no Oryx figure can be recorded on these JAX releases; the column fills "
        "in by itself where an Oryx that imports is installed.",
    ]


if __name__ == "__main__":
    main(run)
