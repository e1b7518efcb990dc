"""The quickstart notebook runs top to bottom on CPU, so it cannot rot."""

import os
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_executes_and_trains(tmp_path, monkeypatch):
    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()

    text = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    finals = {name: float(v) for name, v in re.findall(r"(adamw|muon)\s+final val loss (\d+\.\d+)", text)}
    assert set(finals) == {"adamw", "muon"} and all(1.0 < v < 4.0 for v in finals.values()), text
    own_loop = [float(v) for v in re.findall(r"step +\d+ loss (\d+\.\d+)", text)]
    assert len(own_loop) == 5 and own_loop[-1] < own_loop[0] - 0.5, own_loop
    # Both loss plots are shown: importing the trainer leaves the kernel's inline backend alone (it once
    # switched the process to Agg, and `plt.show()` showed nothing).
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 2, [cell.get("outputs") for cell in nb.cells if "plt.show()" in cell.source]
