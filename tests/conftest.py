"""Shared test setup: eight CPU devices, the meshes the tests use, and a library
installed as pip installs one.

The environment variables must be set before JAX is imported anywhere, which
is why they come before every other import in this file; pytest imports
`conftest.py` before any test module.
"""

import importlib
import os
from collections.abc import Callable
from types import ModuleType

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402


@pytest.fixture
def mesh42() -> Mesh:
    """A 4x2 mesh over the eight CPU devices, axes `("x", "y")`, both `Auto`."""
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture
def mesh8() -> Mesh:
    """A one-dimensional mesh over the eight CPU devices, axis `"i"`, `Auto`."""
    return jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))


@pytest.fixture
def installed_library(tmp_path, monkeypatch) -> Callable[[str, str], ModuleType]:
    """`install(name, source)`: writes `source` as the package `name` under a
    `site-packages` directory (where kups reads a frame as an installed library's,
    not the user's) and imports it."""

    def install(name: str, source: str) -> ModuleType:
        package = tmp_path / "site-packages" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
        return importlib.import_module(name)

    return install
