"""Differential fuzzing: random programs (`progen.py`) through kups against plain JAX.

For every generated program:

- an identity interpretation (`Interpreter(default_dispatcher())`) returns exactly
  the program's outputs and the context it was given, eagerly; for a sample also
  under `jax.jit`, and the gradients agree (programs without a while loop);
- `count_primitives` agrees, on the op families the generator emits, with the
  counts of the program's hand-threaded twin (plain JAX: loop trip counts, taken
  branches and shards counted by the program itself);
- with effects sprinkled in: `reap` returns the values the threaded twin
  threads by hand, `plant` of those values changes nothing, and `checked`
  reports the threaded twin's first failing check, with its iteration, shard
  and source line;
- with arguments scaled to overflow (sums become Infs, then NaNs), `find_nans`
  and `nan_sites` agree with each other and with the outputs: `report="first"`
  finds something exactly when `nan_sites` lists a site, and its equation,
  line and iteration are among the sites; `report="reaching"` finds something
  exactly when an output holds a NaN or an Inf.

About a fifth of the programs are explicit (`progen`'s docstring): their
arguments live on a mesh with Explicit axes and they run under `jax.set_mesh`
of it, as users of sharding in types call them; the NaN reports also run on the
first of them without it, as `jax.jit(f)(*placed)` calls them.

Every failure prints a standalone reproducer: the seed, the program's source and
the call that failed.

`KUPS_FUZZ_N` programs per test (default 64 for the identity test, 40 for the
effects test; a quarter of it, 12 by default, for the NaN reports), from seed
`KUPS_FUZZ_SEED` (default 0); `KUPS_FUZZ_JIT_EVERY` (default 8) says how often
a program is also checked under `jax.jit` and differentiated;
`KUPS_FUZZ_SHRINK=1` shrinks a failing program before printing it (statements
replaced by copies of their inputs while it fails the same way). Thousands
locally:

    KUPS_FUZZ_N=5000 pytest -m fuzz -n 2 tests/test_fuzz.py
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import progen
from kups.checks import checked
from kups.debug import find_nans, nan_sites
from kups.effects import Interpreter, default_dispatcher, reinterpret
from kups.harvest import plant, reap
from kups.instrument import count_primitives

pytestmark = [pytest.mark.fuzz, pytest.mark.leakcheck]

FIRST = int(os.environ.get("KUPS_FUZZ_SEED", "0"))
N_IDENTITY = int(os.environ.get("KUPS_FUZZ_N", "64"))
N_EFFECTS = int(os.environ.get("KUPS_FUZZ_N", "40"))
# A quarter as many: each program runs three instrumented programs, compiled.
N_NANS = max(1, int(os.environ.get("KUPS_FUZZ_N", "48")) // 4)
JIT_EVERY = int(os.environ.get("KUPS_FUZZ_JIT_EVERY", "8"))
SHRINK = os.environ.get("KUPS_FUZZ_SHRINK", "") == "1"
CHUNK = 25  # programs per test item: fewer items, the same reproducers

CONTEXTS: list[tuple[str, Callable[[], Any]]] = [
    ("0", lambda: 0),
    ("jnp.float32(1.5)", lambda: jnp.float32(1.5)),
    ("{'step': jnp.int32(3), 'name': 'fuzz'}", lambda: {"step": jnp.int32(3), "name": "fuzz"}),
    ("(jnp.arange(3.0), None)", lambda: (jnp.arange(3.0), None)),
]


class Mismatch(AssertionError):
    """A difference between kups and the oracle, with the call that shows it."""

    def __init__(self, what: str, call: str, *, threaded: bool = False):
        super().__init__(what)
        self.call = call
        self.threaded = threaded


def chunks(count: int, size: int = CHUNK) -> list[range]:
    return [range(s, min(s + size, FIRST + count)) for s in range(FIRST, FIRST + count, size)]


def failure(program: progen.Program, check: Callable[[progen.Program], None]) -> str | None:
    """The report of what `check` finds wrong with `program`, or `None`."""
    try:
        with program.context():
            check(program)
    except Mismatch as err:
        return _report(program, str(err), err.call, err.threaded)
    except Exception as err:  # noqa: BLE001 - any crash is a finding: report it with its repro
        detail = "".join(traceback.format_exception_only(err)).strip()
        call = _CRASH_CALL_EFFECTS if program.effects else _CRASH_CALL
        return _report(program, f"crashed: {detail}", call, False)
    return None


def _fails_like(
    check: Callable[[progen.Program], None], report: str
) -> Callable[[progen.Program], bool]:
    """Whether a program fails `check` the way `report` says (its first line)."""
    what = report.splitlines()[1][:60]

    def fails(program: progen.Program) -> bool:
        other = failure(program, check)
        return other is not None and other.splitlines()[1][:60] == what

    return fails


def run_all(
    seeds: Sequence[int],
    effects: bool,
    check: Callable[[progen.Program], None],
    *,
    set_mesh: bool = True,
) -> None:
    """Runs `check` on the programs of `seeds`; with `set_mesh=False`, an explicit
    program is called without `jax.set_mesh` (its mesh only its arguments')."""
    failures = []
    for seed in seeds:
        program = progen.generate(seed, effects=effects)
        if not set_mesh:
            program = dataclasses.replace(program, set_mesh=False)
        report = failure(program, check)
        if report is not None and SHRINK:
            program = progen.shrink(program, _fails_like(check, report))
            report = failure(program, check)
        if report is not None:
            failures.append(report)
    # Every program compiles new executables that JAX caches: keep memory bounded
    # when thousands run in one process.
    jax.clear_caches()
    if failures:
        pytest.fail(f"{len(failures)} program(s) failed\n\n" + "\n\n".join(failures[:3]))


_CRASH_CALL = """
identity = Interpreter(default_dispatcher())
print(reinterpret(program, identity)(0, *args))
print(count_primitives(program)(*args))
"""


_CRASH_CALL_EFFECTS = """
print(reap(program, tag=TAG)(*args))
_, reaped = reap(program, tag=TAG)(*args)
print(plant(program, tag=TAG)(reaped, *args))
print(checked(program)(*args)[1].get())
"""


def _report(program: progen.Program, what: str, call: str, threaded: bool) -> str:
    bar = "=" * 78
    return (
        f"{bar}\nseed {program.seed} (effects={program.effects}"
        f"{'' if program.set_mesh or not program.explicit else ', without jax.set_mesh'}): {what}\n"
        f"--- standalone reproducer ---\n{program.reproducer(call, threaded=threaded)}{bar}"
    )


def tree_equal(a: Any, b: Any) -> bool:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    if tree_a != tree_b:
        return False
    return all(_same(x, y) for x, y in zip(leaves_a, leaves_b))


def _same(x: Any, y: Any) -> bool:
    if not (is_array(x) and is_array(y)):
        return x == y
    x, y = host(x), host(y)
    return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def host(x: Any) -> np.ndarray:
    """`x` as a NumPy array. JAX 0.10.0-0.10.2 cannot bring an empty array that a
    shard_map left sharded over several devices to the host (`np.asarray` fails
    with "could not broadcast input array from shape (8,0,2) into shape
    (1,0,2)"); an empty array has no values to compare anyway."""
    if getattr(x, "size", 1) == 0:
        return np.zeros(x.shape, x.dtype)
    return np.asarray(x)


def close(a: Any, b: Any) -> bool:
    """Equal up to float rounding: the oracle is a different program, compiled
    differently (eager op by op vs fused under jit)."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    if tree_a != tree_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        x, y = host(x), host(y)
        if x.shape != y.shape or not np.allclose(x, y, rtol=1e-5, atol=1e-5):
            return False
    return True


def _loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda a, b: sum(jnp.sum(out) for out in fn(a, b))


# ---------------------------------------------------------------------------
# Identity interpretation, gradients and counts.
# ---------------------------------------------------------------------------


def check_identity(program: progen.Program) -> None:
    fn, args = program.fn, program.args
    ctx_source, make_ctx = CONTEXTS[program.seed % len(CONTEXTS)]
    identity = Interpreter(default_dispatcher())
    interpreted = reinterpret(fn, identity)

    expected = fn(*args)
    out, ctx = interpreted(make_ctx(), *args)
    call = f"""
    identity = Interpreter(default_dispatcher())
    ctx = {ctx_source}
    out, new_ctx = reinterpret(program, identity)(ctx, *args)
    print(out, new_ctx)
    print(program(*args))  # should be the same, bit for bit, and new_ctx == ctx
    """
    if not tree_equal(out, expected):
        raise Mismatch("identity interpretation differs from the program (eager)", call)
    if not tree_equal(ctx, make_ctx()):
        raise Mismatch(f"identity interpretation changed the context: {ctx!r}", call)

    # Eagerly for every fourth program, under jit for the others (cheaper).
    eager_count = program.seed % 4 == 0
    counted = count_primitives(fn) if eager_count else jax.jit(count_primitives(fn))
    out, counts = counted(*args)
    (_, _), state = program.run_threaded()
    want = {fam: int(state["n"][fam]) for fam in program.families}
    got = progen.family_counts(counts)
    call = "count_primitives(program)" if eager_count else "jax.jit(count_primitives(program))"
    if got != want:
        diff = {fam: (got[fam], want[fam]) for fam in want if got[fam] != want[fam]}
        raise Mismatch(
            f"{call} disagrees with the program's structure on {diff} (family: (kups, expected))",
            f"""
            _, counts = {call}(*args)
            print(counts)
            # expected, by op family (summed over the primitive names of a family):
            # {want}
            """,
            threaded=True,
        )
    if eager_count and not tree_equal(out, expected):
        raise Mismatch(
            "count_primitives changed the program's outputs",
            "print(count_primitives(program)(*args)[0], program(*args))",
        )

    if program.seed % JIT_EVERY:
        return
    out, new_ctx = jax.jit(interpreted)(jnp.float32(1.5), *args)
    if not tree_equal((out, new_ctx), (jax.jit(fn)(*args), jnp.float32(1.5))):
        raise Mismatch(
            "identity interpretation under jax.jit differs from jax.jit(program)",
            """
            identity = Interpreter(default_dispatcher())
            out, _ = jax.jit(reinterpret(program, identity))(jnp.float32(1.5), *args)
            print(out)
            print(jax.jit(program)(*args))  # should be the same, bit for bit
            """,
        )
    if program.differentiable:
        try:
            grads = jax.grad(_loss(fn), argnums=(0, 1))(*args)
        except NotImplementedError:  # e.g. pmax has no derivative in JAX
            return
        except Exception as err:
            # Under JAX_CHECK_TRACER_LEAKS, JAX 0.10.2 itself leaks a tracer when it
            # differentiates jit(shard_map(...)): the oracle cannot run, and a leak
            # of kups's own would be indistinguishable from it.
            if jax.config.jax_check_tracer_leaks and "Leaked trace" in str(err):
                return
            raise
        interpreted_grads = jax.grad(_loss(lambda *a: interpreted(0, *a)[0]), argnums=(0, 1))(*args)
        if not tree_equal(interpreted_grads, grads):
            raise Mismatch(
                "gradients of the identity interpretation differ from the program's",
                """
                identity = Interpreter(default_dispatcher())
                def loss(f):
                    return lambda a, b: sum(jnp.sum(o) for o in f(a, b))
                print(jax.grad(loss(lambda *a: reinterpret(program, identity)(0, *a)[0]), (0, 1))(*args))
                print(jax.grad(loss(program), (0, 1))(*args))  # should be the same
                """,
            )


@pytest.mark.parametrize("seeds", chunks(N_IDENTITY), ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_identity_grads_and_counts(seeds):
    run_all(seeds, False, check_identity)


# ---------------------------------------------------------------------------
# Effects: reap, plant and checked against the hand-threaded twin.
# ---------------------------------------------------------------------------


def check_effects(program: progen.Program) -> None:
    fn, args = program.fn, program.args
    expected = fn(*args)
    (_, _), state = program.run_threaded()

    out, reaped = reap(fn, tag=progen.TAG)(*args)
    if not tree_equal(out, expected):
        raise Mismatch(
            "reap changed the program's outputs", "print(reap(program, tag=TAG)(*args)[0])"
        )
    want = jax.tree.map(host, state["sow"])
    if sorted(reaped) != sorted(want) or not close(dict(reaped), want):
        shapes = {k: np.shape(v) for k, v in want.items()}
        got_shapes = {k: np.shape(v) for k, v in reaped.items()}
        raise Mismatch(
            f"reap disagrees with the hand-threaded values: names/shapes {got_shapes} "
            f"(kups) vs {shapes} (expected)",
            """
            _, reaped = reap(program, tag=TAG)(*args)
            (_, _), state = run_threaded()
            for name in sorted(set(reaped) | set(state["sow"])):
                print(name, reaped.get(name), state["sow"].get(name))
            """,
            threaded=True,
        )
    # Planting a name replaces every sow of it: round-trip only the names sown once
    # per iteration (a clobber name may be sown before a loop and in it).
    modes = progen.sown_names(program.body)
    once = {name: value for name, value in reaped.items() if modes[name][0] != "clobber"}
    if once:
        replanted = plant(fn, tag=progen.TAG)(once, *args)
        if not close(replanted, expected):
            raise Mismatch(
                "planting the reaped values changed the outputs",
                f"""
                _, reaped = reap(program, tag=TAG)(*args)
                reaped = {{name: reaped[name] for name in {sorted(once)!r}}}
                print(plant(program, tag=TAG)(reaped, *args))
                print(program(*args))  # should be the same
                """,
            )

    out, error = checked(fn)(*args)
    if not tree_equal(out, expected):
        raise Mismatch("checked changed the program's outputs", "print(checked(program)(*args)[0])")
    want_message = program.expected_message(jax.tree.map(host, state["err"]))
    if error.get() != want_message:
        raise Mismatch(
            f"checked reports {error.get()!r}; the hand-threaded first failure is {want_message!r}",
            "print(checked(program)(*args)[1].get())",
            threaded=True,
        )
    if program.seed % JIT_EVERY == 0:
        _, jit_reaped = jax.jit(reap(fn, tag=progen.TAG))(*args)
        if not close(dict(jit_reaped), want):
            raise Mismatch(
                "reap under jax.jit disagrees with the hand-threaded values",
                "print(jax.jit(reap(program, tag=TAG))(*args)[1])",
                threaded=True,
            )
        _, jit_error = jax.jit(checked(fn))(*args)
        if jit_error.get() != want_message:
            raise Mismatch(
                f"checked under jax.jit reports {jit_error.get()!r}, expected {want_message!r}",
                "print(jax.jit(checked(program))(*args)[1].get())",
            )


@pytest.mark.parametrize("seeds", chunks(N_EFFECTS), ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_reap_plant_and_checks(seeds):
    run_all(seeds, True, check_effects)


# ---------------------------------------------------------------------------
# NaN reports: find_nans and nan_sites against each other and the outputs.
# ---------------------------------------------------------------------------

# Arguments this large overflow the programs' sums and cumulative sums into
# Infs, which `sin`, `maximum`, differences and loops turn into NaNs.
NAN_SCALE = 3e37

_SCALED = f"""
args = tuple(a * {NAN_SCALE!r} for a in args)
"""


def check_nans(program: progen.Program) -> None:
    fn = program.fn
    args = tuple(a * NAN_SCALE for a in program.args)
    # Its own outputs, not the plain program's: compiled with the checks, they
    # may differ in the last bits, and `sin` of arguments this large then differs
    # in every bit (the identity test compares outputs).
    out, reaching = jax.jit(find_nans(fn))(*args)
    held = any(
        not np.all(np.isfinite(host(leaf)))
        for leaf in jax.tree.leaves(out)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    )
    if reaching.found != held:
        raise Mismatch(
            f"find_nans reports {reaching!r}, but an output holds a NaN or an Inf: {held}",
            _SCALED + "print(*jax.jit(find_nans(program))(*args))",
        )
    _, first = jax.jit(find_nans(fn, report="first"))(*args)
    _, sites = jax.jit(nan_sites(fn))(*args)
    listed = {(s.primitive, s.source, s.first_iteration) for s in sites}
    if first.found != bool(listed) or (
        first.found and (first.primitive, first.source, first.iteration) not in listed
    ):
        raise Mismatch(
            f"find_nans(report='first') reports {first!r}, not among nan_sites' {sites!r}",
            _SCALED
            + """
            print(jax.jit(find_nans(program, report="first"))(*args)[1])
            print(jax.jit(nan_sites(program))(*args)[1])
            """,
        )


@pytest.mark.parametrize(
    "seeds", chunks(N_NANS, size=4), ids=lambda r: f"seeds{r.start}-{r.stop - 1}"
)
def test_nan_reports_agree(seeds):
    run_all(seeds, False, check_nans)


# The first explicit programs, a third as many: called as `jax.jit(f)(*placed)`,
# on arrays placed on the Explicit mesh, without `jax.set_mesh`.
EXPLICIT_NANS = list(
    itertools.islice(
        (s for s in itertools.count(FIRST) if progen.is_explicit(s)), max(1, N_NANS // 3)
    )
)


@pytest.mark.parametrize("seeds", [EXPLICIT_NANS], ids=lambda s: f"seeds{s[0]}-{s[-1]}")
def test_nan_reports_agree_without_set_mesh(seeds):
    run_all(seeds, False, check_nans, set_mesh=False)
