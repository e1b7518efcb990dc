"""Every `experiments` module imports beside every other in one process.

absl flags live in one global registry, so two scripts that define the same flag name at import
break any process (a test worker, a notebook) that imports both. Scripts with common flag names
(``workdir``, ``seed``, ...) define them in ``define_flags()``, called under ``__main__``.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_experiment_module_imports_in_one_process():
    modules = sorted(f"experiments.{p.stem}" for p in (REPO / "experiments").glob("*.py") if p.stem != "__init__")
    assert {"experiments.eval_lopt", "experiments.meta_train", "experiments.train"} <= set(modules)
    code = f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
