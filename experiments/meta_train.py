r"""Meta-trains the MLP learned optimizer (`optim.learned.mlp_lopt`) with antithetic ES or truncated PES.

    python -m experiments.meta_train --workdir=runs/meta --estimator=pes --iterations=2000

Each *episode* draws a task from the family (`experiments.lopt_tasks`), an instance (task key) and
a horizon ``T`` (uniform in ``[min_horizon, max_horizon]``, in whole truncations); the inner problem
trains for ``T`` steps in truncations of ``K = truncation`` steps. Per truncation the meta-loss of
a member is its mean training loss over the truncation divided by the loss at the episode's start
(so tasks of different scales weigh alike; a non-finite loss counts as `DIVERGED_LOSS`).

With ``N = pairs`` antithetic pairs of perturbations ``+-eps_i``, ``eps_i ~ N(0, sigma^2 I)`` of the
flattened meta-parameters ``theta``, and ``L_i^+-`` the members' meta-losses:

- truncated ES: every member starts the truncation from the unperturbed trajectory's state, and
  ``g = 1 / (2 N sigma^2) sum_i eps_i (L_i^+ - L_i^-)``; the unperturbed trajectory advances with ``theta``.
- PES (Vicol, Metz & Sohl-Dickstein, "Unbiased Gradient Estimation in Unrolled Computation Graphs with
  Persistent Evolution Strategies", ICML 2021, Algorithm 2): every member keeps its own inner state
  across truncations and the sum ``xi_i`` of all perturbations it has received in the episode, and
  ``g = 1 / (2 N sigma^2) sum_i xi_i (L_i^+ - L_i^-)``, unbiased for the gradient of the truncation's
  loss through the whole unrolled history (``xi`` restarts with the episode).

``g`` feeds AdamW with gradient clipping (the meta-optimizer). Meta-training starts from the
Adam-like warm start of `optim.learned.mlp_lopt.init_meta_params` (``--nowarm_start``: random).
The ``2N`` members are one leading *population* axis, sharded over all devices of a 1-D mesh ``("population",)``: one ``jit`` for the
whole estimate, GSPMD splits the members. The reference estimators are google/learned_optimization
``outer_trainers/truncated_pes.py`` and ``truncated_es.py``.

Writes into ``--workdir``: ``checkpoint.npz`` (meta-parameters, meta-optimizer state, iteration, RNG;
a re-run with the same settings resumes from it, starting a fresh episode; one of a finished run changes
nothing; one with other settings is refused), ``metrics.jsonl`` (meta-loss per iteration),
``meta_loss.png``, and at the end the weights with their JSON record (``lopt.npz`` / ``lopt.json``,
or ``--weights_name``).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from matplotlib.figure import Figure
from jax.flatten_util import ravel_pytree

from experiments import cli, lopt_tasks
from optim.learned import mlp_lopt
from sharding import cpu_devices

DIVERGED_LOSS = 3.0  # meta-loss of a member whose inner loss is not finite (x the initial loss)
ESTIMATORS = ("es", "pes")

# An unrolled system for the estimators: (theta, state, key) -> (new state, meta-loss).
Unroll = Callable[[jax.Array, Any, jax.Array], tuple[Any, jax.Array]]


class Episode(NamedTuple):
    """One member's inner training run."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32
    horizon: jax.Array  # int32, the run's length (the learned optimizer's num_steps)
    task_key: jax.Array
    loss0: jax.Array  # the loss at the start, the meta-loss's unit


def _population_sharding(mesh: jax.sharding.Mesh | None, tree: Any) -> Any:
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, jax.NamedSharding(mesh, jax.P("population"))), tree)


def antithetic(key: jax.Array, dim: int, pairs: int, sigma: float) -> jax.Array:
    """``[eps_1 .. eps_N, -eps_1 .. -eps_N]``, ``eps_i ~ N(0, sigma^2 I_dim)``: shape ``(2N, dim)``."""
    eps = sigma * jax.random.normal(key, (pairs, dim))
    return jnp.concatenate([eps, -eps])


def antithetic_gradient(directions: jax.Array, losses: jax.Array, sigma: float) -> jax.Array:
    """``1 / (2 N sigma^2) sum_i d_i (L_i^+ - L_i^-)`` for ``directions`` of the positive members (N, dim)."""
    pairs = directions.shape[0]
    diff = losses[:pairs] - losses[pairs:]
    return jnp.einsum("p,pd->d", diff, directions) / (2 * pairs * sigma**2)


def es_estimate(
    unroll: Unroll, theta: jax.Array, state: Any, key: jax.Array, *, pairs: int, sigma: float, mesh=None
) -> tuple[jax.Array, Any, jax.Array]:
    """Truncated antithetic ES: ``(gradient, state advanced with theta, mean member meta-loss)``."""
    perturb_key, unroll_key = jax.random.split(key)
    eps = _population_sharding(mesh, antithetic(perturb_key, theta.shape[0], pairs, sigma))
    states = _population_sharding(mesh, jax.tree.map(lambda x: jnp.broadcast_to(x, (2 * pairs, *x.shape)), state))
    _, losses = jax.vmap(unroll, in_axes=(0, 0, None))(theta + eps, states, unroll_key)
    new_state, _ = unroll(theta, state, unroll_key)
    return antithetic_gradient(eps[:pairs], losses, sigma), new_state, jnp.mean(losses)


def pes_estimate(
    unroll: Unroll, theta: jax.Array, states: Any, xi: jax.Array, key: jax.Array, *, pairs: int, sigma: float, mesh=None
) -> tuple[jax.Array, Any, jax.Array, jax.Array]:
    """PES: ``(gradient, members' new states, new accumulated perturbations xi, mean member meta-loss)``."""
    perturb_key, unroll_key = jax.random.split(key)
    eps = _population_sharding(mesh, antithetic(perturb_key, theta.shape[0], pairs, sigma))
    xi = xi + eps
    states, losses = jax.vmap(unroll, in_axes=(0, 0, None))(theta + eps, _population_sharding(mesh, states), unroll_key)
    return antithetic_gradient(xi[:pairs], losses, sigma), states, xi, jnp.mean(losses)


def make_unroll(task: lopt_tasks.Task, unravel: Callable[[jax.Array], Any], truncation: int, mup_base_fan_in: int = 0) -> Unroll:
    """``(theta, episode, key) -> (episode after K steps of the learned optimizer, its meta-loss)``."""

    def unroll(theta, episode: Episode, key):
        del key  # batches come from the task key and step: the same for every member
        tx = mlp_lopt.scale_by_mlp_lopt(unravel(theta), episode.horizon, mup_base_fan_in=mup_base_fan_in)
        value_and_grad = jax.value_and_grad(task.loss)

        def step(carry, _):
            params, opt_state, i = carry
            loss, grads = value_and_grad(params, episode.task_key, i)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state, i + 1), loss

        (params, opt_state, i), losses = jax.lax.scan(step, (episode.params, episode.opt_state, episode.step), None, truncation)
        relative = jnp.where(jnp.isfinite(losses), losses / episode.loss0, DIVERGED_LOSS)
        meta_loss = jnp.mean(jnp.minimum(relative, DIVERGED_LOSS))
        return episode._replace(params=params, opt_state=opt_state, step=i), meta_loss

    return unroll


def new_episode(task: lopt_tasks.Task, unravel, theta: jax.Array, task_key: jax.Array, horizon: jax.Array) -> Episode:
    params = task.init(task_key)
    tx = mlp_lopt.scale_by_mlp_lopt(unravel(theta), horizon)
    loss0 = task.loss(params, task_key, jnp.int32(0))
    return Episode(params, tx.init(params), jnp.int32(0), horizon, task_key, loss0)


class MetaTrainer:
    """The meta-training loop's state and compiled steps (one estimate per task of the family)."""

    def __init__(self, tasks: list[lopt_tasks.Task], *, estimator: str, pairs: int, sigma: float, truncation: int,
                 learning_rate: float, clip: float, weight_decay: float, mesh: jax.sharding.Mesh | None, seed: int,
                 mup_base_fan_in: int = 0, warm_start: bool = True, initial: Any = None):
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator={estimator!r}: use one of {', '.join(ESTIMATORS)}")
        if mesh is not None and (2 * pairs) % mesh.size:
            raise ValueError(f"the population (2 * pairs = {2 * pairs}) must split over {mesh.size} devices; set pairs to a multiple of {mesh.size // math.gcd(2, mesh.size)}")
        self.mup_base_fan_in = mup_base_fan_in
        self.tasks, self.estimator, self.pairs, self.sigma, self.truncation, self.mesh = tasks, estimator, pairs, sigma, truncation, mesh
        if initial is None:  # the Adam-like warm start, or random
            initial = mlp_lopt.init_meta_params(jax.random.key(seed), warm_start=warm_start)
        theta, self.unravel = ravel_pytree(initial)
        self.meta_opt = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(learning_rate, weight_decay=weight_decay))
        self.theta, self.opt_state = theta, self.meta_opt.init(theta)
        self.iteration, self.key = 0, jax.random.key(seed + 1)
        self._compiled: dict[str, Callable] = {}
        self._episode_fns: dict[str, Callable] = {}

    def _step_fn(self, task: lopt_tasks.Task) -> Callable:
        if task.name in self._compiled:
            return self._compiled[task.name]
        unroll = make_unroll(task, self.unravel, self.truncation, self.mup_base_fan_in)
        kwargs = dict(pairs=self.pairs, sigma=self.sigma, mesh=self.mesh)

        def apply(grad, theta, opt_state):
            updates, opt_state = self.meta_opt.update(grad, opt_state, theta)
            return optax.apply_updates(theta, updates), opt_state

        if self.estimator == "es":
            def step(theta, opt_state, state, key):
                grad, state, loss = es_estimate(unroll, theta, state, key, **kwargs)
                return *apply(grad, theta, opt_state), state, loss
        else:
            def step(theta, opt_state, state, key):
                states, xi = state
                grad, states, xi, loss = pes_estimate(unroll, theta, states, xi, key, **kwargs)
                return *apply(grad, theta, opt_state), (states, xi), loss

        fn = jax.jit(step, donate_argnums=(2,))
        self._compiled[task.name] = fn
        return fn

    def start_episode(self, task: lopt_tasks.Task, horizon: int) -> Any:
        self.key, task_key = jax.random.split(self.key)
        if task.name not in self._episode_fns:
            self._episode_fns[task.name] = jax.jit(functools.partial(new_episode, task, self.unravel))
        episode = self._episode_fns[task.name](self.theta, task_key, jnp.int32(horizon))
        if self.estimator == "es":
            return episode
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (2 * self.pairs, *x.shape)), episode)
        return states, jnp.zeros((2 * self.pairs, self.theta.shape[0]), jnp.float32)

    def run_episode(self, task: lopt_tasks.Task, horizon: int, on_iteration: Callable[[float], None]) -> None:
        state = self.start_episode(task, horizon)
        step = self._step_fn(task)
        for _ in range(horizon // self.truncation):
            self.key, key = jax.random.split(self.key)
            self.theta, self.opt_state, state, loss = step(self.theta, self.opt_state, state, key)
            self.iteration += 1
            on_iteration(float(loss))

    def meta_params(self) -> Any:
        return self.unravel(self.theta)

    def save(self, path: Path, history: list[float], run: dict | None = None) -> None:
        """The meta-state, the meta-loss ``history`` and the caller's JSON-able ``run`` record, in one file."""
        leaves = jax.tree.leaves(self.opt_state)
        arrays = {f"opt_{i}": np.asarray(x) for i, x in enumerate(leaves)}
        key_data = np.asarray(jax.random.key_data(self.key))
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp, theta=np.asarray(self.theta), key=key_data, iteration=self.iteration, history=np.asarray(history),
            run=np.asarray(json.dumps(run or {})), **arrays,
        )  # fmt: skip
        tmp.replace(path)

    def restore(self, path: Path) -> tuple[list[float], dict]:
        """Loads what `save` wrote; returns the history and the run record (empty from older checkpoints)."""
        with np.load(path) as data:
            self.theta = jnp.asarray(data["theta"])
            treedef = jax.tree.structure(self.opt_state)
            self.opt_state = jax.tree.unflatten(treedef, [jnp.asarray(data[f"opt_{i}"]) for i in range(treedef.num_leaves)])
            self.key = jax.random.wrap_key_data(jnp.asarray(data["key"]))
            self.iteration = int(data["iteration"])
            run = json.loads(str(data["run"])) if "run" in data else {}
            return [float(x) for x in data["history"]], run


def plot_meta_loss(history: list[float], path: Path, title: str) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(history, alpha=0.3, label="per iteration")
    window = max(len(history) // 30, 1)
    if len(history) >= window:
        smooth = np.convolve(history, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window - 1, len(history)), smooth, label=f"mean of {window}")
    ax.set(xlabel="meta-iteration (truncation)", ylabel="meta-loss (loss / initial loss)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """The command line's flags (defined only when run as a script, so importing this module defines none)."""
    cli.define_output_folder_flag("workdir", None, "output folder (resumes from its checkpoint.npz)", flag_values=flag_values)
    flags.DEFINE_enum("estimator", "pes", ESTIMATORS, "gradient estimator", flag_values=flag_values)
    flags.DEFINE_string("tasks", "mlp_regression,mlp_classification,lm-w16-d1,lm-w32-d1", "task family (experiments.lopt_tasks.family)", flag_values=flag_values)
    flags.DEFINE_integer("iterations", 1000, "meta-iterations (truncations)", flag_values=flag_values)
    flags.DEFINE_integer("pairs", 4, "antithetic pairs (population = 2 * pairs, split over the devices)", flag_values=flag_values)
    flags.DEFINE_float("sigma", 0.01, "perturbation standard deviation", flag_values=flag_values)
    flags.DEFINE_integer("truncation", 10, "inner steps per truncation", flag_values=flag_values)
    flags.DEFINE_integer("min_horizon", 50, "shortest inner run (steps)", flag_values=flag_values)
    flags.DEFINE_integer("max_horizon", 200, "longest inner run (steps)", flag_values=flag_values)
    flags.DEFINE_float("learning_rate", 3e-3, "meta-optimizer (AdamW) learning rate", flag_values=flag_values)
    flags.DEFINE_float("clip", 1.0, "meta-gradient clipping norm", flag_values=flag_values)
    flags.DEFINE_float("weight_decay", 1e-4, "meta-optimizer weight decay", flag_values=flag_values)
    flags.DEFINE_integer("num_devices", 0, "CPU devices to split the population over (0: what jax has)", flag_values=flag_values)
    flags.DEFINE_integer("seed", 0, "seed", flag_values=flag_values)
    flags.DEFINE_integer("checkpoint_every", 50, "meta-iterations between checkpoints", flag_values=flag_values)
    flags.DEFINE_string("weights_name", "lopt", "file name of the weights written at the end", flag_values=flag_values)
    flags.DEFINE_bool("warm_start", True, "start from the Adam-like MLP (mlp_lopt.init_meta_params), else random", flag_values=flag_values)
    flags.DEFINE_string("init_weights", "", "start from these meta-parameters instead (a shipped name such as lopt, or a .npz path)", flag_values=flag_values)
    flags.DEFINE_integer("mup_base_fan_in", 0, "record this base width with the weights (μLO); 0: none", flag_values=flag_values)
    cli.define_verbose_flag(flag_values)


def check_schedule(flag_values: flags.FlagValues = FLAGS) -> None:
    """Raises `cli.UsageError` for flags that would crash the loop or never advance it, naming the flag."""
    cli.check_counts("iterations", "pairs", "truncation", "min_horizon", "checkpoint_every", flag_values=flag_values)
    f = flag_values
    if not f.sigma > 0:
        raise cli.UsageError(f"--sigma={f.sigma} must be > 0")
    if f.num_devices < 0:
        raise cli.UsageError(f"--num_devices={f.num_devices} must be >= 0 (0: the devices jax has)")
    if f.max_horizon < max(f.min_horizon, f.truncation):  # an episode of no truncation: the loop would never advance
        raise cli.UsageError(
            f"--max_horizon={f.max_horizon} must be at least --min_horizon={f.min_horizon} and --truncation={f.truncation}"
        )


def run_settings(flag_values: flags.FlagValues = FLAGS) -> dict:
    """What shapes a meta-training run's trajectory: a resumed run must have the same (`check_resume`)."""
    f = flag_values
    settings = {
        "estimator": f.estimator,
        "tasks": f.tasks,
        "pairs": f.pairs,
        "sigma": f.sigma,
        "truncation": f.truncation,
        "horizons": [f.min_horizon, f.max_horizon],
        "meta_optimizer": f"adamw lr={f.learning_rate} clip={f.clip} wd={f.weight_decay}",
        "seed": f.seed,
        "warm_start": f.init_weights or f.warm_start,
    }
    return settings | ({"mup_base_fan_in": f.mup_base_fan_in} if f.mup_base_fan_in else {})


def check_resume(workdir: Path, saved: dict | None, settings: dict) -> None:
    """Raises `cli.UsageError` when the checkpoint in ``workdir`` was written with ``saved`` settings other
    than ``settings`` (a checkpoint that recorded none is not checked)."""
    if saved and (changes := cli.changed_settings(saved, settings)):
        raise cli.UsageError(f"{workdir} holds a meta-training run with other settings ({changes}); give its flags or a fresh --workdir")


def main(argv: list[str]) -> None:
    del argv
    cli.quiet_logging(FLAGS.verbose)
    train(FLAGS)


def train(f: flags.FlagValues) -> None:
    """The command line's run, of parsed flags ``f``: meta-trains in ``f.workdir``, resuming its checkpoint.

    Exits with status 2 and one line for bad flags, a population that does not split over the devices, or a
    checkpoint of other settings."""
    try:
        check_schedule(f)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    if f.num_devices:
        cpu_devices.use(f.num_devices)
    workdir = Path(f.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tasks = lopt_tasks.family(f.tasks)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("population",), axis_types=(jax.sharding.AxisType.Auto,))
    try:
        trainer = MetaTrainer(tasks, estimator=f.estimator, pairs=f.pairs, sigma=f.sigma,
                              truncation=f.truncation, learning_rate=f.learning_rate, clip=f.clip,
                              weight_decay=f.weight_decay, mesh=mesh, seed=f.seed,
                              mup_base_fan_in=f.mup_base_fan_in, warm_start=f.warm_start,
                              initial=mlp_lopt.load_meta_params(mlp_lopt.weights_path(f.init_weights)) if f.init_weights else None)
    except ValueError as e:  # a population that does not split over the devices
        cli.usage_exit(str(e))
    checkpoint, settings = workdir / "checkpoint.npz", run_settings(f)
    history, saved = trainer.restore(checkpoint) if checkpoint.exists() else ([], {})
    try:
        check_resume(workdir, saved.get("settings"), settings)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    if history and trainer.iteration >= f.iterations:
        print(
            f"{workdir} already finished: its checkpoint is at meta-iteration {trainer.iteration} >= --iterations={f.iterations}; "
            "its files are kept as they are (raise --iterations to train further)",
            flush=True,
        )
        return
    if history:
        print(f"resumed at meta-iteration {trainer.iteration}", flush=True)
    rng = np.random.default_rng([f.seed, trainer.iteration])
    started, seconds_before = time.time(), saved.get("wall_seconds", 0.0)
    metrics = open(workdir / "metrics.jsonl", "a")

    def save_all() -> None:
        """Checkpoint, plot and the weights so far with their record (a run stopped early still ships)."""
        seconds = seconds_before + time.time() - started  # over every process of the run
        trainer.save(checkpoint, history, {"settings": settings, "wall_seconds": seconds})
        plot_meta_loss(history, workdir / "meta_loss.png", f"{f.estimator.upper()} meta-training")
        record = settings | {
            "iterations": trainer.iteration,
            "command": "python -m experiments.meta_train " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} host, {len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
            "wall_seconds": round(seconds),
            "final_meta_loss_mean_last_50": float(np.mean(history[-50:])) if history else None,
        }
        mlp_lopt.save_meta_params(workdir / f"{f.weights_name}.npz", trainer.meta_params(), record)

    def on_iteration(loss: float) -> None:
        history.append(loss)
        metrics.write(json.dumps({"iteration": trainer.iteration, "task": task.name, "meta_loss": loss}) + "\n")
        if trainer.iteration % 10 == 0:
            recent = history[-50:]
            print(f"iteration {trainer.iteration}/{f.iterations}  {task.name}  meta-loss {loss:.4f} "
                  f"(mean of last {len(recent)}: {sum(recent) / len(recent):.4f})  {time.time() - started:.0f}s", flush=True)
            metrics.flush()
        if trainer.iteration % f.checkpoint_every == 0:
            save_all()

    with jax.set_mesh(mesh):
        while trainer.iteration < f.iterations:
            task = tasks[rng.integers(len(tasks))]
            truncations = rng.integers(f.min_horizon // f.truncation, f.max_horizon // f.truncation + 1)
            truncations = min(truncations, f.iterations - trainer.iteration)
            trainer.run_episode(task, int(truncations) * f.truncation, on_iteration)
    metrics.close()
    save_all()
    print(f"wrote {workdir / f.weights_name}.npz", flush=True)


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("workdir")
    app.run(main, flags_parser=cli.parse_flags)
