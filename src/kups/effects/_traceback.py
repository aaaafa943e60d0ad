"""kups' frames are hidden from the tracebacks of errors, as JAX hides its own.

A typical error raised in a user's function under `reinterpret` would otherwise
show two dozen frames of the interpreter and its handlers around the user's few.
JAX's filtering rules apply: `JAX_TRACEBACK_FILTERING=off` (or
`jax.config.update("jax_traceback_filtering", "off")`) shows every frame, kups'
and JAX's. `KUPS_TRACEBACK_FILTERING=off`, set before kups is imported, keeps
kups' frames while JAX still hides its own.
"""

from __future__ import annotations

import os

from ._compat import api_boundary as api_boundary
from ._compat import register_traceback_exclusion

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The demo ships inside the package but is a user program: its frames stay.
_USER_FILES = frozenset({"_demo.py"})


def kups_source_paths() -> list[str]:
    """The files and directories of kups whose frames are kups internals."""
    paths = []
    for entry in sorted(os.listdir(_PACKAGE_DIR)):
        full = os.path.join(_PACKAGE_DIR, entry)
        if os.path.isdir(full) and os.path.isfile(os.path.join(full, "__init__.py")):
            paths.append(full + os.sep)
        elif entry.endswith(".py") and entry not in _USER_FILES:
            paths.append(full)
    return paths


def filtering_enabled() -> bool:
    """Whether kups' frames are hidden (unless `KUPS_TRACEBACK_FILTERING=off`)."""
    return os.environ.get("KUPS_TRACEBACK_FILTERING", "").strip().lower() not in {
        "off",
        "0",
        "false",
        "no",
    }


if filtering_enabled():
    for _path in kups_source_paths():
        register_traceback_exclusion(_path)
