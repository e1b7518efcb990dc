"""What the machine can do: datasheet and measured matmul throughput (MFU denominators), peak memory."""

from __future__ import annotations

import functools
import resource
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp


def _matmul_setup(platform: str) -> tuple[int, jnp.dtype]:
    return (1024, jnp.float32) if platform == "cpu" else (8192, jnp.bfloat16)


def measure_matmul_flops(device: jax.Device, repeats: int = 5, calls: int = 10) -> float:
    """Best-of-``repeats`` FLOP/s of a square matmul of random inputs on ``device`` (fp32 on CPU, bf16 elsewhere).

    A sample is ``calls`` matmuls issued back to back and waited for once, so dispatch latency does not
    count against the device; random inputs, because a GPU draws less power (and clocks higher) on
    constant ones. Runs on a one-device mesh of its own, so a caller's context mesh (a training loop's)
    does not apply.
    """
    n, dtype = _matmul_setup(device.platform)
    own_mesh = jax.make_mesh((1,), ("device",), devices=[device], axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(own_mesh):
        a, b = (jax.device_put(jax.random.normal(key, (n, n), dtype), device) for key in jax.random.split(jax.random.key(0)))
        f = jax.jit(jnp.matmul)
        f(a, b).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                out = f(a, b)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - start) / calls)
    return 2.0 * n**3 / best


@functools.cache
def matmul_flops_per_device() -> float:
    """The matmul rate of the first local device, measured once per process.

    Not kept on disk: a rate measured while the machine was busy (a CPU shared with other jobs) would
    stay the denominator of every later run's MFU (a CPU run once read 236%: 18 GFLOP/s cached, 56 measured).
    On a CPU the sample is 12 products of 1024 x 1024 (about 0.4 s at 56 GFLOP/s).
    """
    device = jax.local_devices()[0]
    return measure_matmul_flops(device, repeats=3, calls=4) if device.platform == "cpu" else measure_matmul_flops(device)


# Dense (no structured sparsity) matmul peak of one chip, FLOP/s, keyed by `jax.Device.device_kind`.
# "float32" is the rate of float32 matmuls at JAX's default precision, which runs them on TF32
# tensor cores on NVIDIA GPUs and as one bfloat16 pass on TPUs (docs.jax.dev/en/latest/201/precision.html).
# Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5, PCIe, NVL columns; its BF16 and TF32 figures
# are "with sparsity", halved here), NVIDIA H200 Tensor Core GPU datasheet (SXM, NVL), NVIDIA A100
# Tensor Core GPU datasheet (BF16 312, TF32 156 dense), Google Cloud TPU system-architecture pages
# (v4 275, v5e 197, v5p 459, v6e 918 bf16 TFLOP/s per chip).
_H100_SXM = {"bfloat16": 989e12, "float32": 494.5e12}
_H100_PCIE = {"bfloat16": 756e12, "float32": 378e12}
_NVL = {"bfloat16": 835.5e12, "float32": 417.5e12}  # H100 NVL and H200 NVL
_A100 = {"bfloat16": 312e12, "float32": 156e12}


def _tpu(bf16: float) -> dict[str, float]:
    return {"bfloat16": bf16, "float32": bf16}


DATASHEET_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H100 NVL": _NVL,
    "NVIDIA H200": _H100_SXM,  # the H200 SXM has the H100 SXM's compute
    "NVIDIA H200 NVL": _NVL,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "TPU v4": _tpu(275e12),
    "TPU v5 lite": _tpu(197e12),  # v5e
    "TPU v5": _tpu(459e12),  # v5p
    "TPU v5p": _tpu(459e12),
    "TPU v6 lite": _tpu(918e12),  # v6e (Trillium)
}


class PeakFlops(NamedTuple):
    """One device's matmul peak, FLOP/s, and where the figure comes from."""

    flops_per_second: float
    source: str


def peak_flops_per_device(dtype: str, device: jax.Device | None = None) -> PeakFlops:
    """The datasheet dense peak of ``device`` (default: the first local one) for compute ``dtype``.

    A device kind the table does not list falls back to the measured matmul rate
    (`matmul_flops_per_device`), and the source says so.
    """
    device = device or jax.local_devices()[0]
    peak = DATASHEET_PEAK_FLOPS.get(device.device_kind, {}).get(jnp.dtype(dtype).name)
    if peak is not None:
        return PeakFlops(peak, f"datasheet {dtype} peak of {device.device_kind}")
    return PeakFlops(
        matmul_flops_per_device(),
        f"measured matmul rate ({device.platform} device {device.device_kind!r} has no datasheet peak in experiments/hardware.py)",
    )


def peak_memory_bytes() -> tuple[int, str]:
    """Peak bytes in use on the first local device, or the host's peak RSS where devices do not say."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "host_rss"
