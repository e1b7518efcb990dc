"""experiments.eval_lopt's protocol on a toy task: grid on seed 0, tuned and default AdamW, the table."""

from experiments import eval_lopt, lopt_tasks
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
