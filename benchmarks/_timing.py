"""Timing helpers: paired, interleaved repeats and medians.

The machines these run on are noisy (two shared cores). Every figure is
therefore a ratio between variants timed in the same process, in the same
repeat, one right after the other (in an order that changes between repeats, so
that none always runs first or last), and the reported ratio is the median over repeats of the per-repeat
ratios. The garbage collector runs between measurements, not inside them.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Timings:
    """Per-variant lists of seconds, one entry per repeat: `seconds` on the clock
    the figure uses, `wall` on the wall clock (for information)."""

    seconds: dict[str, list[float]]
    wall: dict[str, list[float]]

    def median(self, name: str, *, wall: bool = False) -> float:
        return statistics.median((self.wall if wall else self.seconds)[name])

    def ratio(self, name: str, baseline: str, *, wall: bool = False) -> float:
        """The median over repeats of `name / baseline` (paired per repeat)."""
        seconds = self.wall if wall else self.seconds
        pairs = zip(seconds[name], seconds[baseline], strict=True)
        return statistics.median(a / b for a, b in pairs)


def _time_once(fn: Callable[[], object], clock: Callable[[], float]) -> tuple[float, float]:
    gc.collect()
    gc.disable()
    try:
        start, wall_start = clock(), time.perf_counter()
        fn()
        return clock() - start, time.perf_counter() - wall_start
    finally:
        gc.enable()


def _order(names: list[str], r: int) -> list[str]:
    """Repeat `r`'s order: the names rotated by `r`, reversed every other cycle."""
    k = r % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (r // len(names)) % 2 else order


def paired(
    variants: Mapping[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> Timings:
    """Times each variant `repeats` times, interleaved, after `warmup` untimed runs.

    The order changes from repeat to repeat (`_order`), so that each variant runs
    in each position equally often.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in _order(names, r):
            cpu_seconds, wall_seconds = _time_once(variants[name], clock)
            seconds[name].append(cpu_seconds)
            wall[name].append(wall_seconds)
    return Timings(seconds, wall)


# Trace time is single-threaded Python: the calling thread's CPU time is the
# quantity, and it does not count the time another process holds the core.
trace_clock = time.thread_time
# A compiled program runs on XLA's threads: the process's CPU time over all its
# threads is the work it did. On a loaded machine it is far steadier than the wall
# clock (an A/A test of one jitted MLP step against itself, 31 repeats: median
# ratio 0.998 on CPU time, 1.065 on wall time), and the same program does the
# same work whichever variant built it.
runtime_clock = time.process_time
