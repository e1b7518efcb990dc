from typing import NamedTuple

import jax
import pytest

from experiments import hardware


class FakeDevice(NamedTuple):
    platform: str
    device_kind: str


@pytest.mark.parametrize(
    "kind, bf16, fp32",
    [
        ("NVIDIA H100 80GB HBM3", 989e12, 494.5e12),  # H100 SXM: datasheet 1,979 / 989 TFLOP/s with sparsity
        ("NVIDIA H200", 989e12, 494.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 156e12),
        ("TPU v4", 275e12, 275e12),  # TPUs run float32 matmuls as one bfloat16 pass by default
        ("TPU v5 lite", 197e12, 197e12),
        ("TPU v5", 459e12, 459e12),
        ("TPU v6 lite", 918e12, 918e12),
    ],
)
def test_known_devices_get_their_datasheet_dense_peak(kind, bf16, fp32, monkeypatch):
    monkeypatch.setattr(hardware, "matmul_flops_per_device", lambda: pytest.fail("a known device must not be measured"))
    device = FakeDevice("gpu" if kind.startswith("NVIDIA") else "tpu", kind)
    peak = hardware.peak_flops_per_device("bfloat16", device)
    assert peak.flops_per_second == bf16 and peak.source == f"datasheet bfloat16 peak of {kind}"
    assert hardware.peak_flops_per_device("float32", device).flops_per_second == fp32


def test_unknown_devices_fall_back_to_the_measured_matmul_rate_and_say_so(monkeypatch):
    monkeypatch.setattr(hardware, "matmul_flops_per_device", lambda: 1.5e12)
    peak = hardware.peak_flops_per_device("bfloat16", FakeDevice("gpu", "NVIDIA GeForce RTX 9999"))
    assert peak.flops_per_second == 1.5e12
    assert "measured matmul rate" in peak.source and "'NVIDIA GeForce RTX 9999' has no datasheet peak" in peak.source
    cpu = hardware.peak_flops_per_device("float32", FakeDevice("cpu", "cpu"))
    assert cpu.flops_per_second == 1.5e12 and "measured matmul rate (cpu device" in cpu.source


def test_matmul_rate_is_measured_inside_a_training_loops_mesh():
    """A fresh machine has no cached rate: the first run measures it under its own one-device mesh."""
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        assert hardware.measure_matmul_flops(jax.local_devices()[0], repeats=1, calls=1) > 0


def test_matmul_rate_times_back_to_back_calls_of_random_inputs(monkeypatch):
    """Two timer reads per sample of several calls (not per call), on inputs that are not constant."""
    reads, placed = [], []
    real_clock, real_put = hardware.time.perf_counter, hardware.jax.device_put
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: reads.append(1) or real_clock())
    monkeypatch.setattr(hardware.jax, "device_put", lambda x, d: placed.append(x) or real_put(x, d))
    assert hardware.measure_matmul_flops(jax.local_devices()[0], repeats=2, calls=3) > 0
    assert len(reads) == 2 * 2
    assert len(placed) == 2 and all(float(jax.numpy.std(x)) > 0.5 for x in placed)


def test_matmul_rate_is_measured_once_per_process_and_not_kept_on_disk(monkeypatch, tmp_path):
    """A rate sampled while the machine was busy must not become every later run's MFU denominator."""
    monkeypatch.setenv("SPMDLAB_CACHE", str(tmp_path))
    samples = []
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, **kwargs: samples.append(device) or 5e10)
    hardware.matmul_flops_per_device.cache_clear()
    try:
        assert hardware.matmul_flops_per_device() == hardware.matmul_flops_per_device() == 5e10
    finally:
        hardware.matmul_flops_per_device.cache_clear()
    assert samples == [jax.local_devices()[0]] and not list(tmp_path.iterdir())
