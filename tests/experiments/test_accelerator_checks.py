"""experiments/accelerator_checks.sh: the GPU runbook parses and names its sections (its commands are run
at CPU sizes by hand, see its header; each one's script has its own tests)."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "accelerator_checks.sh"


def test_script_parses_and_refuses_an_unknown_section(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0
    result = subprocess.run(["bash", str(SCRIPT), "gpu"], capture_output=True, text=True, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "usage:" in result.stderr and "kernels|step|attention|optimizers" in result.stderr
    assert not (tmp_path / "failed.txt").exists()
