"""The default handlers of `kups.effects`, one module a primitive."""

from ._checkpoint import default_checkpoint_handler as default_checkpoint_handler
from ._closed_call import default_closed_call_handler as default_closed_call_handler
from ._cond import default_cond_handler as default_cond_handler
from ._custom_batching import default_custom_vmap_handler as default_custom_vmap_handler
from ._custom_derivatives import default_custom_jvp_handler as default_custom_jvp_handler
from ._custom_derivatives import default_custom_vjp_handler as default_custom_vjp_handler
from ._jit import default_jit_handler as default_jit_handler
from ._library import (
    default_library_primitive_handler as default_library_primitive_handler,
)
from ._linear_solve import (
    default_custom_linear_solve_handler as default_custom_linear_solve_handler,
)
from ._primitive import default_primitive_handler as default_primitive_handler
from ._remat_opt import default_remat_opt_handler as default_remat_opt_handler
from ._scan import default_scan_handler as default_scan_handler
from ._shard_map import default_shard_map_handler as default_shard_map_handler
from ._while import default_while_handler as default_while_handler
from ._while import while_with_predicate as while_with_predicate

__all__ = [
    "default_checkpoint_handler",
    "default_closed_call_handler",
    "default_cond_handler",
    "default_custom_jvp_handler",
    "default_custom_linear_solve_handler",
    "default_custom_vjp_handler",
    "default_custom_vmap_handler",
    "default_jit_handler",
    "default_library_primitive_handler",
    "default_primitive_handler",
    "default_remat_opt_handler",
    "default_scan_handler",
    "default_shard_map_handler",
    "default_while_handler",
    "while_with_predicate",
]
