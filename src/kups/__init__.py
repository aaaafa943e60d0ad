"""kups: a generic, context-threading jaxpr interpreter with pluggable handlers."""

from importlib.metadata import version as _version

__version__: str = _version("kups")

__all__ = ["__version__"]
