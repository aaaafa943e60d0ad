"""kups.effects: a context-threading jaxpr interpreter with pluggable handlers."""

from ._defaults import default_dispatcher as default_dispatcher
from ._dispatcher import Dispatcher as Dispatcher
from ._dispatcher import Handler as Handler
from ._dispatcher import StaleTraceWarning as StaleTraceWarning
from ._effect import define_effect as define_effect
from ._effect import is_effect as is_effect
from ._equations import shard_map_axes as shard_map_axes
from ._equations import source_line as source_line
from ._equations import source_location as source_location
from ._equations import to_current_mesh as to_current_mesh
from ._equations import varying_axes as varying_axes
from ._interpreter import Interpreter as Interpreter
from ._matching import CALL_PRIMITIVES as CALL_PRIMITIVES
from ._matching import call_body as call_body
from ._matching import contains_subjaxprs as contains_subjaxprs
from ._matching import equations_in as equations_in
from ._matching import is_library_primitive as is_library_primitive
from ._matching import sub_jaxprs as sub_jaxprs
from ._reinterpret import reinterpret as reinterpret
from ._reinterpret import wraps_with_leading as wraps_with_leading
from ._types import HandlerResult as HandlerResult
from ._types import InterpreterPolicy as InterpreterPolicy
from ._types import ScanSemantics as ScanSemantics
from ._types import Uninitialized as Uninitialized
from ._types import check_policy as check_policy
from ._untouched import skip_when_untouched as skip_when_untouched
from .handlers import (
    default_checkpoint_handler as default_checkpoint_handler,
)
from .handlers import (
    default_closed_call_handler as default_closed_call_handler,
)
from .handlers import default_cond_handler as default_cond_handler
from .handlers import default_custom_jvp_handler as default_custom_jvp_handler
from .handlers import (
    default_custom_linear_solve_handler as default_custom_linear_solve_handler,
)
from .handlers import default_custom_vjp_handler as default_custom_vjp_handler
from .handlers import default_custom_vmap_handler as default_custom_vmap_handler
from .handlers import default_jit_handler as default_jit_handler
from .handlers import (
    default_library_primitive_handler as default_library_primitive_handler,
)
from .handlers import default_primitive_handler as default_primitive_handler
from .handlers import default_remat_opt_handler as default_remat_opt_handler
from .handlers import default_scan_handler as default_scan_handler
from .handlers import default_shard_map_handler as default_shard_map_handler
from .handlers import default_while_handler as default_while_handler
from .handlers import while_with_predicate as while_with_predicate
from .toolkit import Event as Event
from .toolkit import Position as Position
from .toolkit import Report as Report
from .toolkit import ShardLevel as ShardLevel
from .toolkit import event_order as event_order
from .toolkit import first_across_shards as first_across_shards
from .toolkit import first_index as first_index
from .toolkit import hide_frames as hide_frames
from .toolkit import reduce_shards as reduce_shards
from .toolkit import source_of as source_of
from .toolkit import stage_eagerly as stage_eagerly
from .toolkit import track_position as track_position

__all__ = [
    "CALL_PRIMITIVES",
    "Dispatcher",
    "Event",
    "Handler",
    "HandlerResult",
    "Interpreter",
    "InterpreterPolicy",
    "Position",
    "Report",
    "ScanSemantics",
    "ShardLevel",
    "StaleTraceWarning",
    "Uninitialized",
    "call_body",
    "check_policy",
    "contains_subjaxprs",
    "default_checkpoint_handler",
    "default_closed_call_handler",
    "default_cond_handler",
    "default_custom_jvp_handler",
    "default_custom_linear_solve_handler",
    "default_custom_vjp_handler",
    "default_custom_vmap_handler",
    "default_dispatcher",
    "default_jit_handler",
    "default_library_primitive_handler",
    "default_primitive_handler",
    "default_remat_opt_handler",
    "default_scan_handler",
    "default_shard_map_handler",
    "default_while_handler",
    "define_effect",
    "equations_in",
    "event_order",
    "first_across_shards",
    "first_index",
    "hide_frames",
    "is_effect",
    "is_library_primitive",
    "reduce_shards",
    "reinterpret",
    "shard_map_axes",
    "skip_when_untouched",
    "source_line",
    "source_location",
    "source_of",
    "stage_eagerly",
    "sub_jaxprs",
    "to_current_mesh",
    "track_position",
    "varying_axes",
    "while_with_predicate",
    "wraps_with_leading",
]
