"""What the machine can do: measured matmul throughput (the MFU denominator) and peak memory."""

from __future__ import annotations

import json
import resource
import time

import jax
import jax.numpy as jnp

from lm.corpus import default_cache_dir


def _matmul_setup(platform: str) -> tuple[int, jnp.dtype]:
    return (1024, jnp.float32) if platform == "cpu" else (8192, jnp.bfloat16)


def measure_matmul_flops(device: jax.Device, repeats: int = 5) -> float:
    """Best-of-``repeats`` FLOP/s of a square matmul on ``device`` (fp32 on CPU, bf16 elsewhere)."""
    n, dtype = _matmul_setup(device.platform)
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def matmul_flops_per_device() -> float:
    """Measured once per device kind and cached under the spmdlab cache directory."""
    device = jax.local_devices()[0]
    n, dtype = _matmul_setup(device.platform)
    key = f"{device.platform}|{device.device_kind}|{n}|{jnp.dtype(dtype).name}"
    path = default_cache_dir() / "matmul_flops.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key not in cache:
        cache[key] = measure_matmul_flops(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1))
    return float(cache[key])


def peak_memory_bytes() -> tuple[int, str]:
    """Peak bytes in use on the first local device, or the host's peak RSS where devices do not say."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "host_rss"
