"""The effect toolkit: what effects share, for writing your own.

A `Position` in the context, kept right by `track_position` around the
control-flow handlers, says where an equation runs (loop iterations, shard);
`source_of` gives its user source line; `event_order`, `first_across_shards` and
`first_index` pick the first event across iterations, shards and vmapped
elements; `reduce_shards` combines the shards' values in one collective;
`Report` and `Event` give a report its fields and its looks; `stage_eagerly`
compiles an effect called without `jit`.
"""

from ._first import event_order as event_order
from ._first import first_across_shards as first_across_shards
from ._first import first_index as first_index
from ._position import Position as Position
from ._position import ShardLevel as ShardLevel
from ._position import track_position as track_position
from ._report import Event as Event
from ._report import Report as Report
from ._shards import reduce_shards as reduce_shards
from ._source import hide_frames as hide_frames
from ._source import source_of as source_of
from ._staging import stage_eagerly as stage_eagerly

__all__ = [
    "Event",
    "Position",
    "Report",
    "ShardLevel",
    "event_order",
    "first_across_shards",
    "first_index",
    "hide_frames",
    "reduce_shards",
    "source_of",
    "stage_eagerly",
    "track_position",
]
