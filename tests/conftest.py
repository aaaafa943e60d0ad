"""Shared test setup: eight CPU devices, and the meshes the tests use.

The environment variables must be set before JAX is imported anywhere, which
is why they come before every other import in this file; pytest imports
`conftest.py` before any test module.
"""

import os

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
