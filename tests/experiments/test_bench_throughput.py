import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}  # fake CPU devices, also on a GPU box
    command = [sys.executable, "-m", "experiments.bench_throughput", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_two_meshes_end_to_end(tmp_path):
    out = tmp_path / "throughput.json"
    result = _cli(
        "--batch_shapes=2x32", "--dtypes=float32", "--cpu_devices=2", "--mesh=data:1", "--mesh=fsdp:2",
        "--warmup=1", "--repeats=2", "--steps=1", f"--json_out={out}", "--config.model.remat=full", "--tokens=zipf",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["mesh"], c["devices"]) for c in cases] == [({"data": 1}, 1), ({"fsdp": 2}, 2)]
    for c in cases:
        assert c["tokens_per_second_min"] <= c["tokens_per_second"] <= c["tokens_per_second_max"]
        assert len(c["tokens_per_second_repeats"]) == 2
        assert 0 < c["mfu"] < 1
        assert c["mfu"] == pytest.approx(c["tokens_per_second"] * c["flops_per_token"] / c["peak_flops"])
        assert c["mfu_measured_matmul"] == pytest.approx(c["tokens_per_second"] * c["flops_per_token"] / c["matmul_flops"])
        assert c["peak_source"].startswith("measured matmul rate (cpu device")  # CPUs have no datasheet peak
        assert c["model_options"] == "remat=full"  # --config.* overrides reach every case
        assert c["tokens"] == "zipf"
    assert cases[1]["peak_flops"] == pytest.approx(2 * cases[0]["peak_flops"])  # the denominator scales with the mesh
    assert "| tiny | remat=full | 2x32 | float32 | fsdp:2 |" in result.stdout
    assert "MFU (peak) against the measured matmul rate (cpu device" in result.stdout


def test_bad_input_is_one_line_and_exit_2():
    result = _cli("--batch_shapes=8x128,8by128")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: batch shape '8by128' is not BATCHxSEQ_LEN, e.g. 8x128"]
