"""`python -m kups`: a demo of what kups sees in a data-parallel training loop.

The demo needs several JAX devices. It asks XLA for that many simulated CPU
devices before JAX is imported, which is why this module parses the command
line and sets the environment first, and imports the demo (and with it JAX)
only afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import kups

SECTIONS = ("counts", "reap", "checks", "nans")

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kups",
        description=(
            "Run a small MLP training loop (lax.scan over SGD steps; each step's forward and "
            "backward pass in jax.shard_map over simulated CPU devices, with a pmean of loss "
            "and gradients) and show what kups sees in it: primitive counts per shard "
            "(kups.instrument), an activation statistic per step and shard (kups.harvest), a "
            "failing runtime check (kups.checks) and the line of an injected NaN (kups.debug). "
            "Every number shown is verified against plain JAX; the exit status is 1 if any "
            "verification fails."
        ),
    )
    parser.add_argument(
        "--section",
        choices=(*SECTIONS, "all"),
        default="all",
        help="which part of the demo to run (default: all)",
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="SGD steps in the scan (default: 8, at least 1)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="simulated CPU devices, one shard each (default: 8)",
    )
    parser.add_argument(
        "--bad-step",
        type=int,
        default=None,
        help="the step whose batch holds an out-of-range input (default: 3, or the last step)",
    )
    parser.add_argument(
        "--bad-shard",
        type=int,
        default=None,
        help="the shard that receives it (default: 5, or the last shard)",
    )
    parser.add_argument(
        "--nan-step",
        type=int,
        default=None,
        help="the step whose batch holds an all-zero sample, which normalises to NaN "
        "(default: 5, or the last step)",
    )
    parser.add_argument(
        "--nan-shard",
        type=int,
        default=0,
        help="the shard that receives it (default: 0)",
    )
    parser.add_argument(
        "--no-color",
        action="store_true",
        help="plain text output (also when NO_COLOR is set or the output is not a terminal)",
    )
    parser.add_argument("--version", action="version", version=f"kups {kups.__version__}")
    return parser


def _request_devices(count: int) -> str | None:
    """Asks XLA for `count` CPU devices, before JAX is imported; an error message
    if JAX is already imported with fewer."""
    if "jax" in sys.modules:
        import jax

        if jax.device_count() < count:
            return (
                f"JAX is already imported with {jax.device_count()} devices; the demo needs "
                f"{count}. Run it as `python -m kups`, or set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={count} before importing JAX."
            )
        return None
    flags = _DEVICE_COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo.

    **Arguments:**

    - `argv`: the arguments after the program name (default: `sys.argv[1:]`).

    **Returns:**

    The process exit status: 0 when every number the demo shows matched plain
    JAX, 1 when one did not, 2 for a usage error.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    bad_step = min(3, args.steps - 1) if args.bad_step is None else args.bad_step
    nan_step = min(5, args.steps - 1) if args.nan_step is None else args.nan_step
    bad_shard = min(5, args.devices - 1) if args.bad_shard is None else args.bad_shard
    for name, value, limit in [
        ("--bad-step", bad_step, args.steps),
        ("--nan-step", nan_step, args.steps),
        ("--bad-shard", bad_shard, args.devices),
        ("--nan-shard", args.nan_shard, args.devices),
    ]:
        if not 0 <= value < limit:
            parser.error(f"{name} must be in [0, {limit}), got {value}")
    problem = _request_devices(args.devices)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2

    from kups._demo import Options, run

    color = not args.no_color and "NO_COLOR" not in os.environ and sys.stdout.isatty()
    sections = SECTIONS if args.section == "all" else (args.section,)
    return run(
        Options(
            sections=sections,
            steps=args.steps,
            devices=args.devices,
            bad_step=bad_step,
            bad_shard=bad_shard,
            nan_step=nan_step,
            nan_shard=args.nan_shard,
            color=color,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
