"""`kups.instrument`: what a program ran, and how often, through every loop,
branch and shard: `count_primitives` (executions by primitive) and `count_flops`
(FLOPs, transcendentals and bytes accessed)."""

from ._count import count_primitives as count_primitives
from ._counts import PrimitiveCounts as PrimitiveCounts

__all__ = ["PrimitiveCounts", "count_primitives"]
