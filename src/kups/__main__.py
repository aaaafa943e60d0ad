"""Command-line entry point: `python -m kups`.

Placeholder: the demo that `python -m kups` will run is still to be written.
"""

import argparse
from collections.abc import Sequence

import kups


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and print the installed kups version.

    **Arguments:**

    - `argv`: the arguments after the program name (default: `sys.argv[1:]`).

    **Returns:**

    The process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m kups",
        description="kups: a generic, context-threading jaxpr interpreter.",
    )
    parser.add_argument("--version", action="version", version=f"kups {kups.__version__}")
    parser.parse_args(argv)
    print(f"kups {kups.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
