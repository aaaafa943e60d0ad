"""`kups.instrument`: what a program ran, and how often, through every loop,
branch and shard: `count_primitives` (executions by primitive) and `count_flops`
(FLOPs, transcendentals and bytes accessed)."""

from ._cost import Cost as Cost
from ._count import count_primitives as count_primitives
from ._counts import PrimitiveCounts as PrimitiveCounts
from ._flops import count_flops as count_flops

__all__ = ["Cost", "PrimitiveCounts", "count_flops", "count_primitives"]


def __dir__() -> list[str]:
    """The public names only (not the private submodules Python sets here)."""
    return sorted(__all__)
