"""kups benchmarks: every figure a ratio against a baseline measured in the same run.

Run them all with `python -m benchmarks` (or `python -m benchmarks --quick` for a
smoke run); see `benchmarks/RESULTS.md` for the figures and how each was measured.

Importing this package gives JAX eight CPU devices (the `shard_map` programs use
them), which only works before JAX is first imported: that is why it is done
here, where every `benchmarks.*` module passes first.
"""

import os

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
