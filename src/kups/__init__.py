"""kups: a generic, context-threading jaxpr interpreter with pluggable handlers."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

# The distribution is `kups-interpreter`, the import package `kups`: the name `kups`
# on PyPI belongs to kUPS, a molecular simulation library whose import package is
# also `kups`.
_DISTRIBUTION = "kups-interpreter"

try:
    __version__: str = _version(_DISTRIBUTION)
except _PackageNotFoundError:
    # Imported from a source tree that is not installed (`PYTHONPATH=src`).
    __version__ = "0+unknown"

# The package shows `__all__` and nothing else.
del _DISTRIBUTION, _PackageNotFoundError, _version

__all__ = ["__version__"]
