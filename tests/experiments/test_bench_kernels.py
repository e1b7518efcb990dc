"""experiments.bench_kernels at a tiny shape on CPU (Pallas in interpret mode): rows, checks, table, JSON."""

import json

import pytest
from absl import app

from experiments import bench_kernels
from kernels_pallas.gmm import Tiling


@pytest.mark.usefixtures("fast_xla_compile")
def test_tiny_cpu_run_times_checks_and_tabulates():
    rows = bench_kernels.bench([(1, 40, 2, 32)], ["pallas", "cudnn", "xla"], ["fwd", "fwd_bwd"], dtype="float32", warmup=0, iters=2)
    by = {(r["implementation"], r["mode"]): r for r in rows}
    assert len(rows) == 6
    assert "NVIDIA GPU" in by["cudnn", "fwd"]["unavailable"]
    for mode in ("fwd", "fwd_bwd"):
        ours = by["pallas", mode]
        assert ours["ms_min"] <= ours["ms"] and ours["tflops"] > 0
        assert ours["max_err"] < 2e-5  # float32, against the xla row's output or gradients
        assert by["xla", mode]["max_err"] == 0 and ours["vs_cudnn"] is None
    assert by["pallas", "fwd_bwd"]["tflops"] == pytest.approx(
        bench_kernels.attention_flops((1, 40, 2, 32), "fwd_bwd") / by["pallas", "fwd_bwd"]["ms"] / 1e9
    )
    table = bench_kernels.format_table(rows)
    assert "| 1x40x2x32 | pallas | fwd_bwd |" in table and "not run: cuDNN needs an NVIDIA GPU" in table
    json.dumps(rows)


def test_shapes_are_checked():
    assert bench_kernels.parse_shape("16x1024x12x64") == (16, 1024, 12, 64)
    with pytest.raises(app.UsageError, match="BATCHxSEQxHEADSxHEAD_DIM"):
        bench_kernels.parse_shape("16x1024x12")
    assert bench_kernels.attention_flops((1, 2, 1, 1), "fwd") == 8  # 4 B H T^2 D, halved by the causal mask


@pytest.mark.usefixtures("fast_xla_compile")
def test_tiny_cpu_gmm_rows_check_against_ragged_dot():
    rows = bench_kernels.bench_gmm([(3, 40, 16, 16)], ["fwd"], dtype="float32", warmup=0, iters=1, tiling=Tiling(16, 16, 16))
    by = {r["implementation"]: r for r in rows}
    assert set(by) == {"pallas", "ragged_dot"}
    assert by["pallas"]["max_err"] < 1e-4 and by["ragged_dot"]["max_err"] == 0
    assert by["pallas"]["tflops"] == pytest.approx(2 * 40 * 16 * 16 / by["pallas"]["ms"] / 1e9)
    assert "| 3x40x16x16 | pallas | fwd |" in bench_kernels.format_gmm_table(rows)
