"""Adapters for the JAX internals that kups needs and that move between releases.

Every read of a `jax._src` symbol, and every parameter name that differs between
JAX releases, lives in this package, by topic, each helper naming the releases it
serves. The rest of kups imports only public JAX and this package.
"""

from ._core import JAX_VERSION as JAX_VERSION
from ._core import SUPPORTED_JAX as SUPPORTED_JAX
from ._core import UNSPECIFIED as UNSPECIFIED
from ._core import DropVar as DropVar
from ._core import ShapedArray as ShapedArray
from ._core import Tracer as Tracer
from ._core import adopt_debug_info as adopt_debug_info
from ._core import api_boundary as api_boundary
from ._core import aval_match_key as aval_match_key
from ._core import aval_of as aval_of
from ._core import bind_equation as bind_equation
from ._core import current_name_stack as current_name_stack
from ._core import former_primitive_names as former_primitive_names
from ._core import in_eager_shard_map as in_eager_shard_map
from ._core import is_eager as is_eager
from ._core import is_literal as is_literal
from ._core import is_staging as is_staging
from ._core import register_effect_type as register_effect_type
from ._core import register_recompute_rule as register_recompute_rule
from ._core import register_traceback_exclusion as register_traceback_exclusion
from ._core import saved_by as saved_by
from ._core import stage_unchanged as stage_unchanged
from ._core import typematch as typematch
from ._core import used_inputs as used_inputs
from ._core import user_context as user_context
from ._core import user_frames as user_frames
from ._core import without_traceback as without_traceback
from ._core import wrapped_in as wrapped_in
from ._jaxprs import call_jaxpr as call_jaxpr
from ._jaxprs import close_over as close_over
from ._jaxprs import eval_jaxpr as eval_jaxpr
from ._jaxprs import has_input_effects as has_input_effects
from ._jaxprs import has_input_effects_any as has_input_effects_any
from ._jaxprs import hoist_consts as hoist_consts
from ._jaxprs import is_high_equation as is_high_equation
from ._jaxprs import is_var as is_var
from ._jaxprs import jaxpr_like as jaxpr_like
from ._jaxprs import jaxprs_in_params as jaxprs_in_params
from ._jaxprs import new_closed_jaxpr as new_closed_jaxpr
from ._jaxprs import new_jaxpr as new_jaxpr
from ._jaxprs import new_var as new_var
from ._jaxprs import open_jaxpr as open_jaxpr
from ._jaxprs import remat_primitive as remat_primitive
from ._jaxprs import replace_jaxpr as replace_jaxpr
from ._jaxprs import symbolic_zero_type as symbolic_zero_type
from ._jaxprs import trace_to_jaxpr as trace_to_jaxpr
from ._jaxprs import unmemoized_rules as unmemoized_rules
from ._meshes import abstract_mesh as abstract_mesh
from ._meshes import axis_names_in_error as axis_names_in_error
from ._meshes import current_mesh as current_mesh
from ._meshes import drops_manual_axes as drops_manual_axes
from ._meshes import equation_mesh as equation_mesh
from ._meshes import manual_axis_scope as manual_axis_scope
from ._meshes import reshard_to_spec as reshard_to_spec
from ._meshes import retype_for_mesh as retype_for_mesh
from ._meshes import shape_dtype_struct as shape_dtype_struct
from ._meshes import shard_aval as shard_aval
from ._meshes import typed_mesh as typed_mesh
from ._meshes import values_mesh as values_mesh
from ._meshes import varying_axes as varying_axes
from ._params import KNOWN_PARAMS as KNOWN_PARAMS
from ._params import bind_shard_map as bind_shard_map
from ._params import cond_params as cond_params
from ._params import scan_layout as scan_layout
from ._params import scan_params as scan_params
from ._params import shard_map_manual_axes as shard_map_manual_axes
from ._params import shard_map_params as shard_map_params
