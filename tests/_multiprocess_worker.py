"""One process of the 2-process JAX cluster that `test_multiprocess.py` starts.

Not a test module (pytest collects `test_*.py` only). Run as
`python tests/_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT`: it joins the
cluster whose coordinator (process 0) listens on 127.0.0.1:PORT, builds a mesh
over the devices of every process, runs the interpreted programs, and prints one
line `RESULT {json}` with what this process sees.
"""

import os
import sys

# Before JAX is imported: two CPU devices in this process, whatever the parent's
# environment says (the test suite's conftest asks for eight).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kups.effects import (
    HandlerResult,
    Interpreter,
    default_dispatcher,
    default_primitive_handler,
    default_shard_map_handler,
    reinterpret,
)
from kups.harvest import reap, sow

SIZE = 16  # the global input: arange(16), four elements per device


def count_sin(interpreter, ctx, eqn, invals):
    """Counts the `sin` equations that ran, and sums their outputs."""
    (out,) = default_primitive_handler(interpreter, ctx, eqn, invals).outvals
    return HandlerResult({"count": ctx["count"] + 1, "total": ctx["total"] + jnp.sum(out)}, [out])


def psum_over(axis):
    return lambda ctx: jax.tree.map(lambda v: jax.lax.psum(v, axis), ctx)


def local(array):
    """This process's copy of a replicated array, or all of a sharded one."""
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def main():
    process_id, num_processes, port = map(int, sys.argv[1:4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    try:
        print(
            f"process {jax.process_index()}: {jax.local_device_count()} local devices of "
            f"{jax.device_count()}",
            file=sys.stderr,
            flush=True,
        )
        result = run()
    finally:
        jax.distributed.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def run():
    mesh = jax.make_mesh((jax.device_count(),), ("i",))
    data = np.arange(SIZE, dtype=np.float32)
    x = jax.make_array_from_callback((SIZE,), NamedSharding(mesh, P("i")), lambda idx: data[idx])

    def body(x_shard, sow=None):
        y = jnp.sin(x_shard)
        if sow is not None:
            y = sow(y, tag="shards", name="sin")
        # A collective in the body too: the program is not embarrassingly parallel.
        return y * jax.lax.psum(jnp.sum(y), "i")

    def program(x, sow=None):
        return jax.shard_map(
            functools.partial(body, sow=sow), mesh=mesh, in_specs=P("i"), out_specs=P("i")
        )(x)

    dispatcher = default_dispatcher()
    dispatcher.register_handler("sin", count_sin)
    dispatcher.register_handler(
        "shard_map", functools.partial(default_shard_map_handler, reduce_ctx=psum_over("i"))
    )
    counted = jax.jit(reinterpret(program, Interpreter(dispatcher)))
    ctx0 = {"count": jnp.int32(0), "total": jnp.float32(0.0)}
    out, ctx = counted(ctx0, x)
    result = {
        "process_index": jax.process_index(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "out": local(out).tolist(),
        "ctx": {name: local(value).item() for name, value in ctx.items()},
        "ctx_replicated": all(value.is_fully_replicated for value in ctx.values()),
    }
    reaped_out, sown = jax.jit(reap(functools.partial(program, sow=sow), tag="shards"))(x)
    result["reaped"] = {
        "out": local(reaped_out).tolist(),
        "sown": {name: local(value).tolist() for name, value in sown.items()},
    }
    return result


if __name__ == "__main__":
    main()
