"""What one execution of an equation costs, by the conventions of XLA's
`HloCostAnalysis` for an op that is not fused: FLOPs, transcendentals and bytes
accessed, read from the equation's abstract values alone.

The rules live in a table from primitive name to rule, each registered under its
definition; a primitive without a rule does no FLOPs and accesses its operands and
its outputs. That is right for data movement (`FREE`: `reshape`,
`broadcast_in_dim`, `transpose`, `concatenate`, `pad`, ...); any other primitive
without a rule is remembered in `NO_RULE`, so that `Cost.unpriced` names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn


class EqnCost(NamedTuple):
    """The cost of one execution of an equation."""

    flops: int
    transcendentals: int
    bytes_accessed: int


def _avals(variables: Sequence[Any]) -> list[Any]:
    return [variable.aval for variable in variables]


def _shape(var: Any) -> tuple[int, ...]:
    return getattr(var.aval, "shape", ())


def _elements(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _bytes(aval: Any) -> int:
    """Bytes of an array's value: 0 for tokens and for key arrays (whose dtype is
    JAX's own, not a machine type)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jnp.issubdtype(dtype, jax.dtypes.extended):
        return 0
    return _elements(aval) * np.dtype(dtype).itemsize


def _default_bytes(eqn: JaxprEqn) -> int:
    """HloCostAnalysis' default: every operand read once, every output written once."""
    return sum(map(_bytes, _avals(eqn.invars))) + sum(map(_bytes, _avals(eqn.outvars)))


# A rule: the FLOPs and transcendentals of one execution, and the bytes (None: the
# default, operands plus outputs).
Rule = Callable[[JaxprEqn], tuple[int, int, int | None]]
RULES: dict[str, Rule] = {}


def _register(rule: Rule, names: str) -> None:
    """`rule` for each of the space-separated primitive `names`."""
    for name in names.split():
        RULES[name] = rule


def _out_elements(eqn: JaxprEqn) -> int:
    return _elements(eqn.outvars[0].aval)


def _elementwise(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    return _out_elements(eqn), 0, None


# One FLOP per output element: what HloCostAnalysis' HandleElementwiseOp counts for
# every elementwise op that is not transcendental (compare, select, clamp and
# convert included).
_register(
    _elementwise,
    "abs add add_any and ceil clamp clz complex conj convert_element_type div eq "
    "floor ge gt imag is_finite le lt max min mul ne neg nextafter not or "
    "population_count real reduce_precision rem round select_n shift_left "
    "shift_right_arithmetic shift_right_logical sign square sub xor",
)


def _transcendental(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    return 0, _out_elements(eqn), None


# HloCostAnalysis counts these HLO ops as transcendentals (one per output element):
# acosh, atan2, cbrt, cos, erf, exp, expm1, log, log1p, logistic, power, rsqrt, sin,
# sqrt, tan, tanh. JAX's other special functions (asin, sinh, lgamma, ...) are
# expanded by XLA into several ops; here each counts as one transcendental.
_register(
    _transcendental,
    "acos acosh asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt cos cosh "
    "digamma erf erf_inv erfc exp exp2 expm1 igamma igammac lgamma log log1p "
    "logistic polygamma pow random_gamma_grad regularized_incomplete_beta rsqrt "
    "sin sinh sqrt tan tanh zeta exp2 log2 sinpi cospi tanpi exp2m1 log2p1",
)


def _one_minus_square(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """`1 - x * x`, the derivative of `tanh`: 3 FLOPs per element, as XLA counts it."""
    return 3 * _out_elements(eqn), 0, None


RULES["one_minus_square"] = _one_minus_square


def _fma(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """`a * b + c`: a multiplication and an addition per element."""
    return 2 * _out_elements(eqn), 0, None


RULES["fma"] = _fma


def _integer_pow(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """`x ** y` for a static integer `y`: the multiplications of square-and-multiply,
    as JAX lowers it (and one division for a negative `y`)."""
    exponent = abs(eqn.params["y"])
    if exponent == 0:
        return 0, 0, None
    multiplies = exponent.bit_length() - 1 + bin(exponent).count("1") - 1
    multiplies += eqn.params["y"] < 0
    return multiplies * _out_elements(eqn), 0, None


RULES["integer_pow"] = _integer_pow


def _dot_general(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """2 FLOPs (a multiply and an add) per output element per contracted element:
    2*M*N*K for a matrix product, times the batch."""
    (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = _shape(eqn.invars[0])
    contracted = math.prod(lhs_shape[axis] for axis in lhs_contracting)
    return 2 * _out_elements(eqn) * contracted, 0, None


RULES["dot_general"] = _dot_general


def _reduction(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """One application of the combiner per element reduced away: input elements
    minus output elements."""
    return _elements(eqn.invars[0].aval) - _out_elements(eqn), 0, None


_register(
    _reduction,
    "argmax argmin reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum reduce_xor",
)

# One combination per output element.
_register(_elementwise, "cumlogsumexp cummax cummin cumprod cumsum")


def _all_reduce(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """HloCostAnalysis' all-reduce: one FLOP per output element (it assumes two
    participants)."""
    return sum(_elements(var.aval) for var in eqn.outvars), 0, None


_register(_all_reduce, "psum pmax pmin psum_invariant reduce_scatter psum_scatter")


def _reduce_window(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """A pooling: the combiner applied `window size - 1` times per output element
    (padding included), as HloCostAnalysis counts it."""
    window = math.prod(eqn.params["window_dimensions"])
    return sum(_elements(v.aval) for v in eqn.outvars) * max(window - 1, 0), 0, None


_register(
    _reduce_window,
    "reduce_window reduce_window_sum reduce_window_max reduce_window_min",
)


def _select_and_scatter_add(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """The gradient of a max pooling: per element of the incoming gradient, a
    comparison for each other element of its window and one addition."""
    source = _elements(eqn.invars[0].aval)
    return source * math.prod(eqn.params["window_dimensions"]), 0, None


RULES["select_and_scatter_add"] = _select_and_scatter_add


def _fft(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """HloCostAnalysis' FFT: 8 FLOPs per element of the real-valued side (the
    complex one for a complex transform) and per `log2` of each transformed
    length, multiplied."""
    lengths = eqn.params["fft_lengths"]
    logs = math.prod(max(int(length).bit_length() - 1, 0) for length in lengths)
    inverse_real = "IRFFT" in str(eqn.params["fft_type"]).upper()
    side = eqn.outvars[0] if inverse_real else eqn.invars[0]
    return 8 * logs * _elements(side.aval), 0, None


RULES["fft"] = _fft


def _triangular_solve(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """`m * m` FLOPs per right-hand side for an `m` by `m` triangle (a
    multiplication and an addition per element of the half it reads). XLA on CPU
    calls a library for it and gives no figure."""
    a, b = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    m = a[-1]
    batch = math.prod(b[:-2])
    rhs = b[-1] if eqn.params["left_side"] else b[-2]
    return batch * m * m * rhs, 0, None


RULES["triangular_solve"] = _triangular_solve


# Primitives that move, convert the type of, or name data, and compute nothing:
# no FLOPs (`Cost.unpriced` lists the primitives that ran with no rule and not here).
_FREE_NAMES = (
    "reshape broadcast_in_dim transpose concatenate pad squeeze expand_dims rev copy "
    "copy_p iota bitcast_convert_type device_put optimization_barrier pvary pbroadcast "
    "ppermute all_gather all_gather_invariant all_to_all axis_index sharding_constraint "
    "reshard mesh_cast split tile stop_gradient name checkpoint_name random_wrap "
    "random_unwrap random_seed random_split random_fold_in debug_callback create_token "
    "after_all empty"
)
FREE = frozenset(_FREE_NAMES.split())


def _sort(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """`n * ceil(log2(n))` comparisons for the `n` elements of the first operand."""
    elements = _elements(eqn.invars[0].aval)
    return elements * max(0, math.ceil(math.log2(elements))) if elements else 0, 0, None


RULES["sort"] = _sort


def _slice(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """A slice reads only what it writes."""
    return 0, 0, 2 * _bytes(eqn.outvars[0].aval)


RULES["slice"] = _slice


def _dynamic_slice(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    indices = sum(map(_bytes, _avals(eqn.invars[1:])))
    return 0, 0, 2 * _bytes(eqn.outvars[0].aval) + indices


RULES["dynamic_slice"] = _dynamic_slice


def _dynamic_update_slice(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """The operand is updated in place: the update is read and written."""
    indices = sum(map(_bytes, _avals(eqn.invars[2:])))
    return 0, 0, 2 * _bytes(eqn.invars[1].aval) + indices


RULES["dynamic_update_slice"] = _dynamic_update_slice


def _gather(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    return 0, 0, 2 * _bytes(eqn.outvars[0].aval) + _bytes(eqn.invars[1].aval)


RULES["gather"] = _gather


def _scatter(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """Three times the updates (read the operand's part, read the update, write)
    and the indices; one combination per update element (none for a plain
    scatter, which only writes)."""
    operand, indices, updates = _avals(eqn.invars[:3])
    del operand
    combines = 0 if eqn.primitive.name == "scatter" else _elements(updates)
    return combines, 0, 3 * _bytes(updates) + _bytes(indices)


_register(_scatter, "scatter scatter-add scatter-sub scatter-mul scatter-min scatter-max")


def _valid_positions(
    input_size: int,
    kernel_size: int,
    output_size: int,
    stride: int,
    padding: tuple[int, int],
    base_dilation: int,
    window_dilation: int,
) -> int:
    """How many (output, kernel) pairs of one spatial dimension read an input
    element rather than padding or a dilation hole."""
    count = 0
    for kernel_index in range(kernel_size):
        for output_index in range(output_size):
            undilated = output_index * stride - padding[0] + kernel_index * window_dilation
            if undilated % base_dilation:
                continue
            if 0 <= undilated // base_dilation < input_size:
                count += 1
    return count


def _conv(eqn: JaxprEqn) -> tuple[int, int, int | None]:
    """2 FLOPs per multiply-add that reads an input element (padding and dilation
    holes excluded), as HloCostAnalysis counts a convolution."""
    params = eqn.params
    lhs, rhs = map(_shape, eqn.invars[:2])
    out = _shape(eqn.outvars[0])
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    positions = 1
    for axis, (lhs_axis, rhs_axis, out_axis) in enumerate(
        zip(lhs_spec[2:], rhs_spec[2:], out_spec[2:], strict=True)
    ):
        positions *= _valid_positions(
            lhs[lhs_axis],
            rhs[rhs_axis],
            out[out_axis],
            params["window_strides"][axis],
            tuple(params["padding"][axis]),
            params["lhs_dilation"][axis],
            params["rhs_dilation"][axis],
        )
    input_features = lhs[lhs_spec[1]] // params["feature_group_count"]
    batch = lhs[lhs_spec[0]] // params["batch_group_count"]
    return 2 * input_features * out[out_spec[1]] * batch * positions, 0, None


RULES["conv_general_dilated"] = _conv


# The primitives met with no rule that are not `FREE`: counted with no FLOPs, and
# listed by `Cost.unpriced`.
NO_RULE: set[str] = set()


def equation_cost(eqn: JaxprEqn) -> EqnCost:
    """The cost of one execution of `eqn` (an equation without sub-programs)."""
    name = eqn.primitive.name
    rule = RULES.get(name)
    if rule is None and name not in FREE:
        NO_RULE.add(name)
    flops, transcendentals, bytes_accessed = rule(eqn) if rule else (0, 0, None)
    if bytes_accessed is None:
        bytes_accessed = _default_bytes(eqn)
    return EqnCost(int(flops), int(transcendentals), int(bytes_accessed))
