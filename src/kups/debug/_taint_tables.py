"""`report="reaching"`: which equations do what to the origins of their
inputs, by primitive name (`_taint_rules` applies them)."""

from __future__ import annotations

# Equations that only move values (no arithmetic): a NaN/Inf of an argument that
# they pass on is first seen at the equation that computes with it, not here.
_MOVES = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "tile",
        "transpose",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "rev",
        "concatenate",
        "pvary",
        "pcast",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "stop_gradient",
        "optimization_barrier",
        "device_put",
    }
)


# Whether an output is finite exactly when its inputs are (real dtypes only):
# the origin passes on unchecked.
_TRANSPARENT = _MOVES | frozenset({"neg", "abs", "floor", "ceil", "round", "sin", "cos", "cbrt"})


# Equations that cannot make a NaN/Inf out of finite inputs, but can drop one:
# their output is checked and inherits its inputs' origin. (Not `gather`: out of
# bounds, `mode="fill"` fills with NaN.)
_FILTERS = frozenset(
    {
        "select_n",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "scatter",
        "pad",
        "max",
        "min",
        "reduce_max",
        "reduce_min",
        "cummax",
        "cummin",
        "clamp",
        "tanh",
        "logistic",
        "erf",
        "atan",
        "atan2",
        "sign",
        "real",
        "imag",
        "top_k",
    }
)


# Filters that only move elements of one input, possibly leaving some out (no
# arithmetic): like `_MOVES`, a NaN/Inf of an argument that they pass on is first
# seen at the equation that computes with it. (Not `gather`: `mode="fill"` fills
# with NaN.)
_SLICES = frozenset({"slice", "dynamic_slice", "pad"})

# With the filters that join the elements of several inputs (an overwrite, a
# `where`): "reaching" follows the elements each keeps. "first" and `nan_sites`
# check those inside loops, where one may be where a constant NaN/Inf that the
# loop carries (not known as a constant in its body) first meets data.
_MOVING_FILTERS = _SLICES | {"select_n", "dynamic_update_slice", "scatter"}


# Output j is operand j, reordered or moved.
_PER_OPERAND = frozenset({"sort", "device_put", "optimization_barrier"})


# Collectives: a shard's output depends on other shards' inputs, so the origin
# is the earliest over the shards.
_COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "pbroadcast",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "reduce_scatter",
    }
)


# Collectives that only move values between shards: a NaN/Inf of an argument
# they pass on is first seen at the equation that computes with it.
_COLLECTIVE_MOVES = frozenset(
    {"ppermute", "pbroadcast", "all_gather", "all_gather_invariant", "all_to_all"}
)


# Overwrites: the operand's NaN/Inf survives only where the update does not
# land, so its origin passes on only if that part of it is not finite.
# By name: (operand, update) positions. equinox's `maybe_set` (the in-place
# update of a buffer in its while loops, which diffrax saves its outputs with) is
# `xs.at[i].set(x)` where its predicate holds.
_OVERWRITES = {"dynamic_update_slice": (0, 1), "scatter": (0, 2), "maybe_set": (1, 2)}


# Elementwise equations: each output element is computed from the elements at
# its position (a scalar operand stands for every position).
_ELEMENTWISE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "rem",
        "pow",
        "max",
        "min",
        "atan2",
        "nextafter",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "sqrt",
        "rsqrt",
        "cbrt",
        "square",
        "integer_pow",
        "logistic",
        "tanh",
        "tan",
        "sin",
        "cos",
        "asin",
        "acos",
        "atan",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "sign",
        "clamp",
        "convert_element_type",
        "reduce_precision",
        "select_n",
    }
)
