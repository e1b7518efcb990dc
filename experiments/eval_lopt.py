r"""Evaluates the shipped learned optimizer on held-out tasks against AdamW, default and tuned.

    python -m experiments.eval_lopt --workdir=runs/eval_lopt --steps=200

Held-out tasks (`experiments.lopt_tasks`, instances drawn from task keys that meta-training never
uses): by default the meta-training family's tiny LM (``lm-w16-d1``), a 4x wider one (``lm-w64-d1``)
and a 3x deeper one (``lm-w16-d3``). Per task, with the protocol of `experiments.compare_optimizers`
(grid on seed 0, the best setting by final loss, then seeds ``1 .. seeds - 1``):

- ``lopt``: the shipped weights (``--weights``, e.g. ``mulo`` for μLO's, whose base width comes from
  their record), no tuning (learning-rate multiplier 1, its own time features for the run's length);
- ``adamw-default``: the registry's AdamW at its default learning rate and hyperparameters, cosine
  decay to 10% as in training runs;
- ``adamw-tuned``: the same AdamW, the learning rate picked from ``--adamw_grid`` on seed 0.

The *final loss* of a run is its mean loss on `EVAL_BATCHES` fresh batches after the last step.
Writes ``results.json`` (settings, final losses per seed, curves), ``results.md`` (the table) and
``curves.png`` (training loss, smoothed, seed 0). A rerun into a workdir that holds results prints them
when its settings are the same and is refused when they differ; nothing is overwritten.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from matplotlib.figure import Figure

from experiments import cli, lopt_tasks
from optim import labels, spec
from optim.adamw import AdamW
from optim.learned import mlp_lopt

EVAL_BATCHES = 8
EVAL_SEED_OFFSET = 10_000  # task keys jax.random.key(10_000 + seed): never drawn by meta-training's key chain


def adamw(learning_rate: jax.Array, steps: int) -> optax.GradientTransformation:
    """The registry's AdamW (its default b1, b2, eps, weight decay) on a cosine decay to 10%."""
    defaults = spec.defaults(AdamW)
    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.1)
    return optax.adamw(schedule, b1=defaults["b1"], b2=defaults["b2"], eps=defaults["eps"],
                       weight_decay=defaults["weight_decay"], mask=labels.decay_mask)


@functools.cache
def _runner(task: lopt_tasks.Task, make_tx: Callable[[jax.Array], optax.GradientTransformation], steps: int) -> Callable:
    """One compiled run per task and optimizer kind; the learning rate and task key are its arguments."""

    @jax.jit
    def run(task_key, learning_rate):
        tx = make_tx(learning_rate)
        params = task.init(task_key)

        def step(carry, i):
            params, state = carry
            loss, grads = jax.value_and_grad(task.loss)(params, task_key, i)
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
        fresh = jax.vmap(lambda i: task.loss(params, task_key, i))(steps + 1 + jnp.arange(EVAL_BATCHES))
        return losses, jnp.mean(fresh)

    return run


def train(task: lopt_tasks.Task, make_tx: Callable, learning_rate: float, steps: int, seed: int) -> tuple[list[float], float]:
    """``(training losses per step, final loss on fresh batches)`` of ``make_tx(learning_rate)`` on instance ``seed``."""
    run = _runner(task, make_tx, steps)
    losses, final = run(jax.random.key(EVAL_SEED_OFFSET + seed), jnp.float32(learning_rate))
    final = float(final)
    return [float(x) for x in losses], final if np.isfinite(final) else float("inf")


def _lopt(meta: Any, steps: int, mup_base_fan_in: int, learning_rate: jax.Array) -> optax.GradientTransformation:
    return optax.chain(mlp_lopt.scale_by_mlp_lopt(meta, steps, mup_base_fan_in=mup_base_fan_in), optax.scale(learning_rate))


def evaluate_task(
    task: lopt_tasks.Task, meta: Any, *, steps: int, seeds: int, grid: list[float], mup_base_fan_in: int = 0
) -> dict[str, Any]:
    """Every optimizer's runs on ``task``: settings, final losses per seed, seed-0 curves.

    ``mup_base_fan_in``: μLO's base width for weights meta-trained with it (their JSON record), else 0.
    """
    for name, count in (("steps", steps), ("seeds", seeds)):
        if count < 1:
            raise cli.UsageError(f"--{name}={count} must be >= 1")
    default_lr = spec.defaults(AdamW)["learning_rate"]
    out: dict[str, Any] = {}
    lopt = functools.partial(_lopt, meta, steps, mup_base_fan_in)
    adam = functools.partial(adamw, steps=steps)
    lopt_runs = [train(task, lopt, 1.0, steps, s) for s in range(seeds)]
    out["lopt"] = {"setting": "shipped weights", "finals": [r[1] for r in lopt_runs], "curve": lopt_runs[0][0]}
    grid_runs = {lr: train(task, adam, lr, steps, 0) for lr in sorted(set(grid) | {default_lr})}
    best = min(grid_runs, key=lambda lr: grid_runs[lr][1])
    for name, lr in (("adamw-default", default_lr), ("adamw-tuned", best)):
        runs = [grid_runs[lr]] + [train(task, adam, lr, steps, s) for s in range(1, seeds)]
        out[name] = {"setting": f"lr={lr:g}", "finals": [r[1] for r in runs], "curve": runs[0][0]}
    out["adamw-grid"] = {f"{lr:g}": run[1] for lr, run in grid_runs.items()}
    return out


def learning_rates(texts: list[str]) -> list[float]:
    """``--adamw_grid``'s values as positive floats."""
    try:
        grid = [float(x) for x in texts]
    except ValueError:
        raise cli.UsageError(f"--adamw_grid={','.join(texts)} is not a comma-separated list of numbers") from None
    if any(not lr > 0 for lr in grid):
        raise cli.UsageError(f"--adamw_grid={','.join(texts)}: learning rates must be > 0")
    return grid


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(results: dict[str, Any]) -> str:
    """Markdown: final loss (mean +- std over seeds) per task and optimizer, and lopt's gaps to AdamW."""
    lines = ["| task | lopt (no tuning) | AdamW default lr | AdamW tuned lr | lopt vs default | lopt vs tuned |",
             "|---|---|---|---|---|---|"]
    for task, runs in results.items():
        cells, means = [], {}
        for name in ("lopt", "adamw-default", "adamw-tuned"):
            mean, std = _mean_std(runs[name]["finals"])
            means[name] = mean
            cells.append(f"{mean:.3f} ± {std:.3f} ({runs[name]['setting']})")
        gaps = [f"{100 * (means['lopt'] / means[b] - 1):+.1f}%" for b in ("adamw-default", "adamw-tuned")]
        lines.append(f"| {task} | " + " | ".join(cells + gaps) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(5 * len(results), 4))
    axes = fig.subplots(1, len(results), squeeze=False)
    for ax, (task, runs) in zip(axes[0], results.items(), strict=True):
        for name in ("lopt", "adamw-default", "adamw-tuned"):
            curve = np.asarray(runs[name]["curve"])
            window = max(len(curve) // 20, 1)
            smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window - 1, len(curve)), smooth, label=f"{name} ({runs[name]['setting']})")
        ax.set(title=task, xlabel="step", ylabel="training loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags (defined only when run as a script, so importing this module defines none)."""
    cli.define_output_folder_flag("workdir", None, "output folder")
    flags.DEFINE_string("tasks", "lm-w16-d1,lm-w64-d1,lm-w16-d3", "held-out tasks (experiments.lopt_tasks.family)")
    flags.DEFINE_string("weights", "mulo", "shipped weights name (mulo, lopt) or a .npz path")
    flags.DEFINE_integer("steps", 200, "training steps per run")
    flags.DEFINE_integer("seeds", 2, "task instances (seed 0 picks AdamW's learning rate)")
    flags.DEFINE_list("adamw_grid", ["1e-3", "3e-3", "1e-2", "3e-2"], "AdamW learning rates to tune over")
    cli.define_verbose_flag()


def earlier_results(workdir: Path, record: dict) -> dict | None:
    """The results ``workdir`` already holds for the settings ``record`` (None: it holds none).

    Raises:
      cli.UsageError: it holds results of other settings, which a rerun would overwrite.
    """
    path = workdir / "results.json"
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    if changes := cli.changed_settings(earlier["config"], json.loads(json.dumps(record))):  # the record as it would be written
        raise cli.UsageError(f"{workdir} holds results of other settings ({changes}); give a fresh --workdir")
    return earlier["results"]


def main(argv: list[str]) -> None:
    del argv
    cli.quiet_logging(FLAGS.verbose)
    workdir = Path(FLAGS.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    weights = mlp_lopt.weights_path(FLAGS.weights)
    meta = mlp_lopt.load_meta_params(weights)
    base = int(mlp_lopt.load_record(weights).get("mup_base_fan_in", 0))
    record = {
        "tasks": FLAGS.tasks, "steps": FLAGS.steps, "seeds": FLAGS.seeds, "adamw_grid": FLAGS.adamw_grid,
        "weights": str(weights), "weights_record": mlp_lopt.load_record(weights),
    }  # fmt: skip
    results = {}
    try:
        if (earlier := earlier_results(workdir, record)) is not None:
            print(f"{workdir} already holds these results; its files are kept as they are", flush=True)
            print(table(earlier))
            return
        grid = learning_rates(FLAGS.adamw_grid)
        for task in lopt_tasks.family(FLAGS.tasks):
            results[task.name] = evaluate_task(task, meta, steps=FLAGS.steps, seeds=FLAGS.seeds, grid=grid, mup_base_fan_in=base)
            print(table({task.name: results[task.name]}).splitlines()[-1], flush=True)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    (workdir / "results.json").write_text(json.dumps({"config": record, "results": results}, indent=1) + "\n")
    (workdir / "results.md").write_text(table(results))
    plot(results, workdir / "curves.png")
    print(table(results))


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("workdir")
    app.run(main, flags_parser=cli.parse_flags)
