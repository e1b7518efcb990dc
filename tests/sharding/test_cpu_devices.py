"""`sharding.cpu_devices`: a host split into devices whose collectives each get a channel of their own."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from sharding import cpu_devices

REPO = Path(__file__).resolve().parents[2]


def _two_independent_permutes(x):
    """Two collective-permutes that no data orders: ring attention's K/V and dK/dV hops have this shape."""
    n = jax.lax.axis_size("ring")
    hop = [(i, (i + 1) % n) for i in range(n)]
    return jax.lax.ppermute(x, "ring", hop) + jax.lax.ppermute(2 * x, "ring", hop)


@pytest.mark.devices(8)
def test_every_collective_of_a_module_gets_its_own_channel():
    """jax alone numbers both permutes' channel 1 (`mlir.COLLECTIVE_CHANNEL_ID`), which XLA:CPU's rendezvous
    can mix up; with the fix (installed by `use`, as the conftest does) they are 16384 and 16385."""
    if jax.default_backend() != "cpu":
        pytest.skip("the fix is for XLA:CPU's in-process collectives")
    mesh = jax.make_mesh((8,), ("ring",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(_two_independent_permutes, mesh=mesh, in_specs=P("ring"), out_specs=P("ring")))
    text = f.lower(jnp.arange(8.0)).as_text()
    handles = [int(h) for h in re.findall(r"channel_handle<handle = (\d+)", text)]
    assert sorted(handles) == [16384, 16385], handles
    assert cpu_devices.install_channel_fix()  # idempotent: installed once, reports it


def test_use_splits_the_cpu_with_room_for_collectives_in_flight(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"} | {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    script = "import os, jax; from sharding import cpu_devices; cpu_devices.use(4); print(jax.device_count(), os.environ['PJRT_NPROC'])"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["4", str(max(os.cpu_count() or 1, 32))]
    with pytest.raises(ValueError, match="at least 1"):
        cpu_devices.use(0)
