"""kups: a generic, context-threading jaxpr interpreter with pluggable handlers."""

from importlib.metadata import version as _version

__version__: str = _version("kups")
del _version  # the package shows `__all__` and nothing else

__all__ = ["__version__"]
