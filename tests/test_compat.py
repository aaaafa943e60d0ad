"""kups on the running JAX release: the parameters of every control-flow primitive
are ones kups knows, and one it does not know stops kups with a clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import custom_batching, lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core.primitives import closed_call_p
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from kups.effects import (
    CALL_PRIMITIVES,
    Interpreter,
    _compat,
    call_body,
    default_dispatcher,
    default_library_primitive_handler,
    default_primitive_handler,
    equations_in,
    reinterpret,
    source_line,
    sub_jaxprs,
)
from kups.effects._registry import DEFAULT_HANDLERS

X = jnp.arange(8.0)


@jax.custom_jvp
def _custom_jvp(x):
    return jnp.sin(x)


_custom_jvp.defjvp(lambda primals, tangents: (_custom_jvp(primals[0]), tangents[0]))


@jax.custom_vjp
def _custom_vjp(x):
    return jnp.sin(x)


_custom_vjp.defvjp(lambda x: (_custom_vjp(x), x), lambda x, g: (g * jnp.cos(x),))


@jax.custom_vjp
def _remat_opt(x):
    return jnp.sin(x)


_remat_opt.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,), optimize_remat=True)


@custom_batching.custom_vmap
def _custom_vmap(x):
    return jnp.sin(x)


_custom_vmap.def_vmap(lambda axis_size, in_batched, x: (jnp.cos(x), in_batched[0]))


def _shard_map(x):
    mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    return jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)


def _call(x):
    return _compat.bind_equation(closed_call_p, {"call_jaxpr": jax.make_jaxpr(jnp.sin)(x)}, [x])[0]


# One program per control-flow primitive kups has a default handler for.
PROGRAMS = {
    "jit": lambda x: jax.jit(jnp.sin)(x),
    "scan": lambda x: lax.scan(lambda c, a: (c + a, a * c), 0.0, x),
    "while": lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)),
    "cond": lambda x: lax.switch(1, [jnp.sin, jnp.cos, jnp.tan], x),
    "remat2": lambda x: jax.checkpoint(jnp.sin)(x),
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
    "custom_linear_solve": lambda x: lax.custom_linear_solve(
        lambda v: 2 * v, x, lambda mv, b: b / 2
    ),
    "call": _call,
    # Staged by differentiating a `custom_vjp` with `optimize_remat=True`.
    "remat_opt": lambda x: jax.grad(lambda a: jnp.sum(_remat_opt(a)))(x),
    "custom_vmap_call": _custom_vmap,
}


def _equation(fn, name):
    jaxpr = jax.make_jaxpr(fn)(X)
    names = [e.primitive.name for e in jaxpr.eqns]
    return jaxpr, next(e for e in jaxpr.eqns if e.primitive.name in {name, "eval_jaxpr"}), names


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_running_jax_gives_only_parameters_kups_knows(name):
    _, eqn, _ = _equation(PROGRAMS[name], name if name != "call" else "closed_call")
    known = _compat.KNOWN_PARAMS[eqn.primitive.name]
    assert set(eqn.params) <= known, (jax.__version__, set(eqn.params) - known)
    assert eqn.primitive.name in DEFAULT_HANDLERS
    out, _ctx = reinterpret(PROGRAMS[name], Interpreter(default_dispatcher()))(0, X)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(PROGRAMS[name](X)), strict=True):
        np.testing.assert_array_equal(got, want)


def test_every_default_handler_has_its_parameters_listed():
    legacy = {"call"}  # JAX 0.10's, with no parameters of its own
    # Library primitives kups goes inside (lineax's linear_solve, equinox's vprim,
    # JAX's own call_hi_primitive): their params are read by the library handler
    # (the primitive's implementation), not by kups.
    library = {
        name
        for name, handler in DEFAULT_HANDLERS.items()
        if handler is default_library_primitive_handler
    }
    assert library == {"linear_solve", "vprim", "call_hi_primitive"}
    assert set(DEFAULT_HANDLERS) - legacy - library <= set(_compat.KNOWN_PARAMS)


_CALLS = {"jit", "remat2", "custom_jvp_call", "custom_vjp_call", "call"}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_call_body_is_the_body_of_a_call_and_none_for_other_control_flow(name):
    _, eqn, _ = _equation(PROGRAMS[name], name if name != "call" else "closed_call")
    body = call_body(eqn)
    if name not in _CALLS:
        assert body is None and eqn.primitive.name not in CALL_PRIMITIVES
        return
    assert eqn.primitive.name in CALL_PRIMITIVES
    assert body is not None
    assert len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars)
    assert "sin" in [e.primitive.name for e in body.eqns]


def test_every_call_a_differentiated_checkpointed_loop_makes_is_a_call_primitive():
    # `grad` of a checkpointed scan inside a scan: JAX 0.11 on calls the
    # checkpointed body with `eval_jaxpr` in the forward pass. Any equation whose
    # one sub-program takes its inputs and gives its outputs, other than a known
    # non-call, is named in CALL_PRIMITIVES.
    def step(h, i):
        return lax.cond(i < 3, lambda h: jnp.sin(h) * 2.0, lambda h: h, h), None

    inner = jax.checkpoint(lambda h, js: lax.scan(step, h, js)[0])

    def loss(x):
        return lax.scan(lambda h, js: (inner(h, js), None), x, jnp.arange(8).reshape(2, 4))[0]

    closed = jax.make_jaxpr(jax.grad(lambda x: loss(jax.jit(jnp.cos)(x))))(0.5)
    others = {"scan", "while", "shard_map", "custom_linear_solve", "remat_opt"}
    found = set()
    calls = {id(e): e for _, around in equations_in(closed) for e in around}
    for eqn in calls.values():
        subs = sub_jaxprs(eqn)
        if eqn.primitive.name in others or len(subs) != 1:
            continue
        if len(subs[0].invars) == len(eqn.invars) and len(subs[0].outvars) == len(eqn.outvars):
            found.add(eqn.primitive.name)
            assert eqn.primitive.name in CALL_PRIMITIVES, (jax.__version__, eqn.primitive.name)
            assert call_body(eqn) is subs[0]
    assert {"jit", "remat2"} <= found, found
    if jax.__version_info__ >= (0, 11):
        assert "eval_jaxpr" in found, found


def test_custom_partitioning_is_not_a_known_primitive():
    # It has no handler (its partitioning rule runs when XLA compiles), and a
    # known primitive with no handler goes to the policy even when untouched.
    @custom_partitioning
    def partitioned(x):
        return jnp.sin(x)

    partitioned.def_partition(
        partition=lambda mesh, args, result: (mesh, jnp.sin, result.sharding, (args[0].sharding,)),
        sharding_rule="i -> i",
    )
    (eqn,) = jax.make_jaxpr(partitioned)(X).eqns
    assert eqn.primitive.name == "custom_partitioning"
    params = {
        "call",
        "partition",
        "decode_shardings",
        "sharding_rule",
        "in_tree",
        "out_tree",
        "static_args",
    }
    # Up to JAX 0.12.0.1; 0.12.1 dropped them.
    older = {"propagate_user_sharding", "infer_sharding_from_operands"}
    assert params <= set(eqn.params) <= params | older
    assert "custom_partitioning" not in _compat.KNOWN_PARAMS
    assert "custom_partitioning" not in DEFAULT_HANDLERS


def test_scan_layout_and_a_rebuilt_scan_with_nothing_added_are_the_original():
    _jaxpr, eqn, _ = _equation(PROGRAMS["scan"], "scan")
    num_consts, num_carry = _compat.scan_layout(eqn.params)
    assert num_carry == 1 and num_consts + num_carry + 1 == len(eqn.invars)
    rebuilt = _compat.scan_params(
        eqn.params, jaxpr=eqn.params["jaxpr"], num_consts=num_consts, num_carry=num_carry
    )
    assert rebuilt == dict(eqn.params)


def test_a_parameter_kups_has_never_seen_is_a_clear_error():
    jaxpr, eqn, _ = _equation(PROGRAMS["scan"], "scan")
    future = eqn.replace(params={**eqn.params, "fancy_new_option": 3})
    closed = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(eqns=[future]))
    # A handler inside the body: the scan is interpreted, not re-bound whole.
    count = default_dispatcher().register_handler("mul", default_primitive_handler)
    with pytest.raises(NotImplementedError) as info:
        Interpreter(count)(closed, 0, X)
    message = str(info.value)
    assert "'fancy_new_option'" in message and "'scan'" in message
    assert f"JAX {jax.__version__}" in message and _compat.SUPPORTED_JAX in message


def test_source_line_of_an_equation_in_an_installed_library_names_the_callers_line(
    installed_library,
):
    # A library as pip installs it: under site-packages.
    library = installed_library(
        "kups_test_fakelib", "import jax.numpy as jnp\n\ndef sine(x):\n    return jnp.sin(x)\n"
    )

    def user_fn(x):
        return library.sine(x) * 2.0  # the user's call

    eqns = jax.make_jaxpr(user_fn)(1.0).eqns
    sine = next(e for e in eqns if e.primitive.name == "sin")
    mul = next(e for e in eqns if e.primitive.name == "mul")
    assert source_line(sine).startswith(f"{library.__file__}:4")
    assert ", called from " in source_line(sine)
    assert source_line(sine).endswith("user_fn)")
    assert "test_compat.py" in source_line(sine).split(", called from ")[1]
    # The user's own line is shown alone.
    assert "called from" not in source_line(mul)
    assert "test_compat.py" in source_line(mul)
