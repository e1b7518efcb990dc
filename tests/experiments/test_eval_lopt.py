"""experiments.eval_lopt's protocol on a toy task: grid on seed 0, tuned and default AdamW, the table."""

import json

import pytest

from experiments import cli, eval_lopt, lopt_tasks
from optim.learned import mlp_lopt


def test_lopt_against_adamw_default_and_tuned_on_a_toy_task():
    task = lopt_tasks.mlp_task("mlp_regression", d_in=2, width=4, depth=1, d_out=1, batch=8)
    meta = mlp_lopt.load_meta_params(mlp_lopt.weights_path("mulo"))
    runs = eval_lopt.evaluate_task(task, meta, steps=5, seeds=2, grid=[1e-3, 1e-2], mup_base_fan_in=16)
    assert set(runs) == {"lopt", "adamw-default", "adamw-tuned", "adamw-grid"}
    grid = runs["adamw-grid"]
    assert set(grid) == {"0.001", "0.003", "0.01"}  # the registry's default rate joins the grid
    tuned = min(grid, key=grid.get)
    assert runs["adamw-tuned"]["setting"] == f"lr={tuned}" and runs["adamw-tuned"]["finals"][0] == grid[tuned]
    assert runs["adamw-default"]["finals"][0] == grid["0.003"]
    for name in ("lopt", "adamw-default", "adamw-tuned"):
        assert len(runs[name]["finals"]) == 2 and len(runs[name]["curve"]) == 5
    row = eval_lopt.table({task.name: runs}).splitlines()[-1]
    assert row.startswith(f"| {task.name} |") and row.count("%") == 2


def test_counts_and_a_grid_that_cannot_run_are_named():
    task = lopt_tasks.family("mlp_regression")[0]
    for counts, message in (({"steps": 0, "seeds": 2}, "--steps=0 must be >= 1"), ({"steps": 5, "seeds": 0}, "--seeds=0 must be >= 1")):
        with pytest.raises(cli.UsageError, match=message):  # were a jax error and an IndexError
            eval_lopt.evaluate_task(task, None, grid=[1e-3], **counts)
    assert eval_lopt.learning_rates(["1e-3", "0.01"]) == [1e-3, 0.01]
    with pytest.raises(cli.UsageError, match="--adamw_grid=1e-3,fast is not a comma-separated list of numbers"):
        eval_lopt.learning_rates(["1e-3", "fast"])
    with pytest.raises(cli.UsageError, match="learning rates must be > 0"):
        eval_lopt.learning_rates(["-1e-3"])


def test_a_rerun_reads_the_results_of_its_settings_and_refuses_to_overwrite_others(tmp_path):
    """Was: every rerun wrote over results.json, whose record did not even name the tasks or the grid."""
    record = {"tasks": "lm-w16-d1", "steps": 200, "seeds": 2, "adamw_grid": ["1e-3", "3e-3"], "weights": "mulo.npz", "weights_record": {"n0": 16}}
    assert eval_lopt.earlier_results(tmp_path, record) is None
    (tmp_path / "results.json").write_text(json.dumps({"config": record, "results": {"lm-w16-d1": {"lopt": {}}}}))
    assert eval_lopt.earlier_results(tmp_path, record) == {"lm-w16-d1": {"lopt": {}}}
    with pytest.raises(cli.UsageError, match=r"holds results of other settings \(steps: 200 -> 100, tasks: lm-w16-d1 -> lm-w64-d1\); give a fresh"):
        eval_lopt.earlier_results(tmp_path, record | {"steps": 100, "tasks": "lm-w64-d1"})
