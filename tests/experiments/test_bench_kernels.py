"""experiments.bench_kernels at a tiny shape on CPU (Pallas in interpret mode): rows, checks, table, JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from experiments import bench_kernels, cli
from kernels_pallas.gmm import Tiling

# What these rows assert is CPU behaviour (interpret-mode kernels, no cuDNN, no quantized-update kernel).
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts the CPU rows; an accelerator runs the kernels compiled")


@cpu_only
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
    with pytest.raises(cli.UsageError, match="BATCHxSEQxHEADSxHEAD_DIM"):
        bench_kernels.parse_shape("16x1024x12")
    assert bench_kernels.attention_flops((1, 2, 1, 1), "fwd") == 8  # 4 B H T^2 D, halved by the causal mask


@cpu_only
def test_quantized_update_section_rows_on_cpu():
    from experiments import bench_quantized_update as bq

    rows = bq.bench([(2, 32, 64)], ["fp32", "8bit_xla", "8bit_pallas"], warmup=0, iters=1)
    by = {r["variant"]: r for r in rows}
    assert "no quantized-update kernel on cpu" in by["8bit_pallas"]["unavailable"]
    assert by["fp32"]["bytes_per_param"] == 28 and by["fp32"]["vs_fp32"] == 1.0
    assert by["8bit_xla"]["bytes_per_param"] == pytest.approx(16 + 16 / 256)
    assert bq.bytes_per_param("4bit_xla", (32, 64)) == pytest.approx(12 + 2 * (0.5 + 4 / 128) + 2 * (0.5 + 4 / 64 + 4 / 32))
    assert by["8bit_xla"]["gb_per_s"] > 0
    assert "| 8bit_pallas | 4,096 | not run" in bq.format_table(rows)
    json.dumps(rows)


@cpu_only
def test_tiny_cpu_gmm_rows_check_against_ragged_dot():
    rows = bench_kernels.bench_gmm(
        [(3, 40, 16, 16)], ["fwd"], dtype="float32", warmup=0, iters=1, tiling=Tiling(16, 16, 16), implementations=["pallas", "ragged_dot"]
    )  # fmt: skip
    by = {r["implementation"]: r for r in rows}
    assert set(by) == {"pallas", "ragged_dot"}
    assert by["pallas"]["max_err"] < 1e-4 and by["ragged_dot"]["max_err"] == 0
    assert by["pallas"]["tflops"] == pytest.approx(2 * 40 * 16 * 16 / by["pallas"]["ms"] / 1e9)
    assert "| 3x40x16x16 | pallas | fwd |" in bench_kernels.format_gmm_table(rows)


def test_cli_runs_the_chosen_sections_and_writes_json(tmp_path):
    out = tmp_path / "kernels.json"
    args = [
        sys.executable, "-m", "experiments.bench_kernels", "--sections=attention,gmm", "--shapes=1x40x2x32",
        "--implementations=pallas,xla", "--modes=fwd", "--dtype=float32", "--warmup=0", "--iters=1",
        "--gmm_shapes=2x40x16x16", "--gmm_implementations=pallas,ragged_dot", "--gmm_block_m=16", "--gmm_block_k=16", "--gmm_block_n=16", f"--json_out={out}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["implementation"], r["mode"]) for r in data["rows"]] == [("pallas", "fwd"), ("xla", "fwd")]
    assert {r["implementation"] for r in data["gmm_rows"]} == {"pallas", "ragged_dot"}
    assert "quantized_update_rows" not in data
    assert "attention" in result.stdout and "grouped matmul" in result.stdout
    bad = subprocess.run([*args[:3], "--sections=attn"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unknown section(s) ['attn']" in bad.stderr
