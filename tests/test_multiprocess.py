"""kups on JAX's multi-controller runtime: two local processes, one global mesh.

The test starts two Python processes (`tests/_multiprocess_worker.py`) that form
a JAX cluster over 127.0.0.1 (`jax.distributed.initialize`, CPU collectives over
gloo), two CPU devices each. They build one 4-device mesh and run a jitted,
interpreted `shard_map` program whose context is reduced across all four devices
(`reduce_ctx` with `psum`), and a `reap` of a value sown in every shard. Both
processes must report the same context and values, and those must match NumPy.
Every process is bounded in time and killed on timeout, with its output shown.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT = 120  # seconds for the whole cluster, start-up included
SIZE = 16


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe(logs):
    return "\n".join(
        f"--- process {i} (exit {code}) stdout ---\n{out}\n--- process {i} stderr ---\n{err[-6000:]}"
        for i, (code, out, err) in enumerate(logs)
    )


def start_cluster(tmp_dir):
    """Runs the workers to completion (or kills them at the deadline).

    Returns `(timed_out, logs)` with `logs[i] = (returncode, stdout, stderr)`.
    Output goes to files, not pipes, so that a chatty worker cannot block on a
    full pipe while the test waits on the other one.
    """
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    procs, files = [], []
    try:
        for i in range(NUM_PROCESSES):
            out = open(tmp_dir / f"worker{i}.out", "w+")  # noqa: SIM115 - closed below
            err = open(tmp_dir / f"worker{i}.err", "w+")  # noqa: SIM115 - closed below
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port)],
                    stdout=out,
                    stderr=err,
                    env=env,
                    cwd=tmp_dir,
                )
            )
        deadline = time.monotonic() + TIMEOUT
        timed_out = False
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = []
    for proc, (out, err) in zip(procs, files, strict=True):
        out.seek(0)
        err.seek(0)
        logs.append((proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return timed_out, logs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The parsed `RESULT` line of every worker, and how long the cluster took."""
    start = time.monotonic()
    timed_out, logs = start_cluster(tmp_path_factory.mktemp("cluster"))
    if timed_out:
        pytest.fail(
            f"the {NUM_PROCESSES}-process cluster did not finish within {TIMEOUT} s; the "
            f"workers were killed.\n{describe(logs)}",
            pytrace=False,
        )
    results = []
    for i, (code, out, _) in enumerate(logs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if code != 0 or len(lines) != 1:
            pytest.fail(
                f"worker {i} exited with {code} without reporting a result.\n{describe(logs)}",
                pytrace=False,
            )
        results.append(json.loads(lines[0].removeprefix("RESULT ")))
    return results, time.monotonic() - start


def expected_output():
    data = np.arange(SIZE, dtype=np.float32)
    y = np.sin(data)
    return y, y * y.sum()


def test_every_process_sees_the_global_mesh(cluster):
    results, _ = cluster
    assert sorted(r["process_index"] for r in results) == list(range(NUM_PROCESSES))
    for r in results:
        assert r["device_count"] == NUM_PROCESSES * DEVICES_PER_PROCESS
        assert r["local_device_count"] == DEVICES_PER_PROCESS


def test_context_reduced_across_both_processes(cluster):
    results, _ = cluster
    sin_values, out = expected_output()
    first = results[0]
    for r in results:
        # The same context on both processes: one `sin` per shard, on all 4 shards,
        # and the sum of every shard's `sin` outputs.
        assert r["ctx"] == first["ctx"]
        assert r["ctx_replicated"]
        np.testing.assert_allclose(r["out"], out, rtol=1e-5)
    assert first["ctx"]["count"] == NUM_PROCESSES * DEVICES_PER_PROCESS
    np.testing.assert_allclose(first["ctx"]["total"], sin_values.sum(), rtol=1e-5)


def test_reap_across_both_processes(cluster):
    results, _ = cluster
    sin_values, out = expected_output()
    first = results[0]["reaped"]
    num_shards = NUM_PROCESSES * DEVICES_PER_PROCESS
    for r in results:
        assert r["reaped"] == first
    # One entry per shard along a new leading axis, in mesh order.
    np.testing.assert_allclose(first["sown"]["sin"], sin_values.reshape(num_shards, -1), rtol=1e-6)
    np.testing.assert_allclose(first["out"], out, rtol=1e-5)
