"""experiments/accelerator_checks.sh: the GPU runbook, run against a stand-in ``python3`` that records its
calls (the commands themselves run at CPU sizes by hand, see its header; each script has its own tests)."""

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "accelerator_checks.sh"
SECTIONS = ("kernels", "step", "attention", "optimizers", "optimizers_soap", "optimizer_cycles")
# Records each call with PYTHONPATH; fails the muon row; writes the JSON a benchmark was asked for.
FAKE_PYTHON = """#!/bin/bash
echo "PYTHONPATH=${PYTHONPATH:-} $*" >> "$CALLS"
case "$*" in *--optimizers=muon*) exit 1 ;; esac
for arg in "$@"; do case "$arg" in --json_out=*|--out=*) echo '{}' > "${arg#*=}" ;; esac; done
"""


def _run(section, tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {"OUT": str(out), "PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls.txt"), **env}
    result = subprocess.run(["bash", str(SCRIPT), section], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    return result, out


def test_script_parses_and_refuses_an_unknown_section(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0
    result, out = _run("gpu", tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr and "|".join(SECTIONS) in result.stderr
    assert not (out / "failed.txt").exists()


@pytest.mark.parametrize("section", SECTIONS)
def test_each_command_has_its_timeout_within_the_call_and_at_most_8_files_come_back(section, tmp_path):
    result, out = _run(section, tmp_path, DRY_RUN="1")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines, result.stderr
    limits = [int(re.search(r": timeout (\d+) (env \S+ )?python3 ", line).group(1)) for line in lines]
    assert sum(limits) <= 560
    outputs = [m for line in lines for m in re.findall(r"--(?:json_out|out)=(\S+)", line)]
    assert len(outputs) == len(set(outputs)) and all(Path(o).parent == out for o in outputs)
    assert len(outputs) + 2 <= 8  # + log.txt and failed.txt


def test_wheels_are_installed_and_a_failing_case_loses_no_other(tmp_path):
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "ml_collections-1.0-py3-none-any.whl").write_text("")
    result, out = _run("optimizers", tmp_path)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[0].startswith("PYTHONPATH= -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/")
    assert all(c.startswith(f"PYTHONPATH=/tmp/site:{tmp_path} -m experiments.bench_optimizer_step") for c in calls[1:])
    assert (out / "failed.txt").read_text() == "optimizer_muon exit 1\n"
    assert sorted(os.listdir(out)) == ["failed.txt", "log.txt", "optimizer_adamw.json", "optimizer_mars_muon.json", "optimizer_normuon.json"]
