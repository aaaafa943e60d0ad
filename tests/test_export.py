"""`jax.export` of programs that bind effect primitives where no interpreter runs.

A jitted function that calls `sow`, `check` or any `define_effect` primitive
exports, serializes, deserializes and runs, eagerly and inside `jax.jit`, with
the values of the function itself (each effect is the identity there).
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kups.checks import check
from kups.effects import define_effect
from kups.harvest import sow

log_p = define_effect("export_log")
pair_p = define_effect("export_pair")


def round_trip(fn, *args):
    """`fn` jitted, exported for `args`, serialized and deserialized."""
    exported = jax.export.export(jax.jit(fn))(*args)
    blob = exported.serialize()
    assert isinstance(blob, bytearray | bytes) and len(blob) > 0
    return jax.export.deserialize(blob)


def assert_runs_like(fn, *args):
    restored = round_trip(fn, *args)
    expected = fn(*args)
    for got in (restored.call(*args), jax.jit(restored.call)(*args)):
        jax.tree.map(
            lambda g, e: np.testing.assert_array_equal(np.asarray(g), np.asarray(e)),
            got,
            expected,
        )
    return restored


def run_in_a_fresh_process(script, cwd):
    """Runs `script` in a new Python process, where no kups effect is defined yet."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def with_defined_effects(x):
    (y,) = log_p.bind(jnp.sin(x), tag="activations", index=3)
    a, b = pair_p.bind(y, x * 2.0, path=("a", 1))
    return a * b


def with_sow_and_check(x):
    y = sow(jnp.cos(x), tag="intermediates", name="y")
    check(jnp.all(y <= 1.0), "y above one: {}", y)
    return jnp.sum(y * x)


def in_control_flow(xs):
    def body(carry, x):
        x = sow(x, tag="intermediates", name="x", mode="append")
        (x,) = log_p.bind(x * carry)
        check(x < 100.0, "x too large: {}", x)
        return carry + 1.0, x

    carry, ys = lax.scan(body, 1.0, xs)
    carry = lax.cond(carry > 2.0, lambda c: log_p.bind(c, branch="yes")[0], lambda c: c, carry)

    def while_body(state):
        i, total = state
        return i + 1, sow(total + i, tag="loop", name="total", mode="clobber")

    _, total = lax.while_loop(lambda state: state[0] < 3, while_body, (0, carry))
    return jax.checkpoint(lambda y: log_p.bind(jnp.tanh(y))[0])(ys) * total


def test_define_effect_primitives_export():
    x = jnp.linspace(-1.0, 1.0, 5)
    restored = assert_runs_like(with_defined_effects, x)
    names = {effect.name for effect in restored.unordered_effects}  # pyright: ignore[reportAttributeAccessIssue]
    assert names == {"export_log", "export_pair"}


def test_sow_and_check_export():
    x = jnp.arange(4.0)
    restored = assert_runs_like(with_sow_and_check, x)
    names = {effect.name for effect in restored.unordered_effects}  # pyright: ignore[reportAttributeAccessIssue]
    assert names == {"kups_sow", "kups_check"}


def test_effects_in_control_flow_export():
    assert_runs_like(in_control_flow, jnp.arange(1.0, 6.0))


def test_export_under_grad_and_vmap():
    x = jnp.linspace(0.1, 1.0, 3)
    assert_runs_like(jax.grad(with_sow_and_check), x)
    assert_runs_like(jax.vmap(with_defined_effects), jnp.stack([x, 2 * x]))


def test_exported_program_keeps_the_effect_inside_the_callers_jit():
    x = jnp.arange(3.0)
    restored = round_trip(with_defined_effects, x)
    jaxpr = jax.make_jaxpr(lambda x: restored.call(x) + 1.0)(x)
    assert set(jaxpr.effects) == set(restored.unordered_effects)


def test_same_named_effects_keep_their_own_types():
    first, second = define_effect("export_twin"), define_effect("export_twin")
    restored = round_trip(lambda x: second.bind(*first.bind(x)), jnp.ones(2))
    assert set(restored.unordered_effects) == {first.effect, second.effect}  # pyright: ignore[reportAttributeAccessIssue]
    assert first.effect != second.effect  # pyright: ignore[reportAttributeAccessIssue]


def test_a_fresh_process_deserializes_and_runs(tmp_path):
    x = jnp.arange(1.0, 6.0)
    (tmp_path / "program.bin").write_bytes(bytes(round_trip(in_control_flow, x).serialize()))
    np.save(tmp_path / "expected.npy", np.asarray(in_control_flow(x)))
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        import kups.checks, kups.harvest
        from kups.effects import define_effect

        # The process that deserializes defines the effects the program binds.
        define_effect("export_log")
        restored = jax.export.deserialize(bytearray(open("program.bin", "rb").read()))
        x = jnp.arange(1.0, 6.0)
        expected = np.load("expected.npy")
        np.testing.assert_array_equal(np.asarray(restored.call(x)), expected)
        np.testing.assert_array_equal(np.asarray(jax.jit(restored.call)(x)), expected)
        print("ok")
        """
    )
    result = run_in_a_fresh_process(script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_a_process_without_the_effect_says_which_is_missing(tmp_path):
    custom_p = define_effect("export_only_here")
    blob = round_trip(lambda x: custom_p.bind(x)[0], jnp.ones(2)).serialize()
    (tmp_path / "program.bin").write_bytes(bytes(blob))
    script = (
        "import jax, kups.effects\n"
        "jax.export.deserialize(bytearray(open('program.bin', 'rb').read()))\n"
    )
    result = run_in_a_fresh_process(script, tmp_path)
    assert result.returncode != 0
    assert "kups.effects.KupsEffect[export_only_here]" in result.stderr


@pytest.mark.parametrize("mode", ["strict", "append", "clobber"])
def test_sow_modes_export(mode):
    def fn(xs):
        return lax.fori_loop(0, 3, lambda i, c: sow(c * 1.5, tag="t", name="c", mode=mode), xs)

    assert_runs_like(fn, jnp.arange(3.0))


def test_jitted_reap_and_plant_export():
    from kups.harvest import plant, reap

    def fn(xs):
        def step(carry, x):
            y = sow(jnp.sin(x) * carry, tag="reaped", name="y", mode="append")
            # Another tag's sow stays in the exported program as an effect.
            return carry + sow(y, tag="other", name="z", mode="clobber"), y

        return lax.scan(step, 1.0, xs)

    xs = jnp.arange(4.0)
    reaped = assert_runs_like(jax.jit(reap(fn, tag="reaped")), xs)
    assert {effect.name for effect in reaped.unordered_effects} == {"kups_sow"}  # pyright: ignore[reportAttributeAccessIssue]
    assert_runs_like(jax.jit(plant(fn, tag="reaped")), {"y": jnp.ones(4)}, xs)


def test_effects_pickle_and_compiled_programs_serialize():
    import pickle

    from jax.experimental import serialize_executable

    assert pickle.loads(pickle.dumps(log_p.effect)) == log_p.effect  # pyright: ignore[reportAttributeAccessIssue]
    x = jnp.linspace(-1.0, 1.0, 5)
    compiled = jax.jit(with_sow_and_check).lower(x).compile()
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    # On a single device, as compiled (the default is every local device).
    loaded = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=jax.devices()[:1]
    )
    np.testing.assert_array_equal(loaded(x), compiled(x))


def test_unpickling_an_effect_not_defined_here_says_so(tmp_path):
    import pickle

    custom_p = define_effect("export_pickled_only_here")
    (tmp_path / "effect.pkl").write_bytes(pickle.dumps(custom_p.effect))  # pyright: ignore[reportAttributeAccessIssue]
    script = "import pickle, kups.effects\npickle.loads(open('effect.pkl', 'rb').read())\n"
    result = run_in_a_fresh_process(script, tmp_path)
    assert result.returncode != 0
    assert "KupsEffect[export_pickled_only_here] is not defined in this process" in result.stderr
    assert "define_effect" in result.stderr
