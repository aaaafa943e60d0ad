"""`nest`: putting the names a function sows under a scope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend.core import JaxprEqn

from kups.effects import (
    HandlerResult,
    Interpreter,
    InterpreterPolicy,
    check_policy,
    default_dispatcher,
    reinterpret,
    wraps_with_leading,
)

from ._sow import sow_p


def nest(
    fn: Callable[..., Any], *, scope: str, policy: InterpreterPolicy = InterpreterPolicy.RAISE
) -> Callable[..., Any]:
    """Wraps `fn` so that the names it sows (of every tag) live in `scope`.

    `reap` returns them as `reaped[scope][name]` and `plant` takes them as
    `values[scope][name]`, so two calls of one function can sow the same names
    without clashing. Nesting composes: `nest(nest(f, scope="a"), scope="b")`
    sows into `reaped["b"]["a"]`. Outside `reap`/`plant`, the wrapped function
    is `fn`; it works through every control-flow primitive like `sow` itself.

    **Arguments:**

    - `fn`: the function whose sows to scope. Its arguments that are not arrays
      are static.
    - `scope`: a non-empty string, the key of the scope in the result. It must
      not also be a name sown next to it.
    - `policy`: for a control-flow primitive kups has no handler for, with a
      sow inside, as for `reap` (a sow inside one run unchanged keeps its
      unscoped name).

    **Returns:**

    `wrapped(*args, **kwargs) -> out`, the same output as `fn`.

    !!! Example

        ```python
        import jax.numpy as jnp
        from kups.harvest import nest, plant, reap, sow


        def layer(x):
            return sow(jnp.tanh(x), tag="activations", name="out")


        def model(x):
            return nest(layer, scope="second")(nest(layer, scope="first")(x))


        out, sown = reap(model, tag="activations")(0.5)
        assert sown["first"]["out"] == jnp.tanh(0.5)
        assert sown["second"]["out"] == out
        assert plant(model, tag="activations")({"second": {"out": 7.0}}, 0.5) == 7.0
        ```
    """
    if not isinstance(scope, str) or not scope:
        raise TypeError(f"nest(fn, scope=...) needs a non-empty string scope, got {scope!r}.")
    if not callable(fn):
        raise TypeError(f"nest(fn, scope=...) needs a callable fn, got {type(fn).__name__}.")
    check_policy(policy, "nest(fn, policy=...)")

    def rescope(
        interpreter: Interpreter, ctx: Any, eqn: JaxprEqn, invals: list[Any]
    ) -> HandlerResult:
        del interpreter
        params = eqn.params
        return HandlerResult(
            ctx, list(sow_p.bind(*invals, **{**params, "scope": (scope, *params["scope"])}))
        )

    @wraps_with_leading(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        dispatcher = default_dispatcher().register_handler(sow_p, rescope)
        interpreter = Interpreter(
            dispatcher,
            policy=policy,
            label=f"kups.harvest.nest(scope={scope!r})",
            policy_hint="nest(fn, policy=...)",
        )
        out, _ = reinterpret(fn, interpreter)((), *args, **kwargs)
        return out

    return wrapped
