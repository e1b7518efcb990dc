import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_tiny_tree_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    flags = ["--optimizers=adamw,sgd,lion", "--trees=tiny", "--repeats=2", f"--out={out}"]
    command = [sys.executable, "-m", "experiments.bench_optimizer_step", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["trees"]["tiny"]
    assert list(rows) == ["adamw", "sgd", "lion"]
    assert rows["adamw"]["vs_adamw"] == 1.0 and rows["sgd"]["ms"] > 0
    # AdamW keeps two fp32 moments per parameter, SGD (momentum) and Lion one.
    assert rows["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=1e-3)
    assert rows["sgd"]["state_bytes_per_param"] == pytest.approx(4.0, abs=1e-3)
    assert rows["lion"]["state_bytes_per_param"] == pytest.approx(4.0, abs=1e-3)
    assert "B/param" in result.stdout
