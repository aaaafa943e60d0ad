"""A smoke test of an installed kups: `python wheel_smoke.py [VERSION]`.

`.ci/wheel` runs it with the built wheel's venv, from a temporary directory; with
VERSION it also checks that `kups` is the installed distribution of that version
(not a source tree). tests/test_packaging.py runs it against the source tree.
Every value is checked against plain JAX.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import kups
from kups.checks import check, checked
from kups.effects import HandlerResult, Interpreter, default_dispatcher, reinterpret
from kups.effects.handlers import default_primitive_handler
from kups.harvest import plant, reap, sow
from kups.instrument import count_primitives

if len(sys.argv) > 1:
    installed = Path(kups.__file__).resolve()
    assert installed.is_relative_to(Path(sys.prefix).resolve()), (
        f"kups imported from {installed}, not from the venv at {sys.prefix}"
    )
    assert kups.__version__ == sys.argv[1], (kups.__version__, sys.argv[1])
    assert (installed.parent / "py.typed").is_file(), "py.typed is not shipped"


def plain_step(carry, x):
    y = jnp.sin(x) * carry
    return carry + y, y


@jax.jit
def program(xs):
    def step(carry, x):
        y = sow(jnp.sin(x) * carry, tag="smoke", name="y", mode="append")
        check(jnp.isfinite(y), "y is not finite at x={}", x)
        return carry + y, y

    return lax.scan(step, 1.0, xs)


xs = jnp.arange(6.0)
expected = jax.jit(lambda xs: lax.scan(plain_step, 1.0, xs))(xs)


def same(got, want):
    # Within float32 rounding: interpreting changes how XLA fuses the scan body.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)


# A handler of one's own: count the sins in the jitted scan.
def count_sin(interpreter, ctx, eqn, invals):
    _, outvals = default_primitive_handler(interpreter, ctx, eqn, invals)
    return HandlerResult(ctx + 1, outvals)


out, n_sin = reinterpret(
    program, Interpreter(default_dispatcher().register_handler("sin", count_sin))
)(jnp.int32(0), xs)
same(out, expected)
assert int(n_sin) == 6, n_sin

out, reaped = jax.jit(reap(program, tag="smoke"))(xs)
same(out, expected)
same(reaped["y"], expected[1])

planted = plant(program, tag="smoke")({"y": jnp.zeros(6)}, xs)
same(planted, (jnp.float32(1.0), jnp.zeros(6)))

out, counts = count_primitives(program)(xs)
same(out, expected)
assert counts["sin"] == 6 and counts["mul"] >= 6, counts

out, error = checked(program)(xs)
same(out, expected)
assert error.get() is None, error.get()

print(f"kups {kups.__version__} from {Path(kups.__file__).parent}: smoke test passed")
